"""A small autotuner for fused ops: measure candidate ``(compute, comm)`` schedules, keep the
fastest, remember the choice on disk.

* **Measure**: the caller gives ``measure(candidate) -> [ms, ...]`` (per-launch times, e.g.
  :func:`cuda_event_timings`); the tuner takes the median. Under torch.distributed every rank
  measures every candidate in the same order and the tuner uses the slowest rank's median
  (:class:`TorchCollective`), so all ranks pick the same schedule. A candidate that raises (a
  schedule the lowering rejects, a wrong result reported by the caller's check) is skipped on
  every rank; if every candidate fails the tuner raises :class:`AutotuneError` with each error.
* **Cache**: one JSON file per key in ``<codegen.cache.cache_dir()>/autotune/`` — the same root as
  the compiled kernels (``$TLDSL_CACHE_DIR``). The key hashes (op, shapes, dtype, world size, GPU
  name, tldsl version); a cached choice is used only if it is still among the candidates (by its
  label, the candidate's ``repr``). Rank 0 reads and writes the file and broadcasts what it
  found, so ranks never diverge (one tuning while another uses a cached choice would deadlock
  their collectives). Files are written atomically; a folder that cannot be written is an
  InputError naming it (and ``TLDSL_CACHE_DIR`` where that chose it) before anything is measured.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ...errors import InputError, TldslError

FORMAT = 1


class AutotuneError(TldslError):
    """No candidate schedule could be measured."""


def candidate_label(candidate) -> str:
    """A stable text for a candidate (schedules are frozen dataclasses: their repr is stable)."""
    if isinstance(candidate, (tuple, list)):
        return " | ".join(repr(c) for c in candidate)
    return repr(candidate)


def tldsl_version() -> str:
    import tldsl
    return str(getattr(tldsl, "__version__", "unknown"))


def key_fields(op: str, shapes, dtype, world_size: int, gpu_name: str, version: str | None = None) -> dict:
    return {"format": FORMAT, "op": str(op), "shapes": json.loads(json.dumps(shapes, default=list)),
            "dtype": str(dtype).replace("torch.", ""), "world_size": int(world_size), "gpu": str(gpu_name),
            "version": str(version if version is not None else tldsl_version())}


def tune_key(op: str, shapes, dtype, world_size: int, gpu_name: str, version: str | None = None) -> str:
    """The cache key: SHA-256 of (op, shapes, dtype, world size, GPU name, tldsl version)."""
    doc = key_fields(op, shapes, dtype, world_size, gpu_name, version)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _nearest_existing(path: Path) -> Path:
    """``path``, else its nearest ancestor that exists — or is a dangling link, under which nothing
    can be made either (a file among the ancestors ends the walk the same way: ``exists`` is
    False below it)."""
    return next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), path)


# -- collectives -----------------------------------------------------------------------------------

class LocalCollective:
    """One process: nothing to agree on."""
    rank = 0

    def broadcast(self, obj):
        return obj

    def max(self, x: float) -> float:
        return x

    def all_ok(self, ok: bool) -> bool:
        return ok


class TorchCollective:
    """torch.distributed: rank 0's object to all, the max of a float, the AND of a flag."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)

    def broadcast(self, obj):
        buf = [obj]
        self.dist.broadcast_object_list(buf, src=self.dist.get_global_rank(self.group, 0) if self.group else 0,
                                        group=self.group)
        return buf[0]

    def _reduce(self, x: float, op) -> float:
        import torch
        t = torch.tensor([float(x)], device="cuda")
        self.dist.all_reduce(t, op=op, group=self.group)
        return float(t.item())

    def max(self, x: float) -> float:
        return self._reduce(x, self.dist.ReduceOp.MAX)

    def all_ok(self, ok: bool) -> bool:
        return self._reduce(1.0 if ok else 0.0, self.dist.ReduceOp.MIN) > 0.5


# -- timing ----------------------------------------------------------------------------------------

def cuda_event_timings(fn: Callable[[], object], iters: int = 20, warmup: int = 5,
                       before_each: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of each of ``iters`` launches of ``fn``, CUDA events around each launch,
    after ``warmup`` launches; ``before_each`` (e.g. a group barrier) runs before each, untimed."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        if before_each is not None:
            before_each()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


# -- the tuner -------------------------------------------------------------------------------------

@dataclass
class Trial:
    label: str
    candidate: object
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class TuneResult:
    key: str
    best: object
    best_label: str
    median_ms: float | None
    cached: bool
    trials: list[Trial]
    path: Path

    def table(self) -> str:
        """Every candidate's time, fastest marked (markdown)."""
        lines = ["| candidate | median ms | vs best |", "|---|---|---|"]
        for t in self.trials:
            if t.ok:
                mark = " **best**" if t.label == self.best_label else ""
                lines.append(f"| {t.label} | {t.median_ms:.3f}{mark} | {t.median_ms / self.median_ms:.3f} |")
            else:
                lines.append(f"| {t.label} | failed: {t.error} | |")
        return "\n".join(lines)


class Autotuner:
    """``tune(...)`` picks the fastest candidate (cached); see the module docstring."""

    def __init__(self, cache_dir: str | os.PathLike | None = None, collective=None, version: str | None = None):
        # who chose the root, for the errors: the caller, TLDSL_CACHE_DIR, or the platform's default
        self.chosen_by = "caller"
        if cache_dir is None:
            from ...codegen.toolchain.cache import KernelCache
            kernels = KernelCache()            # the kernel cache's root, and whether TLDSL_CACHE_DIR chose it
            cache_dir, self.chosen_by = kernels.root, "env" if kernels.from_env else "default"
        self.root = Path(cache_dir) / "autotune"
        self.collective = collective or LocalCollective()
        self.version = version

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def check_writable(self) -> None:
        """An InputError naming where the root came from (``TLDSL_CACHE_DIR``, or the caller's
        folder) where the tuner's folder cannot be written — before any candidate is compiled or
        launched, which :meth:`_write` would otherwise learn only after measuring them all (an
        untyped OSError). Creates nothing: only rank 0 writes, but every rank checks (ranks of one
        host share the folder, so they raise together, none left waiting in a collective)."""
        where, fix = {
            "env": (f"TLDSL_CACHE_DIR={str(self.root.parent)!r}",
                    "point TLDSL_CACHE_DIR at a writable folder, or unset it"),
            "caller": (f"the cache folder {self.root.parent}", "pass a writable folder"),
            "default": (f"the user cache folder {self.root.parent}", "set TLDSL_CACHE_DIR to a writable folder"),
        }[self.chosen_by]
        there = _nearest_existing(self.root)
        if not there.is_dir():
            raise InputError(f"{where}: {there} is not a folder, so the autotuner cannot keep its choices in "
                             f"{self.root} ({fix})")
        if not os.access(there, os.W_OK | os.X_OK):
            raise InputError(f"{where}: {there} is not writable, so the autotuner cannot keep its choices in "
                             f"{self.root} ({fix})")

    def _read(self, key: str) -> dict | None:
        try:
            doc = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("key") != key or doc.get("format") != FORMAT:
            return None
        return doc

    def lookup(self, key: str, candidates: Sequence) -> tuple[object, dict] | None:
        """The cached choice among ``candidates`` (rank 0's file, broadcast), or None."""
        doc = self._read(key) if self.collective.rank == 0 else None
        doc = self.collective.broadcast(doc)
        if doc is None:
            return None
        labels = [candidate_label(c) for c in candidates]
        if doc.get("best") not in labels:
            return None
        return candidates[labels.index(doc["best"])], doc

    def tune(self, op: str, shapes, dtype, world_size: int, gpu_name: str, candidates: Sequence,
             measure: Callable[[object], Sequence[float]], *, force: bool = False,
             log: Callable[[Trial], object] | None = None) -> TuneResult:
        """Measure every candidate (unless a cached choice exists and not ``force``) and return
        the fastest. ``measure(candidate)`` returns per-launch milliseconds; it may raise."""
        if not candidates:
            raise AutotuneError(f"{op}: no candidate schedules to tune")
        labels = [candidate_label(c) for c in candidates]
        if len(set(labels)) != len(labels):
            raise AutotuneError(f"{op}: duplicate candidates {labels}")
        key = tune_key(op, shapes, dtype, world_size, gpu_name, self.version)
        if not force:
            hit = self.lookup(key, candidates)
            if hit is not None:
                cand, doc = hit
                trials = [Trial(t["label"], None, t.get("median_ms"), [], t.get("error")) for t in doc.get("trials", [])]
                return TuneResult(key, cand, candidate_label(cand), doc.get("median_ms"), True, trials, self.path(key))
        self.check_writable()
        trials = []
        for cand, label in zip(candidates, labels):
            err, times = None, []
            try:
                times = [float(x) for x in measure(cand)]
                if not times or any(not (x == x) or x < 0 for x in times):
                    raise AutotuneError(f"measure returned no usable times: {times}")
            except Exception as e:   # noqa: BLE001 - a candidate may fail in any way; keep tuning
                err = f"{type(e).__name__}: {e}"
            ok = self.collective.all_ok(err is None)
            if err is None and not ok:
                err = "failed on another rank"
            if err is not None:
                # every rank reaches the same max() calls: the failed candidate contributes none
                trial = Trial(label, cand, None, times, err[:500])
            else:
                med = self.collective.max(statistics.median(times))
                trial = Trial(label, cand, med, times)
            trials.append(trial)
            if log is not None:
                log(trial)
        good = [t for t in trials if t.ok]
        if not good:
            raise AutotuneError(f"{op}: every candidate failed:\n" + "\n".join(f"  {t.label}: {t.error}" for t in trials))
        best = min(good, key=lambda t: t.median_ms)        # ties: the earlier candidate
        if self.collective.rank == 0:
            self._write(key, op, shapes, dtype, world_size, gpu_name, best, trials)
        return TuneResult(key, best.candidate, best.label, best.median_ms, False, trials, self.path(key))

    def _write(self, key, op, shapes, dtype, world_size, gpu_name, best: Trial, trials: list[Trial]):
        doc = {"format": FORMAT, "key": key, "fields": key_fields(op, shapes, dtype, world_size, gpu_name, self.version),
               "best": best.label, "median_ms": best.median_ms, "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "trials": [{"label": t.label, "median_ms": t.median_ms, "error": t.error} for t in trials]}
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path(key))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
