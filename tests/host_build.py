"""g++ builds of the tests' host programs (generated kernels on CPU threads, generated control
code), each distinct program built once per test run and shared by every test and xdist worker.

* **Content-addressed**: a build's key hashes its source, its g++ options, the compiler's version
  and tldsl's headers (``codegen/include``), so a test that builds a program another test (or
  worker) already built gets that executable.
* **Precompiled headers**: the source's leading ``#include`` / ``#define`` lines (the standard
  headers and tldsl's) are compiled once per distinct block and options into a g++ ``.gch``; the
  build includes that header in their place, so the translation unit is the same but its headers
  are parsed once, not in every build (about 1.5 s of a 2 s build).
* **Concurrency**: one lock file per key (``flock``) makes a second builder of the same key wait
  for the first and reuse its result; files are written to a temporary name and moved into place.

The builds live under the run's base temporary folder (:func:`configure`, called by
tests/conftest.py), so every run starts without them.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

INCLUDE = Path(__file__).resolve().parent.parent / "codegen" / "include"

_root: Path | None = None


def configure(root: Path) -> None:
    """Builds of this process go under ``root`` (the same folder for every worker of a run)."""
    global _root
    _root = Path(root)


def build_root() -> Path:
    """The configured folder, or a private temporary one outside a test run."""
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="tldsl-host-builds-"))
    return _root


class BuildError(AssertionError):
    """g++ rejected a program; the message ends with its diagnostics."""


def build(source: str, options: list[str], *, name: str = "prog") -> Path:
    """The executable g++ makes of ``source`` with ``options`` (the command line without the
    source and ``-o``), built once per distinct source and options."""
    key = _digest({"source": source, "options": options, "toolchain": _toolchain_id()})
    folder = build_root() / "bin" / key[:32]
    exe = folder / name
    if exe.exists():
        return exe
    with _locked(folder):
        if not exe.exists():
            _compile(folder, source, options, exe)
    return exe


def _compile(folder: Path, source: str, options: list[str], exe: Path) -> None:
    prefix, body = split_header_prefix(source)
    cpp = folder / "prog.cpp"
    if prefix:
        header = precompiled_header(prefix, options)
        first_body_line = prefix.count("\n") + 1
        source = f'#include "{header}"\n#line {first_body_line} "{cpp}"\n{body}'
    cpp.write_text(source)
    tmp = folder / f".tmp-{os.getpid()}-{exe.name}"
    _run_gxx([*options, str(cpp), "-o", str(tmp)])
    os.replace(tmp, exe)


def precompiled_header(prefix: str, options: list[str]) -> Path:
    """A header holding ``prefix``, beside its ``.gch`` built with ``options`` (g++ uses a
    precompiled header only where the options match those it was built with)."""
    key = _digest({"prefix": prefix, "options": options, "toolchain": _toolchain_id()})
    folder = build_root() / "pch" / key[:32]
    header, gch = folder / "prefix.hpp", folder / "prefix.hpp.gch"
    if gch.exists():
        return header
    with _locked(folder):
        if not gch.exists():
            header.write_text(prefix)
            tmp = folder / f".tmp-{os.getpid()}.gch"
            _run_gxx([*options, "-x", "c++-header", str(header), "-o", str(tmp)])
            os.replace(tmp, gch)
    return header


def split_header_prefix(source: str) -> tuple[str, str]:
    """``source`` cut after its leading blank, ``#include`` and ``#define`` lines (those every
    program of one harness shares), and the rest."""
    lines = source.splitlines(keepends=True)
    n = 0
    while n < len(lines) and (not lines[n].strip() or lines[n].lstrip().startswith(("#include", "#define"))):
        if lines[n].rstrip().endswith("\\"):        # a macro continued on the next line: keep it whole
            break
        n += 1
    while n and not lines[n - 1].strip():
        n -= 1
    return "".join(lines[:n]), "".join(lines[n:])


def _run_gxx(args: list[str]) -> None:
    r = subprocess.run(["g++", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"g++ {' '.join(args)} failed:\n{r.stderr[-4000:]}")


@contextlib.contextmanager
def _locked(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _digest(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _toolchain_id() -> str:
    """What else decides the executable: the compiler's version and tldsl's headers."""
    h = hashlib.sha256(subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.encode())
    for p in sorted(INCLUDE.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(INCLUDE)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()
