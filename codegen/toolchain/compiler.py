"""Compile one self-contained CUDA C++ translation unit to an ``sm_90a`` cubin with NVRTC.

* **Options** (measured to work for CuTe/CUTLASS under NVRTC 13.0): ``--gpu-architecture=sm_90a``
  (plain ``sm_90`` turns GMMA into traps), ``-std=c++17``, ``-default-device`` (CUTLASS has
  unannotated constexpr functions), ``-DNDEBUG`` (device asserts serialise the WGMMA pipeline),
  ``-lineinfo``, ptxas ``-v`` (registers and spills land in the log), then the include dirs in
  the order tldsl, CUTLASS, ``cu13/include``, ``cu13/include/cccl``.
* **Processes**: NVRTC serialises threads inside one process and peaks at 0.4-2 GB per compile,
  so every compile is one job of a ``spawn`` process pool (one kernel per job);
  :func:`compile_many` runs several at once.
* **Precompiled headers**: every compile runs with NVRTC's automatic PCH (:data:`PCH_OPTIONS`).
  A pool worker parses the headers of the first kernel (tldsl's, CuTe/CUTLASS, CCCL) once and
  keeps the parsed state (NVRTC's ``/tmp/__nvrtc_auto_pch_<pid>_*``, removed when the process
  exits), one per distinct ``#include`` prefix; later kernels with that prefix skip most of the
  front end: a general-recipe kernel 2.9 s -> 0.5 s, a CUTLASS GEMM 4.7 s -> 1.1 s, an
  NVSHMEM-transport kernel 13 s -> 1.3 s (one compile at a time on a 2-core machine; the first
  kernel of a prefix pays about 30% more). The cubins are byte-identical with and without it
  (checked on general, GEMM and NVSHMEM kernels), so the options are not part of the cache key,
  nor of the option list a compiled kernel records.
* **Progress**: a compile takes seconds (almost all C++ front end), so each stage reports a
  line with its elapsed time — cache lookup, queued, NVRTC running (a heartbeat), front end /
  optimizer / ptxas split, done — to stderr, or to a ``progress`` callback (notebooks).
* **Errors**: :class:`CudaCompileError` (a :class:`tldsl.CompilationError`) quotes the NVRTC
  diagnostics, the failing lines of the generated source with context, and — where the
  generated code carries ``// tldsl: file:line`` markers — the tile program's line.
* **Cache**: hits come from :mod:`.cache` without loading NVRTC.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import re
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from ... import env
from ...errors import CompilationError, InputError
from ...ir.display import html_card, one_line, size
from ...ir.location import Location
from .cache import KernelCache, cache_key
from .locate import ARCH, Toolchain, load_nvrtc, find_toolchain
from .sass import analyze_cubin, parse_ptxas_log

#: The DSL marker the code generator puts at the end of a generated line.
MARKER_RE = re.compile(r"//\s*tldsl:\s*(?P<file>.+?):(?P<line>\d+)\s*$")

BASE_OPTIONS = ("--gpu-architecture=" + ARCH, "-std=c++17", "-default-device", "-DNDEBUG", "-lineinfo",
                "--ptxas-options=-v")
#: Automatic precompiled headers, silent (no "creating/using precompiled header" lines in the log).
PCH_OPTIONS = ("-pch", "--pch-messages=false", "--pch-verbose=false")
#: NVRTC's PCH heap (256 MiB by default; reserved, not touched until used): NVSHMEM's headers
#: need 554 MiB, below that their kernels compile without a PCH, with warning #639-D in the log.
PCH_HEAP_BYTES = 1 << 30
_pch_heap_set = False


# -- results and errors -------------------------------------------------------------------

@dataclass
class CompiledKernel:
    """A cubin and how it was made."""
    name: str                      # the extern "C" entry point
    cubin: bytes
    log: str
    options: list[str]
    key: str
    cached: bool                   # True when it came from the disk cache
    seconds: float                 # wall time of this call (a hit: lookup time)
    compile_seconds: float         # NVRTC time when it was compiled (from the cache entry on a hit)
    timings: dict = field(default_factory=dict)   # NVRTC phases in seconds (front end, optimizer, ptxas)
    source: str = ""
    cache_path: str | None = None

    def sass(self):
        """SASS mnemonics and resource usage (needs cuobjdump); see :mod:`.sass`."""
        return analyze_cubin(self.cubin)

    def ptxas_info(self) -> dict:
        """Registers / spills / stack per function parsed from the ptxas -v lines of the log."""
        return parse_ptxas_log(self.log)

    def __repr__(self) -> str:
        """One line, never the cubin's bytes (``.cubin``, ``.log``, ``.source`` hold them)."""
        how = "from the cache" if self.cached else f"compiled in {self.compile_seconds:.2f} s"
        return one_line(f"<CompiledKernel {self.name}: {size(len(self.cubin))} cubin, {how}, key {self.key[:12]}>")

    def _repr_html_(self) -> str:
        facts = [("entry", self.name), ("cubin", size(len(self.cubin))), ("from the cache", self.cached),
                 ("NVRTC seconds", f"{self.compile_seconds:.2f}"), ("this call's seconds", f"{self.seconds:.3f}"),
                 ("cache key", self.key), ("cache file", self.cache_path or "-"),
                 ("ptxas", self.ptxas_info() or "-"), ("options", " ".join(self.options))]
        folded = [("NVRTC log", self.log)] + ([("CUDA source", self.source)] if self.source else [])
        return html_card(f"CompiledKernel {self.name} (sm_90a cubin)", facts, folded)


@dataclass(frozen=True)
class Diagnostic:
    file: str
    line: int
    severity: str     # error | warning | remark
    code: str
    message: str


class CudaCompileError(CompilationError):
    """NVRTC rejected generated code. ``diagnostics`` are the parsed log lines, ``log`` the
    whole log, ``source`` the generated translation unit."""

    def __init__(self, name: str, source: str, log: str, options: Sequence[str], program: str):
        self.name, self.source, self.log, self.options, self.program = name, source, log, list(options), program
        self.diagnostics = parse_diagnostics(log)
        self.sites = _generated_sites(log, program)
        self.dsl_loc = None
        for ln in self.sites:
            loc = dsl_location(source, ln)
            if loc is not None:
                self.dsl_loc = loc
                break
        super().__init__(self._message(), self.dsl_loc)

    def _message(self) -> str:
        errors = [d for d in self.diagnostics if d.severity == "error"] or self.diagnostics
        head = f"NVRTC failed to compile the generated kernel '{self.name}'"
        if self.dsl_loc is not None:
            head += " (generated from the tile program line below)"
        lines = [head + ":"]
        for d in errors[:5]:
            where = f"{os.path.basename(d.file)}:{d.line}"
            lines.append(f"  {where}: {d.severity}: {d.message}")
        if len(errors) > 5:
            lines.append(f"  ... {len(errors) - 5} more")
        if not self.diagnostics:
            lines.extend("  " + l for l in self.log.strip().splitlines()[-20:])
        for ln in self.sites[:3]:
            lines.append(f"generated source {self.program}:{ln}:")
            lines.append(source_excerpt(self.source, ln))
            loc = dsl_location(self.source, ln)
            if loc is not None:
                lines.append(f"  from {loc}")
        return "\n".join(lines)


_DIAG_RE = re.compile(r"^(?P<file>[^\s()][^()]*?)\((?P<line>\d+)\): (?P<sev>error|warning|remark|catastrophic error)"
                      r"(?: #(?P<code>[\w-]+))?(?:-D)?: (?P<msg>.*)$")


def parse_diagnostics(log: str) -> list[Diagnostic]:
    out = []
    for raw in log.splitlines():
        m = _DIAG_RE.match(raw.strip())
        if m:
            sev = "error" if "error" in m.group("sev") else m.group("sev")
            out.append(Diagnostic(m.group("file"), int(m.group("line")), sev, m.group("code") or "", m.group("msg")))
    return out


def _generated_sites(log: str, program: str) -> list[int]:
    """Lines of the generated TU named by the log: direct diagnostics and instantiation contexts."""
    sites: list[int] = []
    base = re.escape(program)
    pats = [re.compile(rf"(?:^|\s){base}\((\d+)\)"), re.compile(rf"at line (\d+) of \"?{base}\"?")]
    for raw in log.splitlines():
        for p in pats:
            for m in p.finditer(raw):
                n = int(m.group(1))
                if n not in sites:
                    sites.append(n)
    return sites


def source_excerpt(source: str, line: int, context: int = 3) -> str:
    """Lines ``line-context .. line+context`` of ``source`` numbered, the failing one marked ``>``."""
    lines = source.splitlines()
    lo, hi = max(1, line - context), min(len(lines), line + context)
    width = len(str(hi))
    out = []
    for i in range(lo, hi + 1):
        mark = ">" if i == line else " "
        out.append(f"  {mark}{i:>{width}} | {lines[i - 1]}")
    return "\n".join(out)


def dsl_location(source: str, line: int) -> Location | None:
    """The ``// tldsl: file:line`` marker on generated line ``line``, or on the nearest line above
    it in the same statement group (up to a blank line)."""
    lines = source.splitlines()
    i = line
    while 1 <= i <= len(lines):
        text = lines[i - 1]
        m = MARKER_RE.search(text)
        if m:
            return Location(m.group("file"), int(m.group("line")))
        if not text.strip() or i <= line - 12:
            return None
        i -= 1
    return None


# -- progress -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ProgressEvent:
    kernel: str
    stage: str          # cache-hit | cache-miss | queued | nvrtc | nvrtc-phase | done | failed
    elapsed: float      # seconds since this kernel's compile call began
    message: str

    def __str__(self) -> str:
        return f"[tldsl] {self.kernel}: {self.message} ({self.elapsed:.1f} s)"


ProgressFn = Callable[[ProgressEvent], None]


def print_progress(ev: ProgressEvent) -> None:
    print(str(ev), file=sys.stderr, flush=True)


def resolve_progress(progress) -> ProgressFn:
    """``progress`` as a function of a :class:`ProgressEvent`: None (lines on stderr unless
    ``TLDSL_QUIET``), True (lines on stderr), False (nothing) or a callable (``print`` in a
    notebook); anything else is refused before anything compiles."""
    if progress is False:
        return lambda ev: None
    if progress is True:
        return print_progress
    if progress is None:
        return print_progress if env.get("TLDSL_QUIET", "0") == "0" else (lambda ev: None)
    if not callable(progress):
        raise InputError(f"progress={progress!r}: None, True, False or a function of a compile ProgressEvent "
                         f"(print, say)")
    return progress


# -- the worker (runs in a spawned process) -------------------------------------------------

def nvrtc_compile(source: str, program: str, options: Sequence[str]) -> dict:
    """Compile in *this* process. Returns ``ok, cubin, log, seconds, timings`` (never raises on
    a compile error: the parent turns the log into a :class:`CudaCompileError`)."""
    import tempfile
    global _pch_heap_set
    nvrtc = load_nvrtc()

    def check(res, what):
        err = res[0] if isinstance(res, tuple) else res
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
        return res[1] if isinstance(res, tuple) and len(res) == 2 else None

    if not _pch_heap_set:
        check(nvrtc.nvrtcSetPCHHeapSize(PCH_HEAP_BYTES), "nvrtcSetPCHHeapSize")
        _pch_heap_set = True

    fd, time_file = tempfile.mkstemp(prefix="tldsl-nvrtc-time-", suffix=".csv")
    os.close(fd)
    os.unlink(time_file)
    opts = [o.encode() for o in (*options, *PCH_OPTIONS)] + [f"--time={time_file}".encode()]
    prog = check(nvrtc.nvrtcCreateProgram(source.encode(), program.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        t0 = time.perf_counter()
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        seconds = time.perf_counter() - t0
        n = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\x00").decode(errors="replace")
        ok = res[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
        cubin = b""
        if ok:
            n = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            cubin = b" " * n
            check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    timings = _read_times(time_file)
    return {"ok": ok, "cubin": bytes(cubin), "log": log, "seconds": seconds, "timings": timings,
            "result": str(res[0])}


def _read_times(path: str) -> dict:
    out: dict[str, float] = {}
    try:
        with open(path) as f:
            rows = f.read().splitlines()[1:]
        os.unlink(path)
    except OSError:
        return out
    names = {"CUDA C++ Frontend": "front_end", "NVVM Optimizer": "optimizer", "PTX Translation": "ptxas"}
    for row in rows:
        parts = [p.strip() for p in row.split(",")]
        if len(parts) >= 4 and parts[1] in names:
            unit = parts[3]
            val = float(parts[2]) / (1000.0 if unit == "ms" else 1.0)
            key = names[parts[1]]
            out[key] = out.get(key, 0.0) + val
    return out


# -- the process pool -------------------------------------------------------------------------

_pool: cf.ProcessPoolExecutor | None = None
_pool_workers = 0
_pool_lock = threading.Lock()
_atexit_registered = False


def default_workers() -> int:
    """``TLDSL_COMPILE_WORKERS`` (a positive int; an InputError naming it otherwise), else one per
    CPU core."""
    workers = env.get("TLDSL_COMPILE_WORKERS")
    if workers:
        try:
            n = int(workers.strip())
        except ValueError:
            n = 0
        if n < 1:
            raise InputError(f"TLDSL_COMPILE_WORKERS={workers!r}: a positive int, how many processes compile with "
                             "NVRTC at once (unset: one per CPU core)")
        return n
    return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def _without_main_module():
    """Spawned workers re-import the parent's ``__main__`` script unless it is hidden while they
    start; the worker function lives in this importable module, so a user's unguarded script
    (no ``if __name__ == "__main__"``) must not run again in every compile worker."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _get_pool(workers: int) -> cf.ProcessPoolExecutor:
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
            _pool_workers = workers
            global _atexit_registered
            if not _atexit_registered:     # stop workers before interpreter teardown (no shutdown noise)
                atexit.register(shutdown_pool)
                _atexit_registered = True
        return _pool


def shutdown_pool() -> None:
    """Stop the compile worker processes (they are restarted on the next compile)."""
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.shutdown(wait=True)
            _pool = None


# -- public API -------------------------------------------------------------------------------

@dataclass(frozen=True)
class CompileJob:
    """One translation unit with one ``extern "C"`` kernel ``name``."""
    source: str
    name: str
    options: tuple[str, ...] = ()      # extra NVRTC options (defines, ...), appended to the defaults

    @property
    def program(self) -> str:
        return f"{self.name}.cu"

    def __repr__(self) -> str:
        """One line: the entry, the source's size and the extra options (not the source itself)."""
        return one_line(f"CompileJob({self.name}: {self.source.count(chr(10)) + 1} lines of CUDA"
                        + (f", options {' '.join(self.options)}" if self.options else "") + ")")


def nvrtc_options(toolchain: Toolchain | None = None, extra: Iterable[str] = ()) -> list[str]:
    """The full NVRTC option list: :data:`BASE_OPTIONS`, ``extra``, then the include dirs."""
    tc = toolchain or find_toolchain()
    return list(BASE_OPTIONS) + list(extra) + [f"-I{d}" for d in tc.include_dirs]


def _key(job: CompileJob, opts: list[str], tc: Toolchain) -> str:
    return cache_key(job.source, opts, nvrtc_version=tc.nvrtc_version, arch=ARCH,
                     cutlass_version=tc.cutlass_version, cccl_version=tc.cccl_version)


def _cache_of(cache) -> KernelCache | None:
    if cache is False or cache is None:
        return None
    if cache is True:
        return KernelCache()
    return cache


def compile_cuda(source: str, name: str, *, options: Iterable[str] = (), cache: KernelCache | bool = True,
                 progress: ProgressFn | None | bool = None, in_process: bool = False,
                 heartbeat: float = 5.0) -> CompiledKernel:
    """Compile ``source`` (one kernel ``name``) to an ``sm_90a`` cubin, or fetch it from the cache."""
    return compile_many([CompileJob(source, name, tuple(options))], cache=cache, progress=progress,
                        in_process=in_process, heartbeat=heartbeat)[0]


def compile_many(jobs: Sequence[CompileJob], *, cache: KernelCache | bool = True,
                 progress: ProgressFn | None | bool = None, workers: int | None = None,
                 in_process: bool = False, heartbeat: float = 5.0) -> list[CompiledKernel]:
    """Compile several kernels, one process-pool job each; results in the order of ``jobs``.

    Raises the :class:`CudaCompileError` of the first failing job (in job order) after all
    jobs finished."""
    t_start = time.perf_counter()
    kc = _cache_of(cache)
    if kc is not None:
        kc.check_usable()                   # a bad TLDSL_CACHE_DIR is refused before NVRTC runs, not after
    if workers is None and not in_process:
        default_workers()                   # so is a bad TLDSL_COMPILE_WORKERS
    tc = find_toolchain()
    report = resolve_progress(progress)
    results: list[CompiledKernel | None] = [None] * len(jobs)
    pending: dict[int, tuple[CompileJob, list[str], str]] = {}

    for i, job in enumerate(jobs):
        opts = nvrtc_options(tc, job.options)
        key = _key(job, opts, tc)
        entry = kc.get(key) if kc is not None else None
        if entry is not None:
            el = time.perf_counter() - t_start
            results[i] = CompiledKernel(job.name, entry.cubin, entry.log, entry.options, key, True, el,
                                        entry.meta.get("compile_seconds", 0.0), entry.meta.get("timings", {}),
                                        job.source, str(kc.root))
            continue
        if kc is not None:
            report(ProgressEvent(job.name, "cache-miss", time.perf_counter() - t_start,
                                 f"not in the cache ({kc.root}), compiling with NVRTC {tc.nvrtc_version} for {ARCH}"))
        pending[i] = (job, opts, key)

    if not pending:
        return results  # type: ignore[return-value]

    outcomes: dict[int, dict] = {}
    if in_process:
        for i, (job, opts, key) in pending.items():
            report(ProgressEvent(job.name, "nvrtc", time.perf_counter() - t_start, "NVRTC compiling (in process)"))
            outcomes[i] = nvrtc_compile(job.source, job.program, opts)
    else:
        pool = _get_pool(min(workers or default_workers(), max(1, len(pending))))
        futs = {}
        for i, (job, opts, key) in pending.items():
            with _without_main_module():       # submit() is where the pool starts its workers
                futs[pool.submit(nvrtc_compile, job.source, job.program, opts)] = i
            report(ProgressEvent(job.name, "queued", time.perf_counter() - t_start,
                                 "NVRTC job submitted to the compile pool"))
        remaining = set(futs)
        while remaining:
            done, remaining = cf.wait(remaining, timeout=heartbeat, return_when=cf.FIRST_COMPLETED)
            for f in done:
                outcomes[futs[f]] = f.result()
            if remaining and not done:
                names = ", ".join(sorted({pending[futs[f]][0].name for f in remaining}))
                report(ProgressEvent(names, "nvrtc", time.perf_counter() - t_start, "NVRTC still compiling"))

    first_error: CudaCompileError | None = None
    for i in sorted(pending):
        job, opts, key = pending[i]
        out = outcomes[i]
        el = time.perf_counter() - t_start
        if not out["ok"]:
            report(ProgressEvent(job.name, "failed", el, f"NVRTC failed after {out['seconds']:.1f} s"))
            err = CudaCompileError(job.name, job.source, out["log"], opts, job.program)
            first_error = first_error or err
            continue
        t = out["timings"]
        if t:
            report(ProgressEvent(job.name, "nvrtc-phase", el,
                                 "front end {:.1f} s, optimizer {:.1f} s, ptxas {:.1f} s".format(
                                     t.get("front_end", 0.0), t.get("optimizer", 0.0), t.get("ptxas", 0.0))))
        report(ProgressEvent(job.name, "done", el,
                             f"compiled in {out['seconds']:.1f} s, cubin {len(out['cubin']) / 1024:.0f} KiB"))
        meta = {"name": job.name, "options": opts, "log": out["log"], "compile_seconds": out["seconds"],
                "timings": t, "versions": tc.versions(), "created": time.time()}
        if kc is not None:
            kc.put(key, out["cubin"], meta)
        results[i] = CompiledKernel(job.name, out["cubin"], out["log"], opts, key, False, el, out["seconds"], t,
                                    job.source, str(kc.root) if kc is not None else None)
    if first_error is not None:
        raise first_error
    return results  # type: ignore[return-value]
