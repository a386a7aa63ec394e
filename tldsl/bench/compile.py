"""Compile cost of a generated GEMM: cold (NVRTC) and from the on-disk cache (no GPU needed).

    python -m tldsl.bench compile [--shape 8192x8192x8192] [--cache-dir DIR]

A fresh cache directory (a temporary one unless ``--cache-dir``) is used for both steps:

* **cold**: this process traces the GEMM tile program, lowers it and compiles it with NVRTC
  (front end / optimizer / ptxas as NVRTC reports them);
* **cache hit**: a second Python process traces, lowers and compiles the same kernel — the
  content-addressed cache answers, so nothing is compiled (the figure starts after the
  process's imports; the whole process's wall time is printed beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .gemm import CANDIDATES, candidate_schedule, lower_plain

SCHEDULE = CANDIDATES[0]      # the GEMM benchmark's first candidate


def _trace_lower_compile(M: int, N: int, K: int) -> dict:
    t0 = time.perf_counter()
    lowered = lower_plain(M, N, K, candidate_schedule(SCHEDULE))
    t1 = time.perf_counter()
    compiled = lowered.compile(progress=False)
    t2 = time.perf_counter()
    return {"trace_lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
            "nvrtc_s": compiled.compile_seconds, "cubin_bytes": len(compiled.cubin), "cached": compiled.cached}


def _hit_main(shape: tuple[int, int, int]) -> None:
    """The second process: trace + lower + cache lookup, after importing the modules they use
    (a once-per-process cost, like importing tldsl, printed apart by the caller)."""
    import importlib
    for mod in ("tldsl.ops.gemm", "tldsl.codegen.recipes.gemm", "tldsl.codegen.toolchain.compiler", "tldsl.codegen.toolchain.cache"):
        importlib.import_module(mod)
    print(json.dumps(_trace_lower_compile(*shape)))


def _shape(text: str) -> tuple[int, int, int]:
    """``MxNxK`` as three positive ints (a usage error otherwise)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"MxNxK of three positive ints, got {text!r}")
    return tuple(int(p) for p in parts)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m tldsl.bench compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=_shape, default="8192x8192x8192", help="MxNxK")
    ap.add_argument("--cache-dir", default=None, help="an empty directory for the cache (default: a new temporary one)")
    ap.add_argument("--hit", action="store_true", help=argparse.SUPPRESS)      # the second process
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hit:
        _hit_main(args.shape)
        return 0
    cache = args.cache_dir or tempfile.mkdtemp(prefix="tldsl-compile-bench-")
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--cache-dir {cache}: cannot create it ({e.strerror})") from None
    if not os.path.isdir(cache):
        raise SystemExit(f"--cache-dir {cache} is not a directory")
    if os.listdir(cache):
        raise SystemExit(f"--cache-dir {cache} is not empty: a cold compile needs an empty cache")
    os.environ["TLDSL_CACHE_DIR"] = cache
    M, N, K = args.shape
    from ..codegen.toolchain import find_toolchain
    from ..codegen.toolchain.compiler import shutdown_pool
    tc = find_toolchain()
    shutdown_pool()      # cold: a new compile worker, without the precompiled headers of an earlier compile
    cold = _trace_lower_compile(M, N, K)
    t0 = time.perf_counter()
    shape = "x".join(map(str, args.shape))
    proc = subprocess.run([sys.executable, "-m", "tldsl.bench", "compile", "--hit", "--shape", shape],
                          capture_output=True, text=True, env=dict(os.environ), check=True)
    wall = time.perf_counter() - t0
    hit = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# {shape} GEMM, schedule {SCHEDULE}; NVRTC {tc.nvrtc_version}, {os.cpu_count()} CPU(s); cache {cache}")
    print(f"cold:      trace+lower {1e3 * cold['trace_lower_s']:.1f} ms, compile {cold['compile_s']:.2f} s "
          f"(NVRTC {cold['nvrtc_s']:.2f} s), cubin {cold['cubin_bytes'] // 1024} KiB")
    print(f"cache {'hit' if hit['cached'] else 'MISS'}: trace+lower {1e3 * hit['trace_lower_s']:.1f} ms, "
          f"lookup {1e3 * hit['compile_s']:.1f} ms, "
          f"end to end {1e3 * hit['total_s']:.1f} ms (a second process, after its imports; the whole process "
          f"including Python's start and the imports: {wall:.2f} s)")
    return 0
