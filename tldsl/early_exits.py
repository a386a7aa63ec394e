"""Python statements that would leave a traced region early: refused where they stand.

The tracer runs a ``for i in tl.range(...)`` body once, symbolically, and the IR loop runs every
iteration; it runs a ``with tl.when(c):`` body once, and the IR runs it where ``c`` holds. A
``break`` or ``return`` in such a loop, or a ``return``, ``break`` or ``continue`` in such a body,
is a Python jump taken at trace time: for every iteration and every task, where the program meant
some of them. Left alone, the IR would silently be another program (the loop run whole, the code
after a ``return`` never traced). A ``when`` body leaves through its context manager's ordinary
exit whichever way it ends, so its jumps are found in the source (the statements inside it, not in
a nested function, and ``break`` / ``continue`` not in a loop of its own); a loop's generator is
closed unfinished when its body is left, which :class:`.language.range` notices itself, and the
source then names the statements that could have done it.
"""
from __future__ import annotations

import ast
import linecache
import threading
from dataclasses import dataclass

from . import loop_carried

@dataclass(frozen=True)
class SourceIndex:
    """What one version of a source file says about its traced regions, by header line."""
    lines: list                   # the linecache lines it was built from
    parsed: bool                  # whether there was source to parse
    with_jumps: dict              # `with` header line -> the jumps leaving its body
    for_jumps: dict               # `for` header line -> the break / return statements leaving its body
    for_wrappers: dict            # `for` header line -> the call wrapping a `range(...)` it iterates
    for_carried: dict             # `for` header line -> {name: (read, binding)} its body carries over
    with_escaping: dict           # `with` header line -> {name: binding} its body binds and the code reads after


#: per source file: its index
_INDEX: dict[str, SourceIndex] = {}
#: one index built at a time: ranks traced in threads (the fused-op runtime's) would otherwise parse
#: at once, which CPython 3.11's parser does not survive ("AST constructor recursion depth mismatch")
_LOCK = threading.Lock()
_NESTED_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def _index(filename: str, globals_=None) -> SourceIndex:
    """The :class:`SourceIndex` of ``filename``'s source (a notebook cell too: IPython keeps its cells in
    linecache), built once per version of the source; empty where it cannot be read or parsed."""
    with _LOCK:
        return _index_locked(filename, globals_)


def _index_locked(filename: str, globals_) -> SourceIndex:
    linecache.checkcache(filename)       # a module edited and reloaded: its current source (a stat)
    lines = linecache.getlines(filename, globals_)
    if filename in _INDEX and _INDEX[filename].lines is lines:     # (held: its id is never reused)
        return _INDEX[filename]
    try:
        tree = ast.parse("".join(lines)) if lines else None
    except (SyntaxError, ValueError):
        tree = None
    if tree is None:
        _INDEX[filename] = SourceIndex(lines, False, {}, {}, {}, {}, {})
        return _INDEX[filename]
    withs: dict[int, list] = {}
    fors: dict[int, list] = {}
    wrapped: dict[int, str] = {}
    carried: dict[int, dict] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            jumps = list(_jumps(node.body, (ast.Return, ast.Break, ast.Continue)))
            for line in range(node.lineno, node.items[-1].context_expr.end_lineno + 1):
                withs.setdefault(line, []).extend(jumps)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            jumps = list(_jumps(node.body, (ast.Return, ast.Break)))
            wrapper = _range_wrapper(node.iter)
            names = loop_carried.carried_names(node)
            for line in range(node.lineno, node.iter.end_lineno + 1):
                fors.setdefault(line, []).extend(jumps)
                if wrapper is not None:
                    wrapped[line] = wrapper
                if names:
                    carried.setdefault(line, {}).update(names)
    _INDEX[filename] = SourceIndex(lines, True, withs, fors, wrapped, carried, loop_carried.when_escaping_names(tree))
    return _INDEX[filename]


def _call_name(node) -> str | None:
    """``zip`` of ``zip(...)``, ``range`` of ``tl.range(...)``; None where ``node`` is no call of a name."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _range_wrapper(iter_node) -> str | None:
    """The call (``zip``, ``enumerate``...) a ``for`` statement iterates that holds a ``range(...)`` call
    among its arguments; None where the iterable is itself the ``range`` call, or holds none."""
    name = _call_name(iter_node)
    if name is None or name == "range":
        return None
    inner = [n for a in (*iter_node.args, *(k.value for k in iter_node.keywords)) for n in ast.walk(a)]
    return name if any(_call_name(n) == "range" for n in inner) else None


def _jumps(body, kinds, in_loop=False):
    """The statements of ``kinds`` in ``body`` that leave it (not those of a nested function or
    class; a ``break`` / ``continue`` only where no loop of its own is around it)."""
    for node in body:
        if isinstance(node, _NESTED_SCOPES):
            continue
        if isinstance(node, (ast.Return, ast.Break, ast.Continue)):
            if isinstance(node, kinds) and (isinstance(node, ast.Return) or not in_loop):
                yield node
        elif isinstance(node, _LOOPS):
            yield from _jumps(node.body, kinds, True)
            yield from _jumps(node.orelse, kinds, in_loop)
        else:                   # the statements of an if / with / try / match
            yield from _jumps([c for c in ast.iter_child_nodes(node)
                               if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case))], kinds, in_loop)


def keyword(stmt) -> str:
    return {ast.Return: "return", ast.Break: "break", ast.Continue: "continue"}[type(stmt)]


def when_body_jumps(frame) -> list[ast.stmt]:
    """The ``return`` / ``break`` / ``continue`` statements leaving the ``with`` statement that
    ``frame`` is entering (the one whose header holds its current line)."""
    if frame is None:
        return []
    withs = _index(frame.f_code.co_filename, frame.f_globals).with_jumps
    return sorted(withs.get(frame.f_lineno, ()), key=lambda s: s.lineno)


def loop_body_jumps(filename: str, lineno: int, globals_=None) -> list[ast.stmt]:
    """The ``break`` / ``return`` statements that leave the ``for`` loop whose header holds line
    ``lineno`` of ``filename``."""
    fors = _index(filename, globals_).for_jumps
    return sorted(fors.get(lineno, ()), key=lambda s: s.lineno)


def loop_iterable_wrapper(filename: str, lineno: int, globals_=None) -> str | None:
    """The call (``zip``, ``enumerate``, ``map``...) around a ``range(...)`` call that the ``for``
    statement whose header holds line ``lineno`` iterates; None where it iterates the call itself."""
    return _index(filename, globals_).for_wrappers.get(lineno)


def loop_carried_names(filename: str, lineno: int, globals_=None) -> dict:
    """{name: (its first read, its first binding)} of the names that the body of the ``for`` loop whose
    header holds line ``lineno`` reads before binding them (:func:`.loop_carried.carried_names`)."""
    return _index(filename, globals_).for_carried.get(lineno, {})


def when_escaping_names(frame) -> dict:
    """{name: its binding} of the names the ``with`` statement ``frame`` is entering binds in its body
    and reads after it (:func:`.loop_carried.when_escaping_names`)."""
    if frame is None:
        return {}
    return _index(frame.f_code.co_filename, frame.f_globals).with_escaping.get(frame.f_lineno, {})


def has_source(filename: str, globals_=None) -> bool:
    """Whether ``filename``'s source can be read and parsed here (then what it lacks, it lacks)."""
    return _index(filename, globals_).parsed


def describe(stmts) -> str:
    """``the return at line 12`` / ``the break at line 9 or the return at line 14``."""
    return " or ".join(f"the {keyword(s)} at line {s.lineno}" for s in stmts)
