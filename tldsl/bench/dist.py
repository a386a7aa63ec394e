"""Distributed benchmarks (run under torchrun): our fused ops beside the peers, one run.

    torchrun --nproc_per_node=2 -m tldsl.bench ag_gemm [--shapes MxNxK,...] [--iters 20]
    torchrun --nproc_per_node=2 -m tldsl.bench gemm_rs [--shapes MxNxK,...] [--iters 20]
    torchrun --nproc_per_node=2 -m tldsl.bench ag_gemm --sweep [--shapes ...]   # every candidate schedule
    torchrun --nproc_per_node=2 -m tldsl.bench gemm_rs --tune                    # ours = the tuned schedule

Columns: ours, sequential NCCL collective + cuBLAS, PyTorch async-TP
(``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``), NCCL comm
alone, cuBLAS GEMM alone, our GEMM alone (the fused op's own GEMM kernel, on the SMs the
schedule gives it, with its waits satisfied: the fused op's floor if communication were free),
ideal = max(comm, gemm), and ratios. M, N, K are the global sizes.
AG+GEMM: A shards are [M/W, K], B is the column shard [K, N/W] (tensor-parallel MLP
up-projection). GEMM+RS: A is [M, K/W], B the row shard [K/W, N], the [M, N] partial sums are
reduce-scattered to [M/W, N] (down-projection). Each time is the median over iterations of the
slowest rank (barrier + synchronise before each call), all columns timed interleaved
(:func:`bench_interleaved`).

``--sweep`` runs the autotuner (:mod:`tldsl.runtime.dist.autotune`) over the candidate
(compute, comm) schedules — copy engine vs SMs, push vs pull, two compute tile orders — printing
every candidate's time (each checked for correctness first) and storing the winner in the
cache; ``--tune`` uses the cached winner (tuning on a miss) as "ours".
"""
from __future__ import annotations

import statistics
import sys

#: (N, K) of tensor-parallel MLP layers (the up-projection; GEMM+RS runs the down-projection,
#: N and K swapped), for ``--shapes NAME`` at M = 8192
MODELS = {"llama8b": (14336, 4096), "llama70b": (28672, 8192), "llama405b": (53248, 16384)}
AG_SHAPES = [(m, n, 8192) for n in (28672, 8192) for m in (2048, 4096, 8192, 16384)]
RS_SHAPES = [(m, n, k) for (n, k) in ((8192, 28672), (8192, 8192)) for m in (2048, 4096, 8192, 16384)]


def _cuda_event_timer(fn) -> float:
    """Milliseconds of one call of ``fn`` between CUDA events, every rank starting together."""
    import torch
    import torch.distributed as dist
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)


def _max_over_ranks(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist
    t = torch.tensor(values, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def bench_interleaved(fns: dict, iters: int = 20, warm: int = 5, *, timer=None, reduce_max=None) -> dict:
    """Median milliseconds of every callable in ``fns``, timed **interleaved**: each iteration
    times each of them once, in an order rotated by one per iteration, so that clock and
    temperature drift, and the idle gap before a call, fall on all of them alike (timing one
    after the other in blocks favoured whichever ran first by up to 15%). Each rank's median,
    then the slowest rank's. A callable whose warm-up raises gets NaN (on every rank: the
    failure is agreed on before anything is timed)."""
    timer = timer or _cuda_event_timer
    reduce_max = reduce_max or _max_over_ranks
    names, broken = list(fns), set()
    for name in names:
        try:
            for _ in range(warm):
                fns[name]()
        except Exception as ex:   # noqa: BLE001 - a peer that cannot run here (e.g. async-TP)
            print(f"# {name} failed: {ex!r:.200}", file=sys.stderr)
            broken.add(name)
    failed = reduce_max([1.0 if n in broken else 0.0 for n in names])
    live = [n for n, f in zip(names, failed) if f == 0.0]
    times = {n: [] for n in live}
    for i in range(iters):
        for j in range(len(live)):
            n = live[(i + j) % len(live)]
            times[n].append(timer(fns[n]))
    medians = reduce_max([statistics.median(times[n]) for n in live]) if live else []
    out = {n: float("nan") for n in names}
    out.update(dict(zip(live, medians)))
    return out


def _enable_symm_mem(gname):
    from tldsl.runtime.dist.group import enable_symmetric_memory
    enable_symmetric_memory(gname)


def bench_ag_gemm(shapes, iters, out=sys.stdout, schedule=None, handshake=None, pusher=None, dtype="bfloat16"):
    """``schedule``: None (the op's defaults) or a function (M, N, K) -> (compute, comm);
    ``handshake``: the copy-engine pull's barrier (``device``, ``memops`` or ``kernel``); ``pusher``: who pushes
    the shards on the copy-engine push path (``copy_engine`` or ``gemm``); ``dtype``: ``bfloat16``
    or ``float16`` (ours and every peer alike)."""
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist import AllGatherMatmul
    r, W = dist.get_rank(), dist.get_world_size()
    gname = dist.group.WORLD.group_name
    _enable_symm_mem(gname)
    dt = getattr(torch, dtype)
    rows = []
    for (M, N, K) in shapes:
        torch.manual_seed(1234 + r)
        a = torch.randn(M // W, K, device="cuda", dtype=dt)
        b = torch.randn(K, N // W, device="cuda", dtype=dt)
        ag = torch.empty(M, K, device="cuda", dtype=dt)
        kw = _ag_kwargs(schedule(M, N, K) if schedule else None)
        if handshake is not None:
            kw["handshake"] = handshake
        if pusher is not None:
            kw["pusher"] = pusher
        op = AllGatherMatmul(M // W, K, N // W, dt, **kw)
        # correctness first: against NCCL all-gather + cuBLAS, workspace poisoned
        got_a, got_c = op(a, b, poison_workspace=True)
        dist.all_gather_into_tensor(ag, a)
        ref = torch.mm(ag, b)
        torch.cuda.synchronize()
        ok_a = torch.equal(got_a, ag)
        err = (got_c.float() - ref.float()).abs().max().item()
        ok = ok_a and err <= 2e-2 * ref.float().abs().max().item() + 1e-2 and not torch.isnan(got_c).any().item()
        t = bench_interleaved({
            "comm": lambda: dist.all_gather_into_tensor(ag, a),
            "gemm": lambda: torch.mm(ag, b),
            "seq": lambda: (dist.all_gather_into_tensor(ag, a), torch.mm(ag, b)),
            "asynctp": lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=gname),
            "ours": lambda: op(a, b),
            "own": lambda: op.compute_only(ag, b)}, iters)
        rows.append(_row(M, N, K, W, t, mark_phases(op, lambda: op(a, b), f"{M}x{N}x{K}", out), ok, err,
                         f"{op.compute}, {op.comm}" if schedule else None, out, r))
        op.close()                      # collective: frees the op's symmetric memory
        del op
        _release()
    if r == 0:
        _table(rows, "NCCL AG ms", out, dtype)
    return rows


def _row(M, N, K, W, times: dict, phases, ok: bool, max_err: float, schedule, out, rank: int) -> dict:
    """One table row from :func:`bench_interleaved`'s times (keys comm, gemm, seq, asynctp,
    ours, own); rank 0 prints a progress line."""
    row = dict(M=M, N=N, K=K, W=W, **times, ideal=max(times["comm"], times["gemm"]), phases=phases, correct=ok,
               max_err=max_err, schedule=schedule)
    if rank == 0:
        print(f"# {M}x{N}x{K}: ours {row['ours']:.3f} ms, seq {row['seq']:.3f}, async-TP {row['asynctp']:.3f}, "
              f"ideal {row['ideal']:.3f}{'' if ok else '  WRONG RESULT'}", file=out, flush=True)
    return row


def mark_phases(op, fn, label, out=sys.stdout, host: bool = False):
    """One more launch with its phases marked (:class:`~tldsl.runtime.dist.timeline.PhaseTimeline`);
    every rank prints where its time went (``host``: with when the host had enqueued each phase);
    returns every rank's ``[(label, stream, ms), ...]``."""
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist.timeline import PhaseTimeline
    op.timeline = PhaseTimeline()
    torch.cuda.synchronize()
    dist.barrier()
    fn()
    torch.cuda.synchronize()
    mine = op.timeline.phases()
    line = op.timeline.format(f"# [rank {dist.get_rank()}] {label} phases: ", host=host)
    op.timeline = None
    print(line, file=out, flush=True)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _release():
    """Between shapes, where nothing spins: the caching allocator's garbage of the last shape
    goes now (the op's symmetric memory went with its close())."""
    import gc
    import torch
    gc.collect()
    torch.cuda.synchronize()


def _table(rows, comm_col, out, dtype="bfloat16"):
    print(f"\n{dtype}, world size {rows[0]['W'] if rows else '?'}:", file=out)
    print(f"| M | N | K | ours ms | NCCL+cuBLAS seq ms | torch async-TP ms | {comm_col} | cuBLAS GEMM ms | "
          "our GEMM alone ms | ideal ms | ours/ideal | ours/seq | ours/async-TP | correct |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for d in rows:
        own = f"{d['own']:.3f}" if d.get("own") is not None else "-"
        print(f"| {d['M']} | {d['N']} | {d['K']} | {d['ours']:.3f} | {d['seq']:.3f} | {d['asynctp']:.3f} | "
              f"{d['comm']:.3f} | {d['gemm']:.3f} | {own} | {d['ideal']:.3f} | {d['ours'] / d['ideal']:.3f} | "
              f"{d['ours'] / d['seq']:.3f} | {d['ours'] / d['asynctp']:.3f} | {'yes' if d['correct'] else 'NO'} |",
              file=out)
    if any(d.get("schedule") for d in rows):
        print("", file=out)
        for d in rows:
            print(f"* {d['M']}x{d['N']}x{d['K']}: {d.get('schedule') or 'defaults'}", file=out)


def _ag_kwargs(cand):
    """AllGatherMatmul keyword arguments for a (compute, comm) candidate (None: defaults)."""
    if cand is None:
        return {}
    compute, comm = cand
    return {"compute": compute, "comm": comm}     # copy-engine push: direct where it can run, else the plan


def bench_gemm_rs(shapes, iters, out=sys.stdout, schedule=None, dtype="bfloat16"):
    """GEMM+ReduceScatter: ours (MatmulReduceScatter) beside NCCL reduce-scatter + cuBLAS in
    sequence and torch async-TP ``fused_matmul_reduce_scatter``; ``schedule`` as for ag_gemm."""
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist import MatmulReduceScatter
    from tldsl.checks.dist_check import compare, rs_reference
    r, W = dist.get_rank(), dist.get_world_size()
    gname = dist.group.WORLD.group_name
    _enable_symm_mem(gname)
    dt = getattr(torch, dtype)
    rows = []
    for (M, N, K) in shapes:
        if M % W or K % W:
            raise SystemExit(f"{M}x{N}x{K}: M and K must be divisible by the world size {W}")
        torch.manual_seed(4321 + r)
        a = torch.randn(M, K // W, device="cuda", dtype=dt)
        b = torch.randn(K // W, N, device="cuda", dtype=dt)
        rs_out = torch.empty(M // W, N, device="cuda", dtype=dt)
        cand = schedule(M, N, K) if schedule else None
        op = MatmulReduceScatter(M, K // W, N, dt, **({"compute": cand[0], "comm": cand[1]} if cand else {}))
        # correctness first: workspaces full of noise, output poisoned, against NCCL + fp32 matmul
        for t in op.workspace_tensors().values():
            t.normal_()
        got = torch.full((M // W, N), float("nan"), device="cuda", dtype=dt)
        torch.cuda.synchronize()
        dist.barrier()
        op(a, b, out=got)
        slack, ref = rs_reference(a, b, W, op.partial_dtype)
        torch.cuda.synchronize()
        res = compare(got, ref, slack=slack)
        ok = torch.tensor([1.0 if res["ok"] else 0.0], device="cuda")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        ok = ok.item() > 0.5
        if not res["ok"]:
            print(f"# [rank {r}] {M}x{N}x{K}: WRONG: {res['detail']}", file=sys.stderr, flush=True)
        c = torch.mm(a, b)
        t = bench_interleaved({
            "comm": lambda: dist.reduce_scatter_tensor(rs_out, c),
            "gemm": lambda: torch.mm(a, b),
            "seq": lambda: dist.reduce_scatter_tensor(rs_out, torch.mm(a, b)),
            "asynctp": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0,
                                                                             group_name=gname),
            "ours": lambda: op(a, b),
            "own": lambda: op.compute_only(a, b)}, iters)
        rows.append(_row(M, N, K, W, t, mark_phases(op, lambda: op(a, b), f"{M}x{N}x{K}", out), ok, res["max_err"],
                         f"{op.compute}, {op.comm}", out, r))     # always: the RS defaults depend on the shape
        op.close()
        del op, c
        _release()
    if r == 0:
        _table(rows, "NCCL RS ms", out, dtype)
    return rows


# -- schedule sweep / autotuning ------------------------------------------------------------------

def candidates(what):
    """(compute, comm) candidates: copy engine vs SMs, push vs pull, two compute tile orders (and,
    for AG+GEMM's copy-engine push, whole shards or the default's column slices; for GEMM+RS on
    the copy engine, three copy sizes)."""
    from tldsl.ir.schedule import CommSchedule, ComputeSchedule
    computes = [ComputeSchedule(tile=(128, 256, 64), stages=4, order=o) for o in ("comm_aligned", "swizzled")]
    if what == "ag_gemm":
        from tldsl.runtime.dist.ag_gemm import DEFAULT_COL_TILE
        comms = [CommSchedule(engine="copy_engine", mode="pull"), CommSchedule(engine="copy_engine", mode="push"),
                 CommSchedule(engine="copy_engine", mode="push", col_tile=DEFAULT_COL_TILE),
                 CommSchedule(engine="sm", mode="pull", tile_m=128, sms=8),
                 CommSchedule(engine="sm", mode="push", tile_m=128, sms=8)]
    else:
        comms = [CommSchedule(engine="copy_engine", mode="push"),           # the default: up to 4 copies per peer
                 CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue"),   # rows summed in the GEMM
                 CommSchedule(engine="copy_engine", mode="push", tile_m=512, reduce_in="epilogue"),
                 CommSchedule(engine="copy_engine", mode="push", tile_m=512),
                 CommSchedule(engine="copy_engine", mode="push", tile_m=2048),
                 CommSchedule(engine="sm", mode="push", tile_m=64, sms=16),
                 CommSchedule(engine="sm", mode="push", tile_m=32, sms=24),
                 CommSchedule(engine="sm", mode="pull", tile_m=64, sms=16),
                 CommSchedule(engine="sm", mode="push", tile_m=128, sms=8)]
    # summing in the epilogue: comm_aligned only (every rank's own rows last: no ranks waiting on each other
    # in a cycle at any world size; row_major is accepted at two ranks only)
    return [(cp, cm) for cm in comms for cp in computes if cm.reduce_in != "epilogue" or cp.order == "comm_aligned"]


def tune(what, shape, iters, *, force, out=sys.stdout, dtype="bfloat16"):
    """Autotune the schedule of ``what`` at global ``shape`` (M, N, K); returns the TuneResult."""
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist import AllGatherMatmul, MatmulReduceScatter
    from tldsl.runtime.dist.autotune import Autotuner, TorchCollective, cuda_event_timings
    from tldsl.checks.dist_check import compare, rs_reference
    r, W = dist.get_rank(), dist.get_world_size()
    M, N, K = shape
    dt = getattr(torch, dtype)
    torch.manual_seed(999 + r)
    if what == "ag_gemm":
        a = torch.randn(M // W, K, device="cuda", dtype=dt)
        b = torch.randn(K, N // W, device="cuda", dtype=dt)
        gathered = torch.empty(M, K, device="cuda", dtype=dt)
        dist.all_gather_into_tensor(gathered, a)
        ref = torch.mm(gathered.float(), b.float())
        slack = None
    else:
        a = torch.randn(M, K // W, device="cuda", dtype=dt)
        b = torch.randn(K // W, N, device="cuda", dtype=dt)
        slack, ref = rs_reference(a, b, W)
    torch.cuda.synchronize()

    def measure(cand):
        compute, comm = cand
        holder = {}
        if what == "ag_gemm":
            holder["op"] = AllGatherMatmul(M // W, K, N // W, dt, **_ag_kwargs(cand))
            run = lambda: holder["op"](a, b)[1]          # noqa: E731
        else:
            holder["op"] = MatmulReduceScatter(M, K // W, N, dt, compute=compute, comm=comm)
            run = lambda: holder["op"](a, b)             # noqa: E731
        op = holder["op"]
        try:
            for t in op.workspace_tensors().values():
                t.normal_()
            torch.cuda.synchronize()
            dist.barrier()
            res = compare(run(), ref, slack=slack)
            torch.cuda.synchronize()
            bad = torch.tensor([0.0 if res["ok"] else 1.0], device="cuda")
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)          # every rank stops here alike
            if bad.item() > 0:
                raise AssertionError(f"wrong result (this rank: {res['detail'] or 'ok'})")
            return cuda_event_timings(run, iters=iters, warmup=3, before_each=dist.barrier)
        finally:
            torch.cuda.synchronize()
            op.close()
            holder.clear()
            del op
            _release()

    def log(trial):
        if r == 0:
            t = f"{trial.median_ms:.3f} ms" if trial.ok else f"FAILED: {trial.error}"
            print(f"#   {trial.label}: {t}", file=out, flush=True)

    if r == 0:
        print(f"# tuning {what} {M}x{N}x{K} {dtype} over {len(candidates(what))} candidates", file=out, flush=True)
    tuner = Autotuner(collective=TorchCollective())
    res = tuner.tune(what, [list(shape)], dtype, W, torch.cuda.get_device_name(), candidates(what), measure,
                     force=force, log=log)
    if r == 0:
        print(f"\n{what} {M}x{N}x{K}{' (cached choice)' if res.cached else ''}: best {res.best_label}"
              f"{f' at {res.median_ms:.3f} ms' if res.median_ms else ''}\n{res.table()}\n(cache: {res.path})\n",
              file=out, flush=True)
    return res


def parse_shapes(what: str, text: str) -> list[tuple[int, int, int]]:
    """``MxNxK`` items, or model names from :data:`MODELS` (M = 8192; for gemm_rs the layer's
    down-projection: N and K swapped)."""
    from tldsl.errors import InputError
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if item in MODELS:
            n, k = MODELS[item]
            out.append((8192, n, k) if what == "ag_gemm" else (8192, k, n))
            continue
        try:
            m, n, k = (int(x) for x in item.split("x"))
        except ValueError:
            raise InputError(f"--shapes: {item!r} is neither MxNxK nor one of {sorted(MODELS)}") from None
        out.append((m, n, k))
    return out


def write_json(path, what, rows, *, gpu, argv, dtype="bfloat16"):
    """The benchmark's rows (times in ms, phases per rank) as one JSON document."""
    import datetime
    import json
    import torch
    import torch.distributed as dist
    doc = {"op": what, "dtype": dtype, "date": datetime.date.today().isoformat(), "gpu": gpu, "world_size": dist.get_world_size(),
           "torch": torch.__version__, "argv": list(argv), "rows": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def parse_schedule(what: str, spec: str, *, pusher: str | None = None, handshake: str | None = None):
    """A function ``(M, N, K) -> (compute, comm)`` (global sizes) from ``key=value,...``: compute
    keys ``tile`` (BMxBNxBK), ``stages``, ``compute_order``, ``group_m``, ``cluster`` (CTAs per
    cluster along M: 1 or 2); comm keys ``engine``, ``mode``, ``order``, ``transport`` (``ptr`` or
    ``nvshmem``), ``sms``, ``tile_m`` (``none`` for whole chunks), ``col_tile`` (ag_gemm's
    copy-engine push: columns per slice),
    ``reduce_in`` (gemm_rs on the copy engine: ``epilogue`` or ``comm``). Unset keys take the op's
    defaults for the shape (and for ag_gemm's ``pusher`` / ``handshake``, the benchmark's flags):
    no compute key, no compute schedule given; no comm key, none given — the op decides."""
    from tldsl.errors import InputError
    from tldsl.runtime.dist import ag_gemm, gemm_rs
    kv = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        if "=" not in item:
            raise InputError(f"--schedule: {item!r} is not key=value")
        k, v = item.split("=", 1)
        kv[k.strip()] = v.strip()
    ckw = {}
    if "tile" in kv:
        ckw["tile"] = tuple(int(x) for x in kv.pop("tile").split("x"))
    for k in ("stages", "group_m"):
        if k in kv:
            ckw[k] = int(kv.pop(k))
    if "compute_order" in kv:
        ckw["order"] = kv.pop("compute_order")
    if "cluster" in kv:
        ckw["cluster"] = (int(kv.pop("cluster")), 1)
    mkw = {}
    for k in ("engine", "mode", "order", "transport", "reduce_in"):
        if k in kv:
            mkw[k] = kv.pop(k)
    if "sms" in kv:
        mkw["sms"] = int(kv.pop("sms"))
    for k in ("tile_m", "col_tile"):
        if k in kv:
            v = kv.pop(k)
            mkw[k] = None if v.lower() == "none" else int(v)
    if kv:
        raise InputError(f"--schedule: unknown key(s) {sorted(kv)}")

    def schedule(M, N, K):
        import torch.distributed as dist
        W = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 2
        compute = (ag_gemm.DEFAULT_COMPUTE if what == "ag_gemm" else gemm_rs.DEFAULT_COMPUTE).with_(**ckw)
        given = compute if ckw else None          # the op treats "no compute schedule" apart (ag_gemm)
        if not mkw:
            return given, None
        sm_keys = mkw.get("sms") is not None or mkw.get("tile_m") is not None or mkw.get("transport") == "nvshmem"
        on_sms = mkw.get("engine", "sm" if sm_keys else None) == "sm"      # without engine=, these mean SMs
        # the base: what the op itself does at this shape (with engine="sm", for SM keys)
        if what == "ag_gemm":
            comm = (ag_gemm.resolve_comm(None, "sm", None, compute) if on_sms
                    else ag_gemm.default_comm(M // W, K, given, pusher=pusher, handshake=handshake))
        else:
            comm = (gemm_rs.default_sm_comm if on_sms else gemm_rs.default_comm)(compute, m=M, k=K // W)
        kw = dict(mkw)
        if kw.get("engine") == "copy_engine":
            kw.setdefault("tile_m", None)
            kw.setdefault("sms", None)
        comm = comm.with_(**kw)
        if what == "ag_gemm" and "col_tile" not in kw:      # the op's slices wherever the copy engines push
            ce_push = comm.engine == "copy_engine" and comm.mode == "push" and pusher != "gemm"
            comm = comm.with_(col_tile=ag_gemm.default_col_tile(K, compute) if ce_push else None)
        return given, comm
    return schedule


def parse_args(what, argv):
    import argparse
    ap = argparse.ArgumentParser(prog=f"torchrun ... -m tldsl.bench {what}")
    ap.add_argument("--shapes", default=None, help="MxNxK,... (global sizes) or model names "
                    f"({', '.join(MODELS)}: their MLP layer at M=8192)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time every candidate schedule (autotuner, re-measured)")
    ap.add_argument("--tune", action="store_true", help="ours = the autotuned schedule (cached; tuned on a miss)")
    ap.add_argument("--ag-pusher", default=None, choices=("copy_engine", "gemm"),
                    help="ag_gemm, where the copy engines push: who writes each shard into the peers — the copy "
                         "engine (the default) or the GEMM itself as it loads it")
    ap.add_argument("--ag-handshake", default=None, choices=("device", "memops", "kernel"),
                    help="ag_gemm, the copy-engine pull (giving it makes the op pull: the push has no handshake): "
                         "the per-launch barrier published by the staging kernel (device, the pull's default), as "
                         "stream memory operations (memops) or as torch's barrier kernel (kernel, one SM kept free)")
    ap.add_argument("--json", default=None, metavar="PATH", help="rank 0 also writes the rows (with every "
                    "rank's phase timeline) as JSON")
    ap.add_argument("--schedule", default=None, metavar="SPEC",
                    help="ours = this schedule, e.g. 'engine=sm,mode=push,sms=8,order=ring,tile=128x256x64,"
                         "stages=4,compute_order=comm_aligned' (unset keys: the op's defaults)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                    help="element type of A, B and the outputs (ours and the peers alike)")
    ap.add_argument("--bind", action="store_true", help="pin each rank to the CPU cores local to its GPU "
                    "(every candidate alike; tldsl/cpu_binding.py)")
    if what not in ("ag_gemm", "gemm_rs"):
        raise SystemExit(f"unknown distributed benchmark {what!r}")
    return ap.parse_args(argv)


def main(what, argv):
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist.group import init_ranks
    args = parse_args(what, argv)
    init_ranks()
    local = torch.cuda.current_device()
    if args.bind:
        from ..cpu_binding import bind_to_gpu
        print(f"# [rank {dist.get_rank()}] {bind_to_gpu(local)}", file=sys.stderr, flush=True)
    default = AG_SHAPES if what == "ag_gemm" else RS_SHAPES
    shapes = parse_shapes(what, args.shapes) if args.shapes else default
    try:
        if args.sweep:
            for shape in shapes:
                tune(what, shape, args.iters, force=True, dtype=args.dtype)
            return 0
        schedule = None
        if args.schedule:
            schedule = parse_schedule(what, args.schedule, pusher=args.ag_pusher, handshake=args.ag_handshake)
        if args.tune:
            chosen = {shape: tune(what, shape, args.iters, force=False, dtype=args.dtype).best for shape in shapes}
            schedule = lambda M, N, K: chosen[(M, N, K)]     # noqa: E731
        if what == "ag_gemm":
            rows = bench_ag_gemm(shapes, args.iters, schedule=schedule, handshake=args.ag_handshake,
                                 pusher=args.ag_pusher, dtype=args.dtype)
        else:
            rows = bench_gemm_rs(shapes, args.iters, schedule=schedule, dtype=args.dtype)
        if args.json and dist.get_rank() == 0:
            write_json(args.json, what, rows, gpu=torch.cuda.get_device_name(), argv=argv, dtype=args.dtype)
    finally:
        dist.destroy_process_group()
    return 0
