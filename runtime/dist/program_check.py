"""FusedProgram and ``tl.run(..., group=...)`` on GPUs, one rank per GPU (run under torchrun):

    torchrun --standalone --nproc_per_node=2 -m tldsl.runtime.dist.program_check [--launches 4] [--only NAME,...]

Every library op's kernel (AllGather+GEMM on SMs and on the copy engine, GEMM+ReduceScatter, the
MoE pair, sequence-parallel attention) and three hand-written programs (an RMSNorm gathered by a
communication part, tutorials/04's RMSNorm pushed to every rank, a ring that pushes, notifies and
pulls) run through :class:`.FusedProgram`:

* ``tl.run(kernel, inputs=mine, group=WORLD)`` — one launch, compared with the op's numpy
  reference (or, for the hand-written programs, ``tl.simulate`` on this host);
* ``--launches`` launches back to back without synchronising, each with fresh inputs — every
  launch's outputs compared (the epoch: a launch's waits are not satisfied by the one before) —
  and every signal counter checked to have grown by the same step each launch.

Each rank builds every rank's inputs from the same seed and keeps its own. Prints one line per
case (rank 0) and exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import tldsl as tl


@tl.kernel
def rmsnorm_gather(x: tl.Symmetric, g, y, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    """A communication part on SMs RMS-normalises each peer's rows as it gathers them and
    notifies a compute part that scales them."""
    Ms, N = x.shape
    W = tl.world_size()
    ready = tl.signal("ready", W)

    @tl.comm_part(grid=(W,), engine="sm")
    def gather(p):
        t = tl.tile_pull_data(x.at(p), (0, 0), (Ms, N)).to(tl.float32)
        tl.store(g, (p * Ms, 0), t * tl.rsqrt(tl.sum(t * t, 1) / N + 1e-6)[:, None])
        tl.producer_tile_notify(ready, p)

    @tl.compute_part(grid=(W,))
    def part(p):
        tl.consumer_tile_wait(ready, p, count=1)
        tl.store(y, (p * Ms, 0), tl.load(g, (p * Ms, 0), (Ms, N)) * 2.0 + 1.0)


@tl.kernel
def ring(x: tl.Symmetric, y: tl.Symmetric, z, *, compute: tl.ComputeSchedule = None):
    """Each rank pushes twice its rows into the next rank, notifies it, waits for the previous
    rank's push and adds the previous rank's rows, pulled."""
    M, N = x.shape
    BM = compute.tile[0]
    W = tl.world_size()
    arrived = tl.signal("arrived", tl.cdiv(M, BM), scope="symmetric")

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        nxt, prv = (tl.rank() + 1) % W, (tl.rank() + W - 1) % W
        tl.tile_push_data(y.at(nxt), (pm * BM, 0), tl.load(x, (pm * BM, 0), (BM, N)) * 2.0)
        tl.peer_tile_notify(arrived, pm, nxt)
        tl.peer_tile_wait(arrived, pm, count=1)
        u = tl.tile_pull_data(x.at(prv), (pm * BM, 0), (BM, N))
        tl.store(z, (pm * BM, 0), tl.load(y, (pm * BM, 0), (BM, N)) + u)


@tl.kernel
def rmsnorm_allgather(x, w, out: tl.Symmetric, *, compute: tl.ComputeSchedule = None):
    """tutorials/04's program: out = all_gather(rms_norm(x) * w), each normalised tile pushed to
    every rank as it is made (no signal: the launch's end is the only synchronisation)."""
    W = tl.world_size()
    Ms, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(Ms, BM),))
    def norm(pm):
        me = tl.rank()
        r0 = pm * BM
        ss = tl.fragment((BM,), tl.float32)
        for c in tl.range(0, N, BN):
            t = tl.cast(tl.load(x, (r0, c), (BM, BN)), tl.float32)
            ss.write(ss.read() + tl.sum(t * t, 1))
        inv = tl.expand_dims(tl.rsqrt(ss.read() / N + 1e-6), 1)
        for c in tl.range(0, N, BN):
            t = tl.cast(tl.load(x, (r0, c), (BM, BN)), tl.float32)
            g = tl.cast(tl.load(w, (0, c), (1, BN)), tl.float32)
            y = tl.cast(t * inv * g, out.dtype)
            for p in tl.static_range(W):
                tl.tile_push_data(out.at(p), (me * Ms + r0, c), y)


def cases(W: int, rng) -> dict:
    """name -> (kernel, every rank's inputs, keyword values, every rank's expected outputs or None
    (then tl.simulate decides), rtol)."""
    from ..sim.simulate import simulate
    from ...ops import allgather_gemm as agm, gemm_reduce_scatter as grs
    from ...ops.moe import allgather_moe, make_allgather_case, make_reduce_scatter_case, moe_reduce_scatter
    from ...ops.sp_attention import make_case as sp_case, sp_attention
    c64 = tl.ComputeSchedule(tile=(64, 64, 32))
    out = {}
    c = agm.make_case(rng, W, rows_per_rank=192, n=256, k=128, compute=c64, comm=tl.CommSchedule(sms=2))
    out["allgather_gemm"] = (agm.allgather_gemm, c.inputs, c.kwargs, c.expected, c.rtol)
    c = agm.make_case(rng, W, rows_per_rank=192, n=256, k=128, compute=c64, comm=tl.CommSchedule(engine="copy_engine"))
    out["allgather_gemm_ce"] = (agm.allgather_gemm, c.inputs, c.kwargs, c.expected, c.rtol)
    c = grs.make_case(rng, W, rows_per_rank=128, n=256, k_per_rank=128, compute=c64, comm=tl.CommSchedule(sms=2))
    out["gemm_reduce_scatter"] = (grs.gemm_reduce_scatter, c.inputs, c.kwargs, c.expected, c.rtol)
    c = make_allgather_case(rng, W, rows_per_rank=96, k=64, n=128, num_experts=4, topk=2, compute=c64,
                            comm=tl.CommSchedule(tile_m=32, mode="pull"))
    out["allgather_moe"] = (allgather_moe, c.inputs, c.kwargs, c.expected, c.rtol)
    c = make_reduce_scatter_case(rng, W, rows_per_rank=96, k=64, n=128, num_experts=4, topk=2, compute=c64,
                                 comm=tl.CommSchedule(tile_m=32, mode="push"))
    out["moe_reduce_scatter"] = (moe_reduce_scatter, c.inputs, c.kwargs, c.expected, c.rtol)
    c = sp_case(rng, W, seq_per_rank=256, heads=2, head_dim=64, causal=True,
                compute=tl.ComputeSchedule(tile=(128, 64, 64)), comm=tl.CommSchedule(tile_m=64, mode="pull"))
    out["sp_attention"] = (sp_attention, c.inputs, c.kwargs, c.expected, c.rtol)
    x = [{"x": rng.standard_normal((64, 128)).astype(np.float32), "g": np.zeros((64 * W, 128), np.float32),
          "y": np.zeros((64 * W, 128), np.float32)} for _ in range(W)]
    kw = {"compute": tl.ComputeSchedule(tile=(64, 128, 32)), "comm": tl.CommSchedule(sms=2)}
    out["rmsnorm_gather"] = (rmsnorm_gather, x, kw, [simulate(rmsnorm_gather, W, x, **kw)[r] for r in range(W)], 1e-4)
    x = [{"x": rng.standard_normal((128, 256)).astype(np.float16), "w": rng.standard_normal((1, 256)).astype(np.float16),
          "out": np.full((128 * W, 256), np.nan, np.float16)} for _ in range(W)]
    kw = {"compute": tl.ComputeSchedule(tile=(32, 64, 32))}
    out["rmsnorm_allgather"] = (rmsnorm_allgather, x, kw, [simulate(rmsnorm_allgather, W, x, **kw)[r] for r in range(W)],
                                2e-2)
    x = [{n: rng.standard_normal((128, 64)).astype(np.float32) for n in "xyz"} for _ in range(W)]
    kw = {"compute": tl.ComputeSchedule(tile=(32, 64, 32))}
    out["ring"] = (ring, x, kw, [simulate(ring, W, x, **kw)[r] for r in range(W)], 1e-5)
    return out


def close_enough(got: dict, want: dict, rtol: float) -> list[str]:
    """What differs: ``name: max error E over tolerance T`` for each expected array."""
    bad = []
    for name, w in want.items():
        g = np.asarray(got[name], np.float64)
        w = np.asarray(w, np.float64)
        if g.shape != w.shape:
            bad.append(f"{name}: shape {g.shape}, expected {w.shape}")
            continue
        nan = np.isnan(w)
        if not np.array_equal(nan, np.isnan(g)):
            bad.append(f"{name}: NaN at {int((np.isnan(g) != nan).sum())} other places (unwritten tiles?)")
            continue
        scale = max(1.0, float(np.abs(w[~nan]).max(initial=0.0)))
        err = float(np.abs(g - w)[~nan].max(initial=0.0))
        if err > rtol * scale:
            bad.append(f"{name}: max error {err:.3g} over {rtol * scale:.3g}")
    return bad


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from .group import init_ranks
    ap = argparse.ArgumentParser(prog="python -m tldsl.runtime.dist.program_check")
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--only", default="")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    init_ranks()
    W, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    only = {s for s in args.only.split(",") if s}
    rng = np.random.default_rng(args.seed)
    failures = 0
    for name, (fn, inputs, kw, expected, rtol) in cases(W, rng).items():
        if only and name not in only:
            continue
        problems = check_case(fn, inputs, kw, expected, rtol, group, rank, W, args.launches, args.seed)
        every = [None] * W
        dist.all_gather_object(every, problems, group=group)
        bad = [(q, p) for q, ps in enumerate(every) for p in ps]
        failures += bool(bad)
        if rank == 0:
            print(f"program_check {name} W={W}: " + ("PASS" if not bad else
                  "FAIL " + "; ".join(f"rank {q}: {p}" for q, p in bad[:6])), flush=True)
    torch.cuda.synchronize()
    if rank == 0:
        print("program_check: all passed" if not failures else f"program_check: {failures} case(s) failed", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


def check_case(fn, inputs, kw, expected, rtol, group, rank: int, W: int, launches: int, seed: int = 0) -> list[str]:
    """One case on this rank: ``tl.run(..., group=)`` against ``expected``; then ``launches``
    back-to-back FusedProgram launches with fresh inputs, each against ``tl.simulate`` of its
    inputs, and the counters' steps. Returns what went wrong (nothing: it passed)."""
    from .program_op import FusedProgram
    problems = []
    try:
        res = tl.run(fn, inputs=inputs[rank], group=group, timeout_s=60.0, **kw)
        want = {k: v for k, v in expected[rank].items() if k in res[rank]}
        problems += [f"tl.run {p}" for p in close_enough(res[rank], want, rtol)]
        op = FusedProgram(fn, group, inputs[rank], timeout_s=60.0, **kw)
        at = op.device.torch_device
        done, counters = [], []
        for L in range(1, launches + 1):
            mine = _perturbed(inputs, np.random.default_rng(1000 * seed + L))
            tensors = {b.name: _device(mine[rank][b.name], b.type.dtype, at) for b in op.kernel.args}
            op(**tensors)
            if L <= 2:
                op.synchronize()
                counters.append({k: list(v) for k, v in op.signal_counters().items()})
            done.append((mine, tensors))
        op.synchronize()
        last = {k: list(v) for k, v in op.signal_counters().items()}
        for L, (mine, tensors) in enumerate(done, start=1):
            ref = tl.simulate(fn, W, mine, **kw)[rank]
            got = {k: _host(t) for k, t in tensors.items()}
            problems += [f"launch {L} {p}" for p in close_enough(got, {k: ref[k] for k in expected[rank] if k in ref},
                                                                 max(rtol, 1e-3))]
        if len(counters) == 2:
            for sig, first in counters[0].items():
                step = [b - a for a, b in zip(first, counters[1][sig])]
                want_last = [a + (launches - 1) * s for a, s in zip(first, step)]
                if last[sig] != want_last:
                    problems.append(f"signal {sig}: {last[sig]} after {launches} launches, expected {want_last} "
                                    f"(steps {step})")
        op.close()
    except Exception as e:      # noqa: BLE001 - reported per case
        problems.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return problems


def _perturbed(inputs: list[dict], rng) -> list[dict]:
    """Every rank's inputs with fresh values in the float arguments that are not NaN-poisoned
    outputs (index tables and routing kept: they must stay valid)."""
    out = []
    for per in inputs:
        mine = {}
        for k, v in per.items():
            v = np.asarray(v)
            if v.dtype.kind == "f" and not np.isnan(v).any() and v.any():
                mine[k] = (v + rng.standard_normal(v.shape) * 0.25).astype(v.dtype)
            else:
                mine[k] = v.copy()
        out.append(mine)
    return out


def _device(arr, dtype, at):
    from ..gpu.run_program import to_device
    return to_device(arr, dtype, at)


def _host(t):
    import torch
    return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy()


if __name__ == "__main__":
    sys.exit(main())
