"""Does torch's NVSHMEM match the NVSHMEM headers that ``transport='nvshmem'`` kernels compile
against?

Those kernels are compiled in NVSHMEM's header-only mode and run against the host library torch
loads (``libnvshmem_host.so.3`` of torch's ``nvidia-nvshmem`` wheel; ``runtime/dist/nvshmem.py``):
device code and host library must be one NVSHMEM version. The CPU install pins the headers to
the GPU hosts' version (:data:`NVSHMEM_PINNED`, pyproject.toml's PINS); a GPU host takes torch's
own. Everything here is read from package metadata and one header: nothing is imported or loaded.
"""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

#: The NVSHMEM of the GPU hosts' torch (2.11+cu130), which the ``[cpu]`` extra pins the headers to.
NVSHMEM_PINNED = "3.4.5"

_TORCH_REQUIREMENT = re.compile(r"^\s*(nvidia[-_.]nvshmem[-_.]cu\d+)\s*==\s*([0-9][\w.]*)", re.I)


def header_version(include_dir: Path | None) -> str | None:
    """``major.minor.patch`` from ``non_abi/nvshmem_version.h`` under ``include_dir``, or None."""
    if include_dir is None:
        return None
    try:
        text = (Path(include_dir) / "non_abi" / "nvshmem_version.h").read_text()
    except OSError:
        return None
    parts = [re.search(rf"#define NVSHMEM_VENDOR_{k}_VERSION (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def torch_nvshmem() -> tuple[str, str, str] | None:
    """``(torch's version, the NVSHMEM wheel it requires, that wheel's version)`` — the installed
    version where the wheel is installed (the library torch loads), else the one torch names; None
    where torch is absent or brings no NVSHMEM (a CPU build)."""
    try:
        torch_version = metadata.version("torch")
        requires = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = _TORCH_REQUIREMENT.match(req)
        if m and "extra" not in req.partition(";")[2]:
            dist, wanted = m.group(1), m.group(2)
            try:
                return torch_version, dist, metadata.version(dist)
            except metadata.PackageNotFoundError:
                return torch_version, dist, wanted
    return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def mismatch(include_dir: Path | None) -> str | None:
    """Why NVSHMEM kernels compiled against the headers in ``include_dir`` must not run beside
    the installed torch, or None where they may (or torch brings no NVSHMEM)."""
    headers = header_version(include_dir)
    torch_side = torch_nvshmem()
    if headers is None or torch_side is None:
        return None
    torch_version, dist, linked = torch_side
    if _release(linked) == _release(headers):
        return None
    return (f"torch {torch_version} links NVSHMEM {linked} ({dist}), but the NVSHMEM headers that "
            f"transport='nvshmem' kernels compile against are {headers} ({include_dir}); device code and host "
            f"library must be one version. Choose one: a torch built on NVSHMEM {headers} (the GPU hosts' "
            f"torch 2.11+cu130 is built on {NVSHMEM_PINNED}), or torch's own headers: pip install "
            f"'{dist}=={linked}' (untested with tldsl; README 'Version pins')")
