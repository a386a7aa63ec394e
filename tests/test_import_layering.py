"""tldsl's modules import one another in one direction only: no import cycles.

A cycle hidden behind a function-local import still ties two modules into one (neither can be
understood, tested or moved without the other), so every import counts here: top-level and
function-local alike. The graph is built from the source with ``ast`` — nothing is imported, so
optional dependencies (torch, cuda.bindings) do not matter — and has one node per module.

What counts as an edge, chosen so that a cycle in the graph is a real one:

* ``import a.b`` — an edge to ``a.b``, and to each package above it that the importer is not
  inside (importing ``a.b`` runs ``a/__init__`` first; a module inside ``a`` runs only after
  ``a/__init__`` has started, so a submodule is no cycle with the ``__init__`` that re-exports it);
* ``from P import x`` — an edge to the submodule ``P.x`` when there is one; otherwise, when
  ``P``'s ``__init__`` re-exports ``x`` from a submodule, an edge to the module that defines
  ``x`` (followed through further re-exports); otherwise an edge to ``P`` itself (a name ``P``
  defines) — and, as above, to the packages above the target that the importer is not inside.
  Relative imports are resolved first.

Modules are found from pyproject.toml (its ``packages`` and ``package-dir``: ``tldsl.ir`` lives
in ir/, ``tldsl.runtime`` in runtime/, ...).
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# packages whose own imports are not read (their modules are still nodes others may import): none
UNREAD: tuple[str, ...] = ()


def _packages() -> dict[str, Path]:
    """Every package pyproject installs, with its folder."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setup.get("package-dir", {})
    dirs: dict[str, Path] = {}
    for pkg in sorted(setup["packages"], key=lambda p: p.count(".")):
        if pkg in mapped:
            dirs[pkg] = ROOT / mapped[pkg]
        else:
            parent, _, leaf = pkg.rpartition(".")
            dirs[pkg] = (dirs[parent] / leaf) if parent else ROOT / pkg
    return dirs


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, is it a package's ``__init__``)."""
    mods = {}
    for pkg, folder in _packages().items():
        for f in sorted(folder.glob("*.py")):
            if f.stem == "__init__":
                mods[pkg] = (f, True)
            else:
                mods[f"{pkg}.{f.stem}"] = (f, False)
    return mods


MODULES = _modules()


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _reexports(package: str) -> dict[str, tuple[str, str]]:
    """Names a package's ``__init__`` imports at its top level: name -> (module, its name there)."""
    path, _ = MODULES[package]
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            source = _absolute(package, True, node)
            for a in node.names:
                out[a.asname or a.name] = (source, a.name)
    return out


def _defining_module(package: str, name: str, seen=()) -> str:
    """The module ``from package import name`` really depends on."""
    if f"{package}.{name}" in MODULES:
        return f"{package}.{name}"
    if package in MODULES and MODULES[package][1] and not package.startswith(UNREAD) and (package, name) not in seen:
        source, original = _reexports(package).get(name, (None, None))
        if source in MODULES:
            return _defining_module(source, original, seen + ((package, name),))
    return package


def imports_of(module: str) -> dict[str, int]:
    """tldsl modules that ``module`` imports anywhere in its source -> line of the first import."""
    path, is_package = MODULES[module]
    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            targets = [source if a.name == "*" else _defining_module(source, a.name) for a in node.names]
        for t in targets:
            if t.split(".")[0] != "tldsl":
                continue
            if t != module:
                edges.setdefault(t, node.lineno)
            parts = t.split(".")
            for above in (".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)):
                if above != module and not module.startswith(above + "."):
                    edges.setdefault(above, node.lineno)
    return edges


def import_graph() -> dict[str, dict[str, int]]:
    return {m: ({} if m.startswith(UNREAD) else imports_of(m)) for m in MODULES}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(component: list[str], graph) -> str:
    inside = set(component)
    lines = [f"import cycle among {', '.join(component)}:"]
    for m in component:
        for t, line in sorted(graph[m].items()):
            if t in inside:
                lines.append(f"    {m} -> {t}  ({MODULES[m][0].relative_to(ROOT)}:{line})")
    return "\n".join(lines)


def test_modules_are_found():
    assert {"tldsl", "tldsl.language", "tldsl.ir.core", "tldsl.runtime.sim.engine",
            "tldsl.runtime.dist.nvshmem"} <= set(MODULES)


def test_every_package_folder_is_installed():
    """A folder with an ``__init__.py`` that pyproject does not list would be missing from a
    (non-editable) install, and from this test's graph."""
    packages = {pkg: folder for pkg, folder in _packages().items() if not pkg.startswith(UNREAD)}
    listed = {folder.resolve() for folder in packages.values()}
    missing = [str(init.parent.relative_to(ROOT)) for folder in packages.values()
               for init in folder.rglob("__init__.py") if init.parent.resolve() not in listed]
    assert not missing, f"package folders missing from pyproject.toml's packages: {sorted(set(missing))}"


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "\n".join(_describe(c, graph) for c in found)


@pytest.mark.parametrize("source, expected", [
    ("from . import core", {"tldsl.ir.core"}),                    # a submodule, not the package
    ("from .core import Kernel", {"tldsl.ir.core"}),
    ("from tldsl.ir import format_kernel", {"tldsl.ir.printer"}),  # a re-export: where it is defined
    ("from tldsl.ir import verify", {"tldsl.ir.verifier"}),
    ("from tldsl import simulate", {"tldsl.runtime.sim.simulate", "tldsl.runtime.sim", "tldsl.runtime"}),
    ("import tldsl as tl", {"tldsl"}),
    ("from tldsl import __version__", {"tldsl"}),                 # a name the package itself defines
    ("from tldsl.runtime.dist import release_unclosed",           # from outside: the packages above too
     {"tldsl.runtime.dist.symmetric", "tldsl.runtime.dist", "tldsl.runtime"}),
    ("import tldsl.runtime.sim.engine", {"tldsl.runtime.sim.engine", "tldsl.runtime.sim", "tldsl.runtime"}),
    ("def f():\n    from ..runtime.sim import SimOptions",    # function-local imports count
     {"tldsl.runtime.sim.options", "tldsl.runtime.sim", "tldsl.runtime"}),
])
def test_edges_are_resolved(tmp_path, source, expected, monkeypatch):
    f = tmp_path / "probe.py"
    f.write_text(source)
    monkeypatch.setitem(MODULES, "tldsl.ir.probe", (f, False))
    assert set(imports_of("tldsl.ir.probe")) == expected


def test_a_cycle_is_reported():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(graph) == [["a", "b", "c"]]
