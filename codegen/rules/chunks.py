"""Element code and chunk addressing that the general lowering's statement rules share
(:mod:`.tile_ops` for shared-memory tiles, :mod:`.held` for tiles held in registers): the C++
storage type of an element, a loop body's element code, a chunk of a tile's rows and its
tensor row."""
from __future__ import annotations

import math

from ...ir import core
from ...ir import types as T
from ..dtypes import ctype


def storage_ctype(dtype: T.DType) -> str:
    """The C++ type of an element of ``dtype`` in memory (shared or global)."""
    return ctype(dtype).comm


class Elements:
    """The element code of one loop body: its lines and the values already computed there."""

    def __init__(self, emitter, op: core.Op):
        self.em, self.op = emitter, op
        self.lines: list[str] = []
        self.memo: dict = {}
        self.rounded: dict[str, tuple[str, str]] = {}

    def var(self, ctype_: str, expr: str) -> str:
        nm = f"x{self.em.fresh()}"
        self.lines.append(f"const {ctype_} {nm} = {expr};")
        return nm

    def rounded_var(self, storage: str, rounding: str, value: str) -> str:
        """A float variable holding ``value`` rounded to a 16-bit type (``rounding``: its
        function, ``storage``: the type's C++ storage type): a :meth:`put` of it into that type
        converts ``value`` once, not to 16 bits, back, and to 16 bits again."""
        nm = self.var("float", f"{rounding}({value})")
        self.rounded[nm] = (storage, value)
        return nm

    def put(self, storage: str, x: str) -> str:
        """``x`` converted to the memory type ``storage``."""
        kind, value = self.rounded.get(x, (None, None))
        return f"tldsl::gen::put<{storage}>({value if kind == storage else x})"


def vec_ok(buf, base: str, col: str, V: int) -> str:
    """Whether an in-bounds chunk of V elements of ``buf`` starting at column ``col`` (plus a
    multiple of V) is 16-byte aligned: the tensor's pointer, its row pitch and the column."""
    if len(buf.type.shape) > 1 and buf.type.shape[-1] % V:
        return "false"
    return f"((reinterpret_cast<unsigned long long>({base}) & 15ull) == 0ull && (({col}) % {V}) == 0)"


def chunk_coords(el: Elements, e: str, shape, V: int) -> tuple[list[str], str]:
    """(tile coordinates of chunk ``e``'s first element — its rows' and its column —, the chunk's
    offset in the tile's row-major order): a tile's rows cut into chunks of V elements."""
    n = shape[-1]
    nch = -(-n // V)
    coords = []
    for a, s_ in enumerate(shape[:-1]):
        inner = math.prod(shape[a + 1:-1]) * nch
        x = f"{e} / {inner}"
        if a > 0:
            x = f"({x}) % {s_}"
        coords.append(el.var("int", x))
    col = el.var("int", f"({e} % {nch}) * {V}" if nch > 1 else "0")
    flat = el.var("int", f"({e} / {nch}) * {n} + {col}" if len(shape) > 1 else col)
    return coords + [col], flat


def row_pointer(el: Elements, base: str, dims, gcoords: list[str], st: str, write: bool) -> tuple[str, str, int]:
    """(row pointer variable — null where the row lies outside the tensor —, column, row length)
    of tensor coordinates ``gcoords``."""
    conds = [f"(unsigned)({g}) < {d}u" for g, d in zip(gcoords[:-1], dims[:-1])]
    terms, stride = [], 1
    for g, d in reversed(list(zip(gcoords[:-1], dims[:-1]))):
        terms.append(f"(long long)({g})" if stride == 1 else f"(long long)({g}) * {stride}ll")
        stride *= d
    rowlin = " + ".join(reversed(terms)) or "0"
    nm = f"row{el.em.fresh()}"
    ptype = f"{st}*" if write else f"const {st}*"
    el.lines.append(f"{ptype} const {nm} = ({' && '.join(conds) or 'true'}) ? {base} + ({rowlin}) * {dims[-1]}ll "
                    f": nullptr;")
    return nm, gcoords[-1], dims[-1]
