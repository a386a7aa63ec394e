"""Python names a ``tl.range`` body reads before it rebinds them: values Python would carry from one
iteration to the next, which the trace cannot.

The tracer runs a loop's body once, so ``off += 8`` or ``prev = t`` in the body leaves every
iteration of the IR loop reading the value the name had before the loop — another program than the
one written, silently. The source says which names are read before they are bound in the body (in
evaluation order) and bound somewhere in it; :class:`.language.range` then compares their objects
before and after the body's trace, so an in-place update (``acc += ...`` of a fragment returns the
fragment itself) and a name bound to an equal number pass, and only a real rebinding is refused.
"""
from __future__ import annotations

import ast
import numbers

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class _EvaluationOrder(ast.NodeVisitor):
    """Walks a loop body in the order Python evaluates it, noting each name's first read while it is
    not yet bound in the body, and each name's first binding."""

    def __init__(self, loop_targets: set[str]):
        self.bound = set(loop_targets)          # the loop's own index: bound before the body runs
        self.first_read: dict[str, ast.AST] = {}
        self.first_binding: dict[str, ast.AST] = {}

    def _read(self, name: str, node) -> None:
        if name not in self.bound:
            self.first_read.setdefault(name, node)

    def _bind(self, name: str, node) -> None:
        self.bound.add(name)
        self.first_binding.setdefault(name, node)

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self._read(node.id, node)
        else:
            self._bind(node.id, node)

    def visit_Assign(self, node):
        self.visit(node.value)
        for t in node.targets:
            self.visit(t)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
            self.visit(node.target)

    def visit_AugAssign(self, node):
        if isinstance(node.target, ast.Name):
            self._read(node.target.id, node.target)
            self.visit(node.value)
            self._bind(node.target.id, node)
        else:
            self.visit(node.value)
            self.visit(node.target)

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node):
        self.visit(node.iter)
        self.visit(node.target)
        for stmt in (*node.body, *node.orelse):
            self.visit(stmt)

    visit_AsyncFor = visit_For

    def _scope(self, node):            # a nested function or class: its body reads at call time
        for d in getattr(node, "decorator_list", ()):
            self.visit(d)
        self._bind(node.name, node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Lambda(self, node):
        pass

    def _comprehension(self, node):
        own = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        self.visit(node.generators[0].iter)
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in own:
                self._read(n.id, n)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension


def carried_names(loop: ast.For) -> dict[str, tuple[ast.AST, ast.AST]]:
    """{name: (its first read, its first binding)} of the names ``loop``'s body reads before binding
    them and binds somewhere: what Python would carry into the next iteration."""
    targets = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    order = _EvaluationOrder(targets)
    for stmt in loop.body:
        order.visit(stmt)
    return {name: (read, order.first_binding[name]) for name, read in order.first_read.items()
            if name in order.first_binding and name not in targets}


def same_value(before, after) -> bool:
    """Whether a name still holds what it held: the same object, or an equal plain number."""
    if after is before:
        return True
    return (isinstance(before, numbers.Number) and isinstance(after, numbers.Number)
            and type(before) is type(after) and bool(before == after))


_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
            ast.Pow: "**", ast.MatMult: "@", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
            ast.LShift: "<<", ast.RShift: ">>"}


def operator_symbol(op: ast.operator) -> str:
    """``+`` of ``ast.Add()``: how an augmented assignment's operator is written."""
    return _SYMBOLS.get(type(op), "?")
