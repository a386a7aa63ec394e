"""Content-addressed on-disk cache of compiled kernels.

The key is the SHA-256 of everything that can change the cubin: the CUDA source, the full
NVRTC option list, the NVRTC version, the target arch, the CUTLASS and CCCL header versions,
and a hash of the code generator's own source (``codegen/*.py`` and ``codegen/include``),
so editing a template or a lowering invalidates old entries by itself.

Layout: ``<root>/<key[:2]>/<key>.cubin`` and ``<key>.json`` (kernel name, options, versions,
NVRTC log, timings). Each file is written to a temporary name in the same folder and moved
into place with :func:`os.replace`, JSON last, so a reader that finds the JSON finds a whole
cubin, and concurrent writers of one key cannot leave a torn file.

Root: ``$TLDSL_CACHE_DIR``, else platformdirs' user cache folder for ``tldsl`` (on Linux
``$XDG_CACHE_HOME/tldsl``, else ``~/.cache/tldsl``; each platform's own place elsewhere).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from ... import env
from ...errors import InputError

CODEGEN_DIR = Path(__file__).resolve().parent.parent   # the whole code generator, templates included
FORMAT = 1   # bump when the entry layout changes


def cache_dir() -> Path:
    """``$TLDSL_CACHE_DIR``, else the platform's user cache folder (platformdirs: XDG on Linux)."""
    override = env.get("TLDSL_CACHE_DIR")
    if override:
        return Path(override)
    return Path(platformdirs.user_cache_dir("tldsl", appauthor=False))


@functools.lru_cache(maxsize=None)
def codegen_source_hash() -> str:
    """SHA-256 over the code generator's Python modules and C++ headers (paths and contents)."""
    h = hashlib.sha256()
    files = sorted(p for p in CODEGEN_DIR.rglob("*")
                   if p.is_file() and p.suffix in (".py", ".hpp", ".h", ".cuh") and "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(CODEGEN_DIR)).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


_MARKER = re.compile(r"[ \t]*//[ \t]*tldsl:[^\n]*")


def strip_markers(source: str) -> str:
    """The source without ``// tldsl: file:line`` comments (they name the checkout's paths, and
    change no code: line structure is kept, so ``-lineinfo`` is unaffected)."""
    return _MARKER.sub("", source)


def cache_key(source: str, options: list[str] | tuple[str, ...], *, nvrtc_version: str, arch: str,
              cutlass_version: str, cccl_version: str, codegen_hash: str | None = None) -> str:
    """The content address of one compile. Include paths are machine-specific and left out of
    the options; the header *versions* stand for their contents."""
    doc = {
        "format": FORMAT,
        "source": hashlib.sha256(strip_markers(source).encode()).hexdigest(),
        "options": [o for o in options if not o.startswith(("-I", "--include-path"))],
        "nvrtc": nvrtc_version, "arch": arch, "cutlass": cutlass_version, "cccl": cccl_version,
        "codegen": codegen_hash if codegen_hash is not None else codegen_source_hash(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@dataclass
class CacheEntry:
    key: str
    cubin: bytes
    meta: dict = field(default_factory=dict)

    @property
    def log(self) -> str:
        return self.meta.get("log", "")

    @property
    def options(self) -> list[str]:
        return self.meta.get("options", [])


class KernelCache:
    """``get(key)`` / ``put(key, cubin, meta)`` on one cache root."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.from_env = root is None and bool(env.get("TLDSL_CACHE_DIR"))   # (for the errors: who chose it)
        self.root = Path(root) if root is not None else cache_dir()

    def check_usable(self) -> None:
        """Make the root where it is missing; an InputError naming where the root came from
        (``TLDSL_CACHE_DIR``, or the caller's folder) where it is not a folder or cannot be made —
        before a compile, which would otherwise fail in :meth:`put` after NVRTC's work."""
        what = f"TLDSL_CACHE_DIR={str(self.root)!r}" if self.from_env else f"the kernel cache folder {self.root}"
        fix = "point TLDSL_CACHE_DIR at a folder, or unset it" if self.from_env else "pass a folder"
        if self.root.exists() and not self.root.is_dir():
            raise InputError(f"{what} is not a folder: compiled kernels cannot be kept there ({fix})")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"{what}: cannot create it ({e.strerror or e}), so compiled kernels cannot be kept "
                             f"there ({fix})") from None

    def _paths(self, key: str) -> tuple[Path, Path]:
        d = self.root / key[:2]
        return d / f"{key}.cubin", d / f"{key}.json"

    def get(self, key: str) -> CacheEntry | None:
        cubin_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            cubin = cubin_path.read_bytes()
        except (OSError, ValueError):
            return None
        if meta.get("key") != key or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
            return None   # a damaged or foreign entry: treat as a miss, the next put overwrites it
        return CacheEntry(key, cubin, meta)

    def put(self, key: str, cubin: bytes, meta: dict) -> CacheEntry:
        cubin_path, meta_path = self._paths(key)
        cubin_path.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(meta, key=key, cubin_sha256=hashlib.sha256(cubin).hexdigest(), format=FORMAT)
        _atomic_write(cubin_path, cubin)
        _atomic_write(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
        return CacheEntry(key, cubin, meta)

    def entries(self) -> list[Path]:
        """The files this cache (and the autotuner beside it) wrote under the root, sorted: see
        :func:`entry_files`."""
        return entry_files(self.root)

    def clear(self) -> int:
        """Remove every entry (:meth:`entries`: nothing else under the root); returns how many files
        were deleted."""
        n = 0
        for p in self.entries():
            try:
                p.unlink()
                n += 1
            except OSError:
                pass
        return n


_KEY = r"[0-9a-f]{64}"
_TMP = r"\.tmp-[A-Za-z0-9_]+"     # tempfile.mkstemp(prefix=".tmp-"), left by a writer that was killed
AUTOTUNE_DIR = "autotune"          # runtime/dist/autotune.py keeps its winners here, <key>.json


def is_entry(root: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file of the cache's own layout under ``root``: ``<key[:2]>/<key>.cubin``
    or ``.json`` (``key`` 64 hex digits), ``autotune/<key>.json``, or a ``.tmp-*`` file a writer
    left in one of those folders. Anything else under the root — where ``$TLDSL_CACHE_DIR``
    names a folder that holds other files too — is not the cache's to list or remove."""
    rel = Path(path).relative_to(root).parts
    if len(rel) != 2:
        return False
    folder, name = rel
    if folder == AUTOTUNE_DIR:
        return bool(re.fullmatch(f"{_KEY}\\.json|{_TMP}", name))
    if not re.fullmatch(r"[0-9a-f]{2}", folder):
        return False
    if re.fullmatch(_TMP, name):
        return True
    m = re.fullmatch(f"({_KEY})\\.(?:cubin|json)", name)
    return bool(m) and m.group(1)[:2] == folder


def entry_files(root: str | os.PathLike) -> list[Path]:
    """Every file of the cache's own layout under ``root`` (:func:`is_entry`), sorted; nothing
    where the root is missing or not a folder."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*/*") if is_entry(root, p) and p.is_file() and not p.is_symlink())


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
