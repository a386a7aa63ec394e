"""Python names a ``tl.range`` body reads before it rebinds them: values Python would carry from one
iteration to the next, which the trace cannot; and names a ``tl.when`` body binds that are read after
it, which hold the body's value whether or not its condition held.

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


def _scope_nodes(scope):
    """The nodes of a function's (or module's) own body, not those of functions or classes in it."""
    todo = list(scope.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (*_SCOPES, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def when_escaping_names(tree) -> dict[int, dict[str, ast.AST]]:
    """{line of a ``with`` header: {name: its first binding in the body}} of the names a ``with`` body
    binds and its function reads after the statement ends (by line): a ``tl.when`` body is traced for
    every task, so after it such a name holds the body's value, taken or not."""
    out: dict[int, dict[str, ast.AST]] = {}
    for scope in ast.walk(tree):
        if not isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes = list(_scope_nodes(scope))
        for w in nodes:
            if not isinstance(w, (ast.With, ast.AsyncWith)):
                continue
            bound: dict[str, ast.AST] = {}
            for stmt in w.body:
                for n in _scope_nodes(ast.Module(body=[stmt], type_ignores=[])):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        bound.setdefault(n.id, n)
            if not bound:
                continue
            read_after = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                          and n.lineno > w.end_lineno}
            escaping = {k: v for k, v in bound.items() if k in read_after}
            if escaping:
                for line in range(w.lineno, w.items[-1].context_expr.end_lineno + 1):
                    out.setdefault(line, {}).update(escaping)
    return out


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
