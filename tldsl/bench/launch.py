"""Host time of one kernel launch: our launch layer (cuda.bindings) against cuda.core.

    python -m tldsl.bench launch [--args 1,8,24] [--launches 100] [--rounds 60] [--json PATH]

One empty NVRTC kernel per argument count N (N pointer arguments; thread 0 adds 1 to a counter
behind the first, so every variant's launches are counted and checked), launched on a torch
stream and on torch's default stream by each variant, interleaved batch by batch so that clock
and load drift hit all alike. A batch is ``--launches`` launches timed with ``perf_counter_ns``
on the host, the device synchronised outside the timed span; the figure is the median over
``--rounds`` batches of host µs per launch (p10 and p90 beside it).

Variants (the same cubin; each row's kernel is loaded its own way):

* ``bindings prepared``   today's path before cuda.core loaded kernels: ``cuModuleLoadData`` +
  ``cuModuleGetFunction``, arguments packed once (:class:`~tldsl.runtime.gpu.launch.PreparedLaunch`),
  one ``cuLaunchKernel`` a launch.
* ``core-loaded prepared`` :func:`tldsl.runtime.gpu.module.load_kernel` (cuda.core's
  ``ObjectCode``/``Kernel``; the ``CUfunction`` from ``cuKernelGetFunction``), same prepared launch.
* ``bindings packed per launch`` an :class:`~tldsl.runtime.gpu.launch.ArgPack` built per launch
  (what a launch costs when the arguments change), then ``cuLaunchKernel``.
* ``core launch``          ``cuda.core.launch(stream, config, kernel, *args)`` with its ``Stream``
  and ``LaunchConfig`` built once (cuda.core packs the arguments on every call).
* ``core launch, Stream per launch`` the same with ``Stream.from_handle`` of the torch stream each
  launch (what a caller who holds torch's stream handle pays).

Also the cold load of the module (µs, median of ``--loads`` loads, each followed by one launch
and a synchronize): ``cuModuleLoadData`` against cuda.core.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

ENTRY = "tl_bench_launch_{n}"


def kernel_source(n: int) -> str:
    """An empty kernel of ``n`` pointer arguments; thread 0 of block 0 counts its launches in ``*p0``."""
    if n < 1:
        raise ValueError("the kernel takes at least one pointer (its launch counter)")
    params = ", ".join(f"unsigned long long* p{i}" for i in range(n))
    return (f'extern "C" __global__ void {ENTRY.format(n=n)}({params}) {{\n'
            "  if (threadIdx.x == 0 && blockIdx.x == 0) p0[0] += 1ull;\n}\n")


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--args takes argument counts like 1,8,24, not {text!r}") from None
    if not counts or any(c < 1 or c > 256 for c in counts):
        raise argparse.ArgumentTypeError("--args: each count between 1 and 256")
    return counts


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tldsl.bench launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--args", type=parse_counts, default=[1, 8, 24], help="pointer-argument counts, e.g. 1,8,24")
    ap.add_argument("--launches", type=int, default=100, help="launches per timed batch")
    ap.add_argument("--rounds", type=int, default=60, help="timed batches per variant")
    ap.add_argument("--loads", type=int, default=20, help="cold module loads per loader")
    ap.add_argument("--json", help="also write the rows as JSON here")
    return ap


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _driver_load(cubin: bytes, name: str):
    """The loader before cuda.core: ``cuModuleLoadData`` on the cubin's bytes."""
    import ctypes
    from types import SimpleNamespace
    from cuda.bindings import driver as cu
    from ..runtime.gpu.device import check
    image = ctypes.create_string_buffer(cubin, len(cubin))
    mod = check(cu.cuModuleLoadData(ctypes.addressof(image)), f"cuModuleLoadData({name})")
    fn = check(cu.cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
    return SimpleNamespace(name=name, module=mod, function=fn, smem_bytes=0, _image=image)


def _core():
    try:
        import cuda.core as core
        core.launch                                         # noqa: B018 - 0.x keeps it under .experimental
    except (ImportError, AttributeError):
        import cuda.core.experimental as core
    return core


def variants(cubin: bytes, n: int, counters, stream: int):
    """``{name: (launch_fn, counter_tensor)}`` for kernel ``n`` on ``stream`` (an int handle)."""
    from ..runtime.gpu import launch as L
    from ..runtime.gpu.module import load_cubin
    core = _core()
    name = ENTRY.format(n=n)
    out, errors = {}, {}

    def pack_of(counter):
        pack = L.ArgPack()
        for i in range(n):
            pack.add("ptr", counter.data_ptr() if i == 0 else counter.data_ptr() + 8 * i)
        return pack

    def add(label, build):
        counter = counters[label]
        try:
            fn = build(counter)
            fn()                        # one launch first: a variant that cannot launch fails here
            out[label] = (fn, counter)
        except Exception as e:          # noqa: BLE001 - one variant failing must not hide the others
            errors[label] = f"{type(e).__name__}: {e}"

    def bindings_prepared(counter):
        k = _driver_load(cubin, name)
        prep = L.PreparedLaunch(k, (1, 1, 1), (32, 1, 1), pack_of(counter), None)
        return lambda: prep.launch(stream)

    def core_loaded(counter):
        k = load_cubin(cubin, name)
        prep = L.PreparedLaunch(k, (1, 1, 1), (32, 1, 1), pack_of(counter), None)
        return lambda: prep.launch(stream)

    def bindings_per_launch(counter):
        k = _driver_load(cubin, name)
        ptrs = [counter.data_ptr() + 8 * i for i in range(n)]

        def go():
            pack = L.ArgPack()
            for p in ptrs:
                pack.add("ptr", p)
            L.launch(k, (1, 1, 1), (32, 1, 1), pack, stream)
        return go

    def core_launch(counter, stream_per_launch=False):
        kernel = core.ObjectCode.from_cubin(cubin, name=name).get_kernel(name)
        cfg = core.LaunchConfig(grid=1, block=32)
        args = [counter.data_ptr() + 8 * i for i in range(n)]
        if stream_per_launch:
            from_handle = core.Stream.from_handle
            return lambda: core.launch(from_handle(stream), cfg, kernel, *args)
        s = core.Stream.from_handle(stream)
        return lambda: core.launch(s, cfg, kernel, *args)

    add("bindings prepared", bindings_prepared)
    add("core-loaded prepared", core_loaded)
    add("bindings packed per launch", bindings_per_launch)
    add("core launch", core_launch)
    add("core launch, Stream per launch", lambda c: core_launch(c, True))
    return out, errors


VARIANTS = ("bindings prepared", "core-loaded prepared", "bindings packed per launch", "core launch",
            "core launch, Stream per launch")


def time_launches(fns: dict, launches: int, rounds: int, sync) -> dict:
    """Host µs per launch of each function: ``rounds`` batches of ``launches``, the functions
    taking turns batch by batch (the order rotating), ``sync()`` after each batch, untimed."""
    names = list(fns)
    per = {k: [] for k in names}
    for name in names:                  # warm-up: first launches load lazily
        for _ in range(10):
            fns[name]()
    sync()
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = fns[name]
            t0 = time.perf_counter_ns()
            for _ in range(launches):
                fn()
            t1 = time.perf_counter_ns()
            sync()
            per[name].append((t1 - t0) / launches / 1e3)
    return {k: {"median_us": statistics.median(v), "p10_us": _percentile(v, 0.1), "p90_us": _percentile(v, 0.9)}
            for k, v in per.items()}


def cold_loads(cubin: bytes, name: str, loads: int, stream: int, counter) -> dict:
    """Median µs to load the module, get the kernel and run one launch to its end (the launch
    is part of it: the driver may finish loading lazily at the first launch)."""
    import torch
    from ..runtime.gpu import launch as L
    from ..runtime.gpu.module import load_cubin
    out = {}
    for label, load in (("cuModuleLoadData", _driver_load), ("cuda.core ObjectCode", load_cubin)):
        ts = []
        for _ in range(loads):
            pack = L.ArgPack()
            pack.add("ptr", counter.data_ptr())
            t0 = time.perf_counter_ns()
            k = load(cubin, name)
            L.launch(k, (1, 1, 1), (32, 1, 1), pack, stream)
            torch.cuda.synchronize()
            ts.append((time.perf_counter_ns() - t0) / 1e3)
        out[label] = statistics.median(ts)
    return out


def run(counts, launches: int, rounds: int, loads: int) -> dict:
    import torch
    from ..codegen.toolchain.compiler import compile_cuda
    from ..runtime.gpu.device import current_context, require_gpu
    device = require_gpu()
    current_context()
    side = torch.cuda.Stream()
    streams = {"torch stream": side.cuda_stream, "torch default stream": torch.cuda.default_stream().cuda_stream}
    rows, errors, loads_us = [], {}, {}
    for n in counts:
        cubin = compile_cuda(kernel_source(n), ENTRY.format(n=n)).cubin
        for sname, handle in streams.items():
            counters = {v: torch.zeros(max(n, 1), dtype=torch.int64, device="cuda") for v in VARIANTS}
            fns, errs = variants(cubin, n, counters, handle)
            for v, e in errs.items():
                errors[f"N={n} {sname} {v}"] = e
            timed = time_launches({k: f for k, (f, _) in fns.items()}, launches, rounds, torch.cuda.synchronize)
            expected = 1 + 10 + launches * rounds     # the trial launch, the warm-up, the batches
            for v, stats in timed.items():
                got = int(fns[v][1][0].item())
                rows.append({"args": n, "stream": sname, "variant": v, **stats,
                             "counted": got == expected, "launches": expected})
        if n == counts[0]:
            counter = torch.zeros(1, dtype=torch.int64, device="cuda")
            loads_us = cold_loads(cubin, ENTRY.format(n=n), loads, streams["torch stream"], counter)
    return {"device": device, "torch": torch.__version__, "versions": _versions(), "rows": rows,
            "errors": errors, "cold_load_us": loads_us, "launches": launches, "rounds": rounds}


def _versions() -> dict:
    from importlib import metadata
    out = {}
    for dist in ("cuda-bindings", "cuda-core", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def format_table(result: dict) -> str:
    lines = ["| args | stream | variant | host µs/launch (median) | p10 | p90 | launches counted |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['args']} | {r['stream']} | {r['variant']} | {r['median_us']:.2f} | {r['p10_us']:.2f} | "
                     f"{r['p90_us']:.2f} | {'yes' if r['counted'] else 'NO'} |")
    return "\n".join(lines)


def parse_args(argv):
    ap = parser()
    args = ap.parse_args(argv)
    if args.launches < 1 or args.rounds < 1 or args.loads < 1:
        ap.error("--launches, --rounds and --loads must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args.args, args.launches, args.rounds, args.loads)
    print(f"# {result['device']}; torch {result['torch']}; " +
          ", ".join(f"{k} {v}" for k, v in result["versions"].items() if k != "torch") +
          f"; {args.rounds} batches of {args.launches} launches per row")
    print(format_table(result))
    for label, us in result["cold_load_us"].items():
        print(f"cold load + first launch, {label}: {us:.1f} µs (median of {args.loads})")
    for what, e in result["errors"].items():
        print(f"FAILED {what}: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = not result["errors"] and all(r["counted"] for r in result["rows"])
    return 0 if ok else 1
