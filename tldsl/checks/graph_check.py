"""The fused ops captured in CUDA graphs and replayed, on GPUs (run under torchrun): for every
variant of ``dist_check`` (or those named), two eager calls, one call captured in
``torch.cuda.graph``, then ``--replays`` replays (default 100), each after fresh inputs are copied
into the captured input tensors, each output compared with a reference computed on this rank from
the same seeded inputs of every rank; then one more eager call (the op stays in graph mode).

    torchrun --nproc_per_node=2 -m tldsl.checks.graph_check
    torchrun --nproc_per_node=2 -m tldsl.checks.graph_check --ops ag_gemm --variants copy_engine,sm-push
    torchrun --nproc_per_node=1 -m tldsl.checks.graph_check      # one GPU: capture legality, W = 1

The protocol (runtime/dist/fused_op.py): a captured launch is launch 1 after a device-side barrier,
reset of every counter, barrier — so each replay starts from fresh counters. NVSHMEM workspaces have
no torch barrier handle: those variants are expected to refuse the capture with a clear error.
One PASS/FAIL line per variant; exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import sys
import time

from ..errors import InputError
from ..runtime.dist.nvshmem import NvshmemError
from .dist_check import compare, variants
from .verdict import report


def _inputs(torch, op_name, i, q, shapes, dtype):
    """Replay ``i``'s inputs of rank ``q`` (the same on every rank: seeded by both)."""
    g = torch.Generator(device="cuda").manual_seed(7919 * i + q)
    if op_name == "ag_gemm":
        (Ms, K), _ = shapes
        return (torch.randn(Ms, K, device="cuda", dtype=dtype, generator=g),)
    (M, K), (_, N) = shapes
    return (torch.randn(M, K, device="cuda", dtype=dtype, generator=g),
            torch.randn(K, N, device="cuda", dtype=dtype, generator=g) / 8)


def run_variant(torch, v, replays: int, rows: int, K: int, N: int):
    """(passed, detail) for one variant."""
    import torch.distributed as dist
    from tldsl.runtime.dist import AllGatherMatmul, MatmulReduceScatter
    W, r = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, v.dtype)
    Ms = v.rows or rows
    kw = dict(v.kwargs)
    if v.op == "ag_gemm":
        op = AllGatherMatmul(Ms, K, N, dtype, **kw)
        b = torch.randn(K, N, device="cuda", dtype=dtype, generator=torch.Generator(device="cuda").manual_seed(5)) / 8
        shapes = ((Ms, K), (K, N))

        def ref(i):
            shards = [_inputs(torch, "ag_gemm", i, q, shapes, dtype)[0] for q in range(W)]
            full = torch.cat(shards)
            return full, full.float() @ b.float()

        def call(args):
            return op(args[0], b)

        def check(i, out):
            want_a, want_c = ref(i)
            res = compare(out[1], want_c)
            return bool(torch.equal(out[0], want_a)) and res["ok"], res.get("detail") or "A_gathered differs"
    else:
        op = MatmulReduceScatter(W * Ms, K, N, dtype, **kw)
        shapes = ((W * Ms, K), (K, N))

        f32 = kw.get("partial_dtype") == "f32"

        def ref(i):
            """As dist_check.rs_reference, from every rank's seeded inputs: the fp32 sum of this
            rank's rows of the products (each rounded to A's dtype unless the partials are fp32),
            and the slack of one ulp of every rounded partial."""
            rows = slice(r * Ms, (r + 1) * Ms)
            parts = [(a[rows].float() @ b_.float()) for a, b_ in (_inputs(torch, "gemm_rs", i, q, shapes, dtype)
                                                                 for q in range(W))]
            if f32:
                return sum(parts), None
            slack = sum(p.abs() for p in parts) * 2.0 ** (-10 if dtype == torch.float16 else -7)
            return sum(p.to(dtype).float() for p in parts), slack

        def call(args):
            return op(*args)

        def check(i, out):
            want, slack = ref(i)
            res = compare(out, want, slack=slack)
            return res["ok"], res.get("detail") or ""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                       # warm-up, as torch.cuda.graph asks
            for i in (1, 2):
                out = call(_inputs(torch, v.op, i, r, shapes, dtype))
                ok, detail = check(i, out)
                if not ok:
                    bad_eager = f"eager call {i}: {detail}"
                    break
            else:
                bad_eager = None
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if bad_eager:
            return False, bad_eager
        static = tuple(t.clone() for t in _inputs(torch, v.op, 0, r, shapes, dtype))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(static)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bad = []                # every replay runs whatever the checks say: a rank that stopped would hang its peers
        for i in range(3, 3 + replays):
            for dst, src in zip(static, _inputs(torch, v.op, i, r, shapes, dtype)):
                dst.copy_(src)
            graph.replay()
            ok, detail = check(i, out)
            if not ok:
                bad.append(f"replay {i - 2}: {detail}")
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / replays
        i = 3 + replays
        ok, detail = check(i, call(_inputs(torch, v.op, i, r, shapes, dtype)))
        if not ok:
            bad.append(f"eager call after the replays: {detail}")
        if bad:
            return False, f"{len(bad)} wrong of {replays} replays and one eager call; first: {bad[0]}"
        return True, f"{replays} replays right ({dt * 1e3:.2f} ms a replay with its checks)"
    except Exception as e:          # noqa: BLE001 - a refusal is the verdict of an NVSHMEM variant
        if "nvshmem" in v.name and "cannot start a launch from fresh counters" in str(e):
            return True, "refused, as expected (NVSHMEM workspace)"
        return False, f"{type(e).__name__}: {e}"
    finally:
        torch.cuda.synchronize()
        op.close()


def run(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist.group import init_ranks
    p = argparse.ArgumentParser(prog="graph_check")
    p.add_argument("--ops", default="ag_gemm,gemm_rs")
    p.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--rows", type=int, default=1000, help="rows per rank where the variant takes any")
    p.add_argument("--k", type=int, default=1032)
    p.add_argument("--n", type=int, default=1024)
    args = p.parse_args(argv)
    init_ranks()
    names = {x for x in args.variants.split(",") if x}
    results = []
    for op_name in args.ops.split(","):
        for v in variants(op_name):
            if names and v.name not in names:
                continue
            try:
                ok, detail = run_variant(torch, v, args.replays, args.rows, args.k, args.n)
            except InputError as e:     # refused before anything ran (e.g. the GEMM's push on one rank)
                ok, detail = True, f"refused before any launch, as it should be here: {str(e).splitlines()[0]}"
            except NvshmemError as e:   # every rank alike: the NVSHMEM host library is not installed here
                ok, detail = False, f"not run: {str(e).splitlines()[0]}"
            results.append((v.label, ok, detail))
            if dist.get_rank() == 0:    # as it goes: a later crash keeps the verdicts so far
                print(f"graph_check {v.label}: {'PASS' if ok else 'FAIL'} {detail}", flush=True)
    dist.barrier()
    return report("graph_check", results)


if __name__ == "__main__":
    sys.exit(run())
