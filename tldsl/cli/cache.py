"""``python -m tldsl cache info|clear``: the on-disk cache of compiled kernels
(:mod:`tldsl.codegen.toolchain.cache`) — where it is and what it holds, and emptying it after
saying what goes. The autotuner keeps its winners under the same root (``autotune/``), and
clearing the cache removes them too, so both are counted."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .. import env
from ..codegen.toolchain.cache import AUTOTUNE_DIR, KernelCache, cache_dir, entry_files


@dataclass
class Contents:
    """The files :meth:`KernelCache.clear` would remove, sorted by what they are."""
    root: Path
    kernels: int = 0           # cubins (each with its JSON record)
    autotuned: int = 0         # the autotuner's cached winners
    files: list[Path] = field(default_factory=list)
    bytes: int = 0

    def __str__(self) -> str:
        return (f"{self.kernels} compiled kernel{'s' * (self.kernels != 1)}, {self.autotuned} autotuned "
                f"schedule{'s' * (self.autotuned != 1)} ({len(self.files)} files, {_size(self.bytes)})")


def contents(root: Path) -> Contents:
    """The cache's own files under ``root`` (:func:`~tldsl.codegen.toolchain.cache.entry_files`:
    the layout :class:`KernelCache` and the autotuner write, and all that :meth:`KernelCache.clear`
    removes; other files under a shared root are neither counted nor removed)."""
    found = Contents(root)
    for p in entry_files(root):
        try:
            size = p.stat().st_size
        except OSError:   # removed meanwhile
            continue
        found.files.append(p)
        found.bytes += size
        found.kernels += p.suffix == ".cubin"
        found.autotuned += p.parent.name == AUTOTUNE_DIR and p.suffix == ".json"
    return found


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _chosen_by() -> str:
    if env.get("TLDSL_CACHE_DIR"):
        return "$TLDSL_CACHE_DIR"
    return "this platform's user cache folder; set TLDSL_CACHE_DIR to move it"


def info() -> int:
    root = cache_dir()
    found = contents(root)
    print(f"cache: {root} ({_chosen_by()})")
    if root.exists() and not root.is_dir():
        print(f"holds: nothing — {root} is not a folder, so nothing compiled can be kept there (set TLDSL_CACHE_DIR "
              "to a folder)")
        return 1
    print(f"holds: {found}" if found.files else "holds: nothing (nothing compiled yet)")
    return 0


def clear() -> int:
    root = cache_dir()
    found = contents(root)
    if not found.files:
        print(f"cache: {root} holds nothing; nothing to remove")
        return 0
    print(f"removing {found} from {root}")
    KernelCache(root).clear()
    left = contents(root)
    if left.files:
        print(f"could not remove {len(left.files)} of them, e.g. {left.files[0]}")
        return 1
    print("removed")
    return 0
