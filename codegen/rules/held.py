"""The C++ of the statements that run in chunk order (:mod:`..plan.held`): the ones that define
or read a tile held in registers.

A held tile is an array of ``tldsl::comm::Chunk<T, V>`` a thread, ``hold<id>[s]`` its chunk
``s * threads + tid`` (declared where the tile is defined, in the scope of every statement
that reads it). Each statement here walks the same chunks, unrolled, so every index into a
held array is a constant: the loads go from global memory straight into the registers (no
barrier of their own: :mod:`.barriers` puts one before a statement writing the tensor they
read), stores and element values
read them element for element, and a reduction along the rows first combines each chunk's ``V``
elements in its thread, writes one partial result a chunk to shared memory, and reduces those
as any row reduction does (:func:`.tile_ops._reduce_statement`)."""
from __future__ import annotations

from ...ir import core
from ..abi import buffer_param, marker
from ..plan.held import ChunkOrder
from . import primitives
from .chunks import Elements, chunk_coords, row_pointer, storage_ctype, vec_ok


def held_name(v: core.Value) -> str:
    return f"hold{v.id}"


class ChunkWalk:
    """One chunk-order loop: its variables, and the element coordinates of element ``v`` of the
    chunk (the keys under which the held values' elements are known to the element code)."""

    def __init__(self, em, order: ChunkOrder):
        k = em.fresh()
        self.em, self.order = em, order
        self.s, self.c, self.v = f"s{k}", f"c{k}", f"v{k}"

    def open(self, el, ind: str, lines: list[str], then=None):
        """Open the loop over this thread's chunks; returns (the chunk's first element's
        coordinates, the indent inside, what ``then(el, coords)`` returned — index code it adds
        to ``el``, which runs at the top of each chunk)."""
        coords, _ = chunk_coords(el, self.c, self.order.shape, self.order.V)
        extra = then(el, coords) if then is not None else None
        # the test stays where the threads divide the tile: without it ptxas hoists every chunk's
        # address code and a 16384-wide residual add + RMSNorm spilled 1.1 KB a thread
        lines += [f"{ind}#pragma unroll",
                  f"{ind}for (int {self.s} = 0; {self.s} < {self.order.per_thread}; ++{self.s}) {{",
                  f"{ind}  const int {self.c} = {self.s} * gthreads + tid;",
                  f"{ind}  if ({self.c} < {self.order.chunks}) {{"]
        inner = ind + "    "
        lines += [f"{inner}{ln}" for ln in el.lines]
        return coords, inner, extra

    def close(self, ind: str, lines: list[str]) -> None:
        lines += [f"{ind}  }}", f"{ind}}}"]

    def element_coords(self, coords: list[str], index: str | None = None) -> list[str]:
        return coords[:-1] + [f"({coords[-1]} + {self.v if index is None else index})"]

    def know_held(self, el, coords: list[str], index: str | None = None) -> None:
        """Tell ``el`` where element ``index`` (default: the loop's ``v``) of this chunk of every
        held tile of this order is."""
        key = tuple(self.element_coords(coords, index))
        at = self.v if index is None else index
        for vid, h in self.em.plan.held.items():
            if h.order == self.order:
                el.memo[(vid, key)] = f"tldsl::gen::get({held_name(h.value)}[{self.s}].get({at}))"


def declare(em, v: core.Value, ind: str, lines: list[str]) -> str:
    h = em.plan.held[v.id]
    name = held_name(v)
    lines.append(f"{ind}tldsl::comm::Chunk<{storage_ctype(v.type.dtype)}, {h.order.V}> {name}[{h.order.per_thread}];"
                 f"  // {'x'.join(map(str, v.type.shape))} {v.type.dtype} in registers{marker(v.owner.loc)}")
    return name


def held_load(em, op, offs: list[str], ind: str, lines: list[str]) -> None:
    """A load into registers: each thread's chunks straight from global memory (vector loads
    where inside the tensor and aligned, element by element at its edges, zeros outside) — no
    barrier of its own: a later statement writing the tensor gets one before it (:mod:`.barriers`;
    another thread could otherwise overwrite chunks this one has not loaded yet). A
    prefetched load (:func:`..plan.held.prefetchable`) takes the chunks fetched during the task
    before, then fetches the next task's."""
    if op.result.id in em.plan.invariant:
        lines.append(f"{ind}// {held_name(op.result)}: the same tile every task, loaded before the first"
                     f"{marker(op.loc)}")
        return
    name = declare(em, op.result, ind, lines)
    if op.result.id not in em.plan.prefetch:
        _fill_chunks(em, op, offs, name, ind, lines)   # a later write of the tensor: barrier before it
        return
    order = em.plan.held[op.result.id].order
    s = f"s{em.fresh()}"
    lines += [f"{ind}#pragma unroll",
              f"{ind}for (int {s} = 0; {s} < {order.per_thread}; ++{s}) {name}[{s}] = {name}_next[{s}];"
              f"  // fetched during the task before{marker(op.loc)}",
              f"{ind}if (task + (int)gridDim.x * kGroups < {em.num_tasks}) "
              f"fetch{op.result.id}(task + (int)gridDim.x * kGroups);  // the next task's, while this one computes"]


def _fill_chunks(em, op, offs: list[str], name: str, ind: str, lines: list[str]) -> None:
    buf = op.operands[0].owner
    order = em.plan.held[op.result.id].order
    walk = ChunkWalk(em, order)
    _, i2, (st, row, col, ncols, vec) = _tensor_walk(em, op, walk, buf, offs, False,
                                                     f"load {buf.name} -> {name}, chunks of {order.V} in registers",
                                                     ind, lines)
    lines.append(f"{i2}" + primitives.tile_pull_data(st, row, col, ncols, chunk=f"{name}[{walk.s}]",
                                                     vec=str(order.V), left=str(order.V), vec_ok=vec))
    walk.close(ind + "  ", lines)
    lines.append(f"{ind}}}")


def _tensor_walk(em, op, walk: ChunkWalk, t, offs: list[str], write: bool, what: str, ind: str, lines: list[str]):
    """Open a block and a chunk walk over the rows of tensor ``t`` at ``offs``: (the chunk's
    coordinates, the indent inside, (its storage type, row pointer, column, row length, whether
    vector accesses are aligned))."""
    st, base, dims = storage_ctype(t.type.dtype), buffer_param(t), t.type.shape
    vec = f"vec{em.fresh()}"
    i1 = ind + "  "
    lines += [f"{ind}{{  // {what}{marker(op.loc)}",
              f"{i1}const bool {vec} = {vec_ok(t, base, offs[-1], walk.order.V)};", f"{i1}(void){vec};"]

    def row_of(el, coords):
        g = [f"{o} + {c}" for o, c in zip(offs, coords)]
        return row_pointer(el, base, dims, g, st, write) if len(dims) > 1 else (base, g[-1], dims[-1])
    coords, i2, (row, col, ncols) = walk.open(Elements(em, op), i1, lines, row_of)
    return coords, i2, (st, row, col, ncols, vec)


def prefetch_lines(em, decode: list[str], ind: str) -> list[str]:
    """Before the task loop, per prefetched load: the registers the next task's chunks land in,
    ``fetch<id>(task)`` (the task's program ids, the load's offsets from them, its chunks), and
    the fetch of this group's first task; per load of the same tile every task, its registers,
    loaded once."""
    lines: list[str] = []
    for vid in sorted(em.plan.invariant):
        op = em.plan.held[vid].value.owner
        _fill_at_own_offsets(em, op, declare(em, op.result, ind, lines), ind, lines)
    for vid in sorted(em.plan.prefetch):
        h = em.plan.held[vid]
        op, v = h.value.owner, h.value
        st = storage_ctype(v.type.dtype)
        lines.append(f"{ind}tldsl::comm::Chunk<{st}, {h.order.V}> {held_name(v)}_next[{h.order.per_thread}];"
                     f"  // the next task's {'x'.join(map(str, v.type.shape))} {v.type.dtype}{marker(op.loc)}")
        lines.append(f"{ind}auto fetch{vid} = [&](const int task) {{")
        i1 = ind + "  "
        lines += [f"{i1}{ln.strip()}" for ln in decode]
        _fill_at_own_offsets(em, op, f"{held_name(v)}_next", i1, lines)
        lines.append(f"{ind}}};")
        lines.append(f"{ind}if ((int)blockIdx.x + grp * (int)gridDim.x < {em.num_tasks}) "
                     f"fetch{vid}((int)blockIdx.x + grp * (int)gridDim.x);")
    return lines


def _fill_at_own_offsets(em, op, name: str, ind: str, lines: list[str]) -> None:
    """``op`` 's chunks into ``name`` outside the task body: the index code of its offsets emitted
    here (from the program ids in scope), in a scope of its own."""
    with em.scope():
        em.emit_values(op.operands[1:], list(em.plan.part.body.ops), ind, lines)
        _fill_chunks(em, op, [em.name(o, op) for o in op.operands[1:]], name, ind, lines)


def held_element(em, op, element, ind: str, lines: list[str], barrier: str) -> None:
    """An element value into registers: each element computed in its chunk's thread
    (``element``: its op's element rule)."""
    order = em.plan.held[op.result.id].order
    name = declare(em, op.result, ind, lines)
    st = storage_ctype(op.result.type.dtype)
    walk = ChunkWalk(em, order)

    def body(coords, el):
        return [f"{name}[{walk.s}].set({walk.v}, {el.put(st, element(em, op, coords, el))});"]
    element_statement(em, op, order, body, ind, lines, f"{op.name} -> {name}, in registers", barrier, walk)


def element_statement(em, op, order: ChunkOrder, body, ind: str, lines: list[str], what: str, barrier: str,
                      walk: ChunkWalk | None = None) -> None:
    """A statement over a tile of ``order``'s shape, in chunk order: ``body(coords, elements)``
    gives the last lines for one element (as :meth:`.tile_ops.TileEmitter.element_loop` 's)."""
    walk = walk or ChunkWalk(em, order)
    lines.append(f"{ind}{{  // {what}, in chunk order{marker(op.loc)}")
    coords, i2, _ = walk.open(Elements(em, op), ind + "  ", lines)
    inner = Elements(em, op)
    walk.know_held(inner, coords)
    tail = body(walk.element_coords(coords), inner)
    lines += [f"{i2}#pragma unroll", f"{i2}for (int {walk.v} = 0; {walk.v} < {order.V}; ++{walk.v}) {{",
              *[f"{i2}  {ln}" for ln in inner.lines + tail], f"{i2}}}"]
    walk.close(ind + "  ", lines)
    lines += [f"{ind}}}", f"{ind}{barrier}"]


def held_store(em, op, t, offs: list[str], tile, order: ChunkOrder, ind: str, lines: list[str], barrier: str) -> None:
    """A store of a tile computed from held values: each thread stores its chunks (vectors where
    inside the tensor and aligned, element by element at its edges, nothing outside)."""
    walk = ChunkWalk(em, order)
    ch = f"ch{em.fresh()}"
    i1 = ind + "  "
    coords, i2, (st, row, col, ncols, vec) = _tensor_walk(em, op, walk, t, offs, True,
                                                          f"store -> {t.name}, chunks of {order.V} from registers",
                                                          ind, lines)
    inner = Elements(em, op)
    walk.know_held(inner, coords)
    x = em.value(tile, walk.element_coords(coords), inner)
    full = (1 << order.V) - 1
    lines += [f"{i2}tldsl::comm::Chunk<{st}, {order.V}> {ch} = {{}};",
              f"{i2}#pragma unroll", f"{i2}for (int {walk.v} = 0; {walk.v} < {order.V}; ++{walk.v}) {{",
              *[f"{i2}  {ln}" for ln in inner.lines],
              f"{i2}  {ch}.set({walk.v}, {inner.put(st, x)});", f"{i2}}}",
              f"{i2}" + primitives.tile_push_data(st, row, col, ncols, ch, f"{full}u", vec=str(order.V),
                                                  left=str(order.V), vec_ok=vec)]
    walk.close(i1, lines)
    lines += [f"{ind}}}", f"{ind}{barrier}"]


def chunk_partials(red, order: ChunkOrder, part: str, ind: str, lines: list[str], barrier: str) -> None:
    """The first step of a reduction of held values along the rows: each thread combines the
    ``V`` elements of each of its chunks and writes the result to ``part[chunk]`` (a row's
    ``K`` chunks in order, rows in the output's order)."""
    em, op = red.em, red.op
    walk = ChunkWalk(em, order)
    acc = f"acc{em.fresh()}"
    lines.append(f"{ind}{{  // {red.kind} over the rows' chunks (registers) -> {part}{marker(op.loc)}")
    coords, i2, _ = walk.open(Elements(em, op), ind + "  ", lines)
    first = Elements(em, op)
    # element 0 of the chunk starts the combination, then elements 1 .. V - 1 (unrolled)
    walk.know_held(first, coords, "0")
    v0 = em.value(red.x, walk.element_coords(coords, "0"), first)
    rest = Elements(em, op)
    walk.know_held(rest, coords)
    v = em.value(red.x, walk.element_coords(coords), rest)
    lines += [f"{i2}{red.ct} {acc};", f"{i2}{{", *[f"{i2}  {ln}" for ln in first.lines], f"{i2}  {acc} = {v0};",
              f"{i2}}}",
              f"{i2}#pragma unroll", f"{i2}for (int {walk.v} = 1; {walk.v} < {order.V}; ++{walk.v}) {{",
              *[f"{i2}  {ln}" for ln in rest.lines], f"{i2}  {acc} = {red.comb.format(acc, v)};", f"{i2}}}",
              f"{i2}{part}[{walk.c}] = {acc};"]
    walk.close(ind + "  ", lines)
    lines += [f"{ind}}}", f"{ind}{barrier}"]


def one_row_reduction(red, order: ChunkOrder, slot: str, warp_offset: int, identity: str, st: str, ind: str,
                      lines: list[str], barrier: str, every: str | None = None) -> None:
    """A reduction of a held tile of one row (:func:`..plan.general.one_row_held`): each thread
    combines the elements of all its chunks (starting from ``identity``), its warp's lanes combine
    theirs by shuffles, lane 0 writes the warp's result at ``warp_offset`` of the slot; after the
    group's barrier one thread combines the warps' results in warp order into the slot — or, with
    ``every`` (the register every thread holds the result in, :func:`..plan.general._replicated`),
    every thread does, in the same order, and nothing waits on a second barrier. No partial result
    a chunk in shared memory (a 256-thread task's row of 8192: 1024 of them)."""
    em, op = red.em, red.op
    k = em.fresh()
    acc, kl, part, q, off = f"acc{k}", f"kL{k}", f"part{k}", f"q{k}", f"s{k}"
    walk = ChunkWalk(em, order)
    if every is not None:
        lines.append(f"{ind}{st} {every};  // {red.kind} of the row, in every thread's registers{marker(op.loc)}")
    lines += [f"{ind}{{  // {red.kind} over the row in registers -> {every or slot}: threads, warps, then the group"
              f"{marker(op.loc)}",
              f"{ind}  constexpr int {kl} = TLDSL_REDUCE_LANES(32);",
              f"{ind}  {red.ct}* const {part} = reinterpret_cast<{red.ct}*>(reinterpret_cast<unsigned char*>({slot}) + "
              f"{warp_offset});",
              f"{ind}  {red.ct} {acc} = {identity};"]
    coords, i2, _ = walk.open(Elements(em, op), ind + "  ", lines)
    inner = Elements(em, op)
    walk.know_held(inner, coords)
    v = em.value(red.x, walk.element_coords(coords), inner)
    lines += [f"{i2}#pragma unroll", f"{i2}for (int {walk.v} = 0; {walk.v} < {order.V}; ++{walk.v}) {{",
              *[f"{i2}  {ln}" for ln in inner.lines], f"{i2}  {acc} = {red.comb.format(acc, v)};", f"{i2}}}"]
    walk.close(ind + "  ", lines)
    lines += red.shuffle(acc, off, kl, ind + "  ")
    lines += [f"{ind}  if (tid % {kl} == 0) {part}[tid / {kl}] = {acc};",
              f"{ind}  {barrier}"]
    if every is not None:
        lines += [f"{ind}  {acc} = {part}[0];",
                  f"{ind}  #pragma unroll 8",
                  f"{ind}  for (int {q} = 1; {q} < gthreads / {kl}; ++{q}) {acc} = {red.comb.format(acc, f'{part}[{q}]')};",
                  f"{ind}  {every} = tldsl::gen::put<{st}>({acc});",
                  f"{ind}}}", f"{ind}{barrier}"]
        return
    lines += [f"{ind}  if (tid == 0) {{",
              f"{ind}    for (int {q} = 1; {q} < gthreads / {kl}; ++{q}) {acc} = {red.comb.format(acc, f'{part}[{q}]')};",
              f"{ind}    {slot}[0] = tldsl::gen::put<{st}>({acc});",
              f"{ind}  }}",
              f"{ind}}}", f"{ind}{barrier}"]
