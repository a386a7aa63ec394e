"""Source locations: every IR op remembers the user's line that created it."""
from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass


def library_dirs(ir_dir: str) -> tuple[tuple[str, ...], str]:
    """(the directories whose frames are the compiler's own, the op library's directory) for this
    package's ``ir`` folder at ``ir_dir``. In a source checkout (an editable install) ``tldsl/``,
    ``ir/``, ``codegen/`` and ``runtime/`` stand side by side; installed from a wheel, ``ir/``,
    ``codegen/`` and ``runtime/`` are folders inside the ``tldsl`` package (pyproject's
    ``package-dir``), so the whole package is the compiler's."""
    parent = os.path.dirname(os.path.abspath(ir_dir))
    if os.path.exists(os.path.join(parent, "__init__.py")):        # installed: parent is the tldsl package
        return (parent + os.sep,), os.path.join(parent, "ops") + os.sep
    return (tuple(os.path.join(parent, d) + os.sep for d in ("tldsl", "ir", "codegen", "runtime")),
            os.path.join(parent, "tldsl", "ops") + os.sep)


def pass_through_dirs() -> tuple[str, ...]:
    """The folders of numpy and scipy (where installed; found without importing scipy): a tile
    program that hands a tile to one of their functions reaches tldsl through their frames, and
    the error belongs at the program's line that called them."""
    import importlib.util
    dirs = []
    for name in ("numpy", "scipy"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dirs.append(os.path.dirname(os.path.abspath(spec.origin)) + os.sep)
    return tuple(dirs)


# Frames inside these directories are the compiler's own, or numpy's and scipy's, and are skipped
# (but the op library's).
_INTERNAL, _LIBRARY_OPS = library_dirs(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = _INTERNAL + pass_through_dirs()


@dataclass(frozen=True)
class Location:
    filename: str
    lineno: int
    col: int = 0

    @property
    def source(self) -> str:
        return linecache.getline(self.filename, self.lineno).rstrip("\n")

    def short(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def excerpt(self) -> str:
        """The source line with a caret under its first non-blank character."""
        line = self.source
        if not line:
            return ""
        col = self.col if self.col else len(line) - len(line.lstrip())
        return f"    {line}\n    {' ' * col}^"


import contextlib as _contextlib
import dataclasses as _dataclasses

# `with tl.when(...)` enters through contextlib; `schedule.with_(...)` builds through dataclasses.replace
_STDLIB_HELPERS = (os.path.abspath(_contextlib.__file__), os.path.abspath(_dataclasses.__file__))


def _is_internal(filename: str, func: str = "") -> bool:
    if os.path.abspath(filename) in _STDLIB_HELPERS:
        return True   # contextlib (tl.when) or dataclasses.replace (with_)
    if filename == "<string>" and func in ("__init__", "__post_init__"):
        return True   # dataclass-generated constructors of our frozen schedules
    f = os.path.abspath(filename)
    if f.startswith(_LIBRARY_OPS):
        return False  # the op library is user code written in the DSL
    return f.startswith(_INTERNAL) or f.startswith("<frozen")


def user_frame(skip: int = 1):
    """The innermost frame outside the compiler: the user's tile program, running (or None)."""
    frame = sys._getframe(skip + 1)
    while frame is not None and _is_internal(frame.f_code.co_filename, frame.f_code.co_name):
        frame = frame.f_back
    return frame


def user_location(skip: int = 1) -> Location | None:
    """The innermost frame outside the compiler: the line of the user's tile program."""
    frame = sys._getframe(skip)
    while frame is not None:
        if not _is_internal(frame.f_code.co_filename, frame.f_code.co_name):
            col = 0
            try:  # Python 3.11+: exact column of the call
                positions = list(frame.f_code.co_positions())
                idx = frame.f_lasti // 2
                if 0 <= idx < len(positions) and positions[idx][2] is not None:
                    col = positions[idx][2]
            except Exception:
                pass
            return Location(frame.f_code.co_filename, frame.f_lineno, col)
        frame = frame.f_back
    return None
