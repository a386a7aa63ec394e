"""What a generated program is: one compute stage alone, two parts linked by producer/consumer
signals on each rank, or a communication between W >= 2 ranks (peers read directly, an all-gather
on SMs or on the copy engine, an all-reduce) followed by a compute stage.

:func:`generate` draws one; the weights below set the distribution the fuzzer promises (of any
500 programs: >= 30% with a dot, >= 30% with a ``tl.range`` loop, >= 20% several parts linked by
signals, >= 20% communicating over W >= 2)."""
from __future__ import annotations

from dataclasses import replace

from . import program_stages as stages
from .program_gen import Chooser, ProgramGenerator, RandomChooser, cdiv, chance, weighted
from .program_stages import Tensor, Tiling
from .program_tree import (Assign, Call, FragRead, Fragment, Invoke, Load, Loop, Program, Pull, SignalDecl,
                           StaticMappingDecl, Store, Update)

FAMILIES = {"single": 40, "pipeline": 28, "comm": 32}
#: families drawn only when asked for by name (``--family``): programs of one recipe's shape, which
#: the default mix draws rarely (a row-gather combine: about 2 in 100); weighted like the others
#: where asked for beside them
FOCUSED = {"combine": 30, "grouped_gemm": 30, "attention": 30, "scatter": 30}


def generate(ch: Chooser, families=None) -> Program:
    """One program, of a family drawn by :data:`FAMILIES`' weights (only of ``families`` when given,
    which may also name :data:`FOCUSED` ones)."""
    known = {**FAMILIES, **FOCUSED}
    unknown = sorted(set(families or ()) - set(known))
    if unknown:
        raise ValueError(f"no program family {', '.join(map(repr, unknown))}: choose among {sorted(known)}")
    table = FAMILIES if families is None else {f: known[f] for f in families}
    if not table:
        raise ValueError(f"no family to generate from: choose among {sorted(known)}")
    g = ProgramGenerator(ch)
    family = weighted(ch, table)
    {"single": single, "pipeline": pipeline, "comm": communication, "combine": combine,
     "grouped_gemm": grouped_gemm, "attention": attention, "scatter": scatter}[family](g)
    g.compute = compute_schedule(g)
    if family == "pipeline":
        wait_back(g)
    return g.program()


def compute_schedule(g: ProgramGenerator) -> str | None:
    """The kernel's compute schedule, if any. The tile a part's recipe asked for (a grouped GEMM's),
    else, where the program's K loops of dots share one tile, a ``tl.ComputeSchedule`` of that tile
    (the GEMM recipe takes a part only at its schedule's tile, and the default tile matches no
    generated dot). Two programs in five also run their compute
    parts' tiles in a drawn order (the simulator's ``ComputeSchedule.tile_order``, which a lowered
    kernel must walk too where a part waits): another order, swizzle group or clusters. Drawn last,
    so a program's other choices are those it had before these draws existed."""
    ch = g.ch
    tile = g.recipe_tile or (g.dot_tiles[0] if len(set(g.dot_tiles)) == 1 else None)
    fields = [f"tile={tile}"] if tile else []
    if chance(ch, 40):
        order = ch.choice(("row_major", "swizzled", "comm_aligned"))
        fields.append(f'order="{order}"')
        if order != "row_major":
            fields.append(f"group_m={ch.choice((1, 2, 3, 8))}")
        if chance(ch, 25):
            fields.append("cluster=(2, 1)")
    return f"tl.ComputeSchedule({', '.join(fields)})" if fields else None


# -- one stage ---------------------------------------------------------------------------------

def single(g: ProgramGenerator) -> None:
    ch = g.ch
    g.world_size = weighted(ch, {1: 70, 2: 30})
    recipe = weighted(ch, {"ewise": 24, "gemm": 42, "row_reduce": 12, "softmax": 7, "gather": 15})
    dtype = "i32" if recipe in ("ewise", "row_reduce", "gather") and chance(ch, 30) else g.float_dtype()
    if recipe == "gemm":
        if dtype in ("f16", "bf16") and chance(ch, 30):     # the general path's pipelined K loop
            R, K = g.extent(64), g.extent(96)
            K = -(-K // 8) * 8 if chance(ch, 60) else K       # 16-byte rows: TMA stages
            a = Tensor(g.arg((R, K), dtype), (R, K), dtype)
            stages.gemm(g, a, mainloop=True)
            return
        BM = ch.choice((16, 32, 64))
        R, K = g.extent(BM), g.extent(24)
        a = Tensor(g.arg((R, K), dtype), (R, K), dtype)
        stages.gemm(g, a, tile=(BM, ch.choice((16, 32))))
        return
    if recipe == "gather" and dtype != "i32" and chance(ch, 50):   # (drawn here: other programs are unchanged)
        if chance(ch, 30):       # rows added into rows chosen at run time (tl.add_rows)
            R, C = g.extent(24), g.extent(24)
            stages.scatter(g, Tensor(g.arg((R, C), dtype), (R, C), dtype))
        else:
            stages.combine(g, dtype)
        return
    R, C = g.extent(24), g.extent(24)
    x = Tensor(g.arg((R, C), dtype), (R, C), dtype)
    if recipe == "ewise":
        reads = [x]
        if chance(ch, 40):
            dt = dtype if dtype == "i32" else g.float_dtype()
            reads.append(Tensor(g.arg((R, C), dt), (R, C), dt))
        stages.ewise(g, reads)
    elif recipe == "row_reduce":
        stages.row_reduce(g, x)
    elif recipe == "softmax":
        stages.softmax(g, x)
    else:
        stages.gather(g, x)


# -- two parts linked by producer/consumer signals --------------------------------------------

def combine(g: ProgramGenerator) -> None:
    """A row-gather combine (the combine recipe's shape, :func:`.program_stages.combine`): alone on
    an input, or as the consumer of a pipeline, gathering rows of the producer's workspace (f32,
    f16 or bf16) once every producer tile has notified."""
    ch = g.ch
    if chance(ch, 50):
        g.world_size = weighted(ch, {1: 70, 2: 30})
        stages.combine(g, g.float_dtype())
        return
    pipeline(g, consumer=lambda g, ws, waits: stages.combine(g, ws.dtype, ws, waits=waits))


def scatter(g: ProgramGenerator) -> None:
    """Rows added into rows chosen at run time (``tl.add_rows``, :func:`.program_stages.scatter`), on one
    rank or on each of two; or an expert GEMM adding its rows into them (:func:`.program_stages.grouped_gemm`
    with ``adds``: the MoE combine in the epilogue)."""
    ch = g.ch
    g.world_size = weighted(ch, {1: 80, 2: 20})
    if chance(ch, 40):
        stages.grouped_gemm(g, adds=True)
        return
    dtype = g.float_dtype()
    R, C = g.extent(24), g.extent(24)
    stages.scatter(g, Tensor(g.arg((R, C), dtype), (R, C), dtype))


def attention(g: ProgramGenerator) -> None:
    """A flash-attention part (the attention recipe's shape, :func:`.program_stages.attention`), on
    one rank or on each of two, its keys and values inputs or, staged, a producer's workspaces."""
    g.world_size = weighted(g.ch, {1: 80, 2: 20})
    stages.attention(g, staged=chance(g.ch, 40))


def grouped_gemm(g: ProgramGenerator) -> None:
    """A grouped GEMM over run-time tile tables (the grouped GEMM recipe's shape,
    :func:`.program_stages.grouped_gemm`): alone, or as the consumer of a pipeline whose producer
    writes its A (f16 or bf16) tile by tile, each row tile waiting for the producer's tiles over its rows."""
    ch = g.ch
    if chance(ch, 60):
        g.world_size = weighted(ch, {1: 80, 2: 20})
        stages.grouped_gemm(g)
        return
    pipeline(g, consumer=lambda g, ws, waits: stages.grouped_gemm(g, ws, waits=waits), ws_dtypes=("f16", "bf16"),
             column_multiple=8, rows=ch.integer(1, 320))       # up to three row tiles of 128, five of 64


def pipeline(g: ProgramGenerator, consumer=None, ws_dtypes=("f32", "f16", "bf16"), column_multiple=4,
             rows: int | None = None) -> None:
    """A producer part writes a workspace tile by tile and notifies; a consumer part waits for
    every producer tile its rows need, then reads the workspace (``consumer(g, ws, waits)`` when
    given, whose workspace is then floating point and has ``rows`` rows where given, else
    :func:`consume`)."""
    ch = g.ch
    g.world_size = weighted(ch, {1: 70, 2: 30})
    role = weighted(ch, {"compute": 60, "comm": 40})
    kind = weighted(ch, {"ewise": 50, "gemm": 35, "softmax": 15})
    R = g.extent(24) if rows is None else rows
    ws_dtype = ch.choice(ws_dtypes)
    sig = g.fresh("ready")
    link: dict = {}

    def columns(n: int) -> int:
        """The workspace's columns: for a consumer given, mostly a multiple of ``column_multiple``
        (a combine's vector accesses, a grouped GEMM's 16-byte TMA rows)."""
        m = column_multiple
        return -(-n // m) * m if consumer is not None and chance(ch, 80) else n

    def notify(stmts, tiling: Tiling):
        link["tiles"] = not tiling.col_loop and tiling.gn > 1 and chance(ch, 50)
        channel = f"pm * {tiling.gn} + pn" if link["tiles"] else "pm"
        stmts.append(Call("producer_tile_notify", (sig, channel)))

    if kind == "gemm":
        BM = ch.choice((16, 32))
        K, N, a_dtype = g.extent(24), columns(g.extent(24)), g.float_dtype()
        a = Tensor(g.arg((R, K), a_dtype), (R, K), a_dtype)
        ws = Tensor(g.workspace((R, N), ws_dtype), (R, N), ws_dtype, exact=False)
        _, tiling = stages.gemm(g, a, ws, role=role,
                                tile=(BM, ch.choice((16, 32))), notify=notify)
    else:
        C, x_dtype = columns(g.extent(24)), g.float_dtype()
        if kind == "ewise" and consumer is None and chance(ch, 25):          # integers all the way
            x_dtype = ws_dtype = "i32"
        src = Tensor(g.arg((R, C), x_dtype), (R, C), x_dtype)
        ws = Tensor(g.workspace((R, C), ws_dtype), (R, C), ws_dtype, exact=ws_dtype == "i32")
        if kind == "ewise":
            g.keep_int = ws_dtype == "i32"
            _, tiling = stages.ewise(g, [src], ws, role=role, notify=notify)
            g.keep_int = False
        else:
            _, tiling = stages.softmax(g, src, ws, role=role, notify=notify)
    per_slot = tiling.notifies_per_row_block
    slots = tiling.gm * tiling.gn if link["tiles"] else tiling.gm
    g.decls.append(SignalDecl(sig, slots))

    def waits(stmts, r0, rows, cols=None):
        if link["tiles"]:
            inner = Loop("j", "0", str(tiling.gn), "1", (Call("consumer_tile_wait", (sig, f"q * {tiling.gn} + j")),),
                         static=chance(ch, 50))
        elif tiling.each_column and cols is not None:
            # the producer's column tiles up to this task's last column: a rising count, one launch's share
            count = f"tl.cdiv(tl.minimum({cols}, {tiling.gn * tiling.BN}), {tiling.BN})"
            inner = Call("consumer_tile_wait", (sig, "q", f"count={count}", f"per_launch={per_slot}"))
        else:
            inner = Call("consumer_tile_wait", (sig, "q") + ((f"count={per_slot}",) if per_slot > 1 else ()))
        stmts.append(Loop("q", f"{r0} // {tiling.BM}", f"tl.cdiv(tl.minimum({r0} + {rows}, {R}), {tiling.BM})", "1",
                          (inner,)))

    producer = g.parts[-1].name
    (consumer or consume)(g, ws, waits)
    g.pipeline = (producer, g.parts[-1].name)


def wait_back(g: ProgramGenerator) -> None:
    """One pipeline in five whose tiles run in row-major order: the producer's task, after its
    notifies, also waits until the consumer has finished every task whose rows lie before its own
    row block (the consumer notifies once a task, at its end). The two parts then wait on each
    other, so the simulator also checks each on one slot, tiles in order, as a GPU giving it fewer
    CTAs than tiles runs it, and the GPU runs them side by side. Drawn after everything else (the
    programs without it are those generated before it existed)."""
    ch = g.ch
    if "order=" in (g.compute or "") or not chance(ch, 20):
        return
    producer, consumer = g.pipeline
    parts = {p.name: i for i, p in enumerate(g.parts)}
    prod, cons = g.parts[parts[producer]], g.parts[parts[consumer]]
    BMp, BMc = g.row_tiles[producer], g.row_tiles[consumer]
    per_row = cons.grid[1] if len(cons.grid) == 2 else 1
    sig = g.fresh("consumed")
    g.decls.append(SignalDecl(sig, 1))
    done = f"pm * {BMp} // {BMc} * {per_row}"          # consumer tasks whose rows end by this row block
    wait = Call("consumer_tile_wait", (sig, "0", f"count={done}", f"per_launch={cons.grid[0] * per_row}"))
    g.parts[parts[producer]] = replace(prod, body=prod.body + (Loop("b0", "0", f"tl.minimum({done}, 1)", "1",
                                                                    (wait,)),))
    g.parts[parts[consumer]] = replace(cons, body=cons.body + (Call("producer_tile_notify", (sig, "0")),))


def consume(g: ProgramGenerator, src: Tensor, waits) -> None:
    """The consumer stage: elementwise, a GEMM with ``src`` as A, a row reduction or a softmax."""
    ch = g.ch
    kinds = {"ewise": 35, "gemm": 40, "row_reduce": 15, "softmax": 10}
    if src.dtype == "i32":                  # a dot and a softmax take floats
        kinds = {"ewise": 60, "row_reduce": 40}
    kind = weighted(ch, kinds)
    if kind == "softmax" and src.shape[1] > 64:
        kind = "ewise"
    if kind == "ewise":
        stages.ewise(g, [src], waits=waits)
    elif kind == "gemm":
        stages.gemm(g, src, waits=waits, tile=(ch.choice((16, 32)), ch.choice((16, 32))))
    elif kind == "row_reduce":
        stages.row_reduce(g, src, waits=waits)
    else:
        stages.softmax(g, src, waits=waits)


# -- communication over W >= 2 ranks --------------------------------------------------------

def communication(g: ProgramGenerator) -> None:
    ch = g.ch
    g.world_size = weighted(ch, {2: 50, 3: 25, 4: 25})
    kind = weighted(ch, {"peer_read": 12, "sm_pull": 15, "sm_push": 15, "copy_engine": 15, "all_reduce": 15,
                         "library_all_gather": 14, "library_reduce_scatter": 14})
    if kind == "peer_read":
        peer_read(g)
    elif kind == "all_reduce":
        all_reduce(g)
    elif kind == "library_all_gather":
        library_all_gather(g)
    elif kind == "library_reduce_scatter":
        library_reduce_scatter(g)
    else:
        all_gather(g, kind)


def peer_read(g: ProgramGenerator) -> None:
    """A compute part reads peers' symmetric inputs directly (nothing writes them: no signal)."""
    ch = g.ch
    W = g.world_size
    R, C = g.extent(24), g.extent(24)
    dtype = g.float_dtype()
    x = g.arg((R, C), dtype, symmetric=True)
    BM, BN = g.tile(), g.tile()
    stmts: list = [Assign("r0", f"pm * {BM}"), Assign("c0", f"pn * {BN}")]
    if chance(ch, 50):           # every rank's tile, summed
        stmts.append(Fragment("acc", (BM, BN), "f32"))
        body: list = []
        t = g.bind(body, Load(shape=(BM, BN), dtype=dtype, exact=True, tensor=x, offsets=("r0", "c0"), box=(BM, BN),
                              peer=f"(tl.rank() + s) % {W}"))
        body.append(Update("acc", g.tree([t], ch.integer(0, 1))))
        stmts.append(Loop("s", "0", str(W), "1", tuple(body), static=chance(ch, 50)))
        value = FragRead(shape=(BM, BN), dtype="f32", bound=float(W) * 8, name="acc")
    else:                        # the next rank's tile
        peer = f"(tl.rank() + 1) % {W}"
        if chance(ch, 50):
            leaf = Pull(shape=(BM, BN), dtype=dtype, exact=True, tensor=x, offsets=("r0", "c0"), peer=peer)
        else:
            leaf = Load(shape=(BM, BN), dtype=dtype, exact=True, tensor=x, offsets=("r0", "c0"), box=(BM, BN),
                        peer=peer)
        value = g.tree([g.bind(stmts, leaf)], ch.integer(1, 2))
    out = stages.output(g, (R, C), value, None)
    g.store(stmts, out.name, ("r0", "c0"), stages.fit(value, (BM, BN), out.dtype))
    g.part("compute", (cdiv(R, BM), cdiv(C, BN)), ("pm", "pn"), stmts)


def all_gather(g: ProgramGenerator, engine: str) -> None:
    """Every rank's symmetric shard [Ms, C] gathered into [W * slot, C] (slot = Ms, or Ms padded
    to whole tiles where tiles are stored whole), T rows at a time on SMs (pull or push, copy or
    tile form) or a shard at a time on the copy engine; then a compute stage on it."""
    ch = g.ch
    W = g.world_size
    Ms, C = g.extent(16), g.extent(24)
    dtype = g.float_dtype()
    x = g.arg((Ms, C), dtype, symmetric=True)
    T = g.tile()
    tpr = cdiv(Ms, T)
    if engine == "copy_engine":
        pull = chance(ch, 50)
        slot = Ms
        gathered = g.workspace((W * Ms, C), dtype, symmetric=not pull)
        sig = g.signal(W, "symmetric")
        body = [Assign("me", "tl.rank()"), Assign("peer", f"(me + step) % {W}")]
        if pull:
            body += [Call("rank_copy_data", (gathered, f"(peer * {Ms}, 0)", f"{x}.at(peer)", "(0, 0)", f"({Ms}, {C})")),
                     Call("rank_notify", (sig, "peer"))]
        else:
            body += [Call("rank_copy_data", (f"{gathered}.at(peer)", f"(me * {Ms}, 0)", x, "(0, 0)", f"({Ms}, {C})")),
                     Call("rank_notify", (sig, "me", "peer"))]
        g.part("comm", (W,), ("step",), body, engine="copy_engine")

        waits = mapping_waits(g, gathered, Ms, None, sig, "rank_wait", W * Ms) if chance(ch, 40) else None

        def loop_waits(stmts, r0, rows, cols=None):
            stmts.append(Loop("q", f"{r0} // {Ms}", f"tl.cdiv(tl.minimum({r0} + {rows}, {W * Ms}), {Ms})", "1",
                              (Call("rank_wait", (sig, "q")),)))
        consume(g, Tensor(gathered, (W * Ms, C), dtype), waits or loop_waits)
        return

    tile_form = chance(ch, 45)
    slot = tpr * T if tile_form else Ms
    push = engine == "sm_push"
    gathered = g.workspace((W * slot, C), dtype, symmetric=push)
    sig = g.signal(W * tpr, "symmetric" if push else "local")
    body: list = [Assign("me", "tl.rank()"), Assign("peer", f"(me + step) % {W}"), Assign("r0", f"j * {T}")]
    exact = True                    # the gathered rows are copies of inputs (not where tiles are computed)
    if push:
        if tile_form:
            t = g.bind(body, Load(shape=(T, C), dtype=dtype, exact=True, tensor=x, offsets=("r0", "0"), box=(T, C)))
            value = stages.normalised(g.tree([t], ch.integer(0, 2)))
            exact = value.exact
            if chance(ch, 50):
                body.append(Store(gathered, (f"me * {slot} + r0", "0"), value, peer="peer"))
            else:
                body.append(Call("tile_push_data", (f"{gathered}.at(peer)", f"(me * {slot} + r0, 0)", value.src())))
        else:
            body.append(Call("tile_push_data", (f"{gathered}.at(peer)", f"(me * {slot} + r0, 0)", x, "(r0, 0)",
                                                f"({T}, {C})")))
        body.append(Call("peer_tile_notify", (sig, f"me * {tpr} + j", "peer")))
        wait = "peer_tile_wait"
    else:
        if tile_form:
            t = g.bind(body, Pull(shape=(T, C), dtype=dtype, exact=True, tensor=x, offsets=("r0", "0"), peer="peer"))
            value = stages.normalised(g.tree([t], ch.integer(0, 2)))
            exact = value.exact
            body.append(Store(gathered, (f"peer * {slot} + r0", "0"), value))
        else:
            body.append(Call("tile_pull_data", (f"{x}.at(peer)", "(r0, 0)", f"({T}, {C})", gathered,
                                                f"(peer * {slot} + r0, 0)")))
        body.append(Call("producer_tile_notify", (sig, f"peer * {tpr} + j")))
        wait = "consumer_tile_wait"
    g.part("comm", (W, tpr), ("step", "j"), body)

    mapped = mapping_waits(g, gathered, slot, T, sig, wait, W * slot) if chance(ch, 40) else None

    def waits(stmts, r0, rows, cols=None):
        inner = Loop("j", f"tl.maximum({r0} - q * {slot}, 0) // {T}",
                     f"tl.cdiv(tl.minimum({r0} + {rows} - q * {slot}, {slot}), {T})", "1",
                     (Call(wait, (sig, f"q * {tpr} + j")),))
        stmts.append(Loop("q", f"{r0} // {slot}", f"tl.cdiv(tl.minimum({r0} + {rows}, {W * slot}), {slot})", "1",
                          (inner,)))
    consume(g, Tensor(gathered, (W * slot, C), dtype, exact), mapped or waits)


def mapping_waits(g: ProgramGenerator, tensor: str, rows: int, tile: int | None, sig: str, wait: str, total: int):
    """The waits written with a ``tl.StaticMapping`` of ``tensor`` (its ``wait_rows``) instead of loops."""
    name = g.fresh("rows")
    g.decls.append(StaticMappingDecl(name, tensor, rows, tile))

    def waits(stmts, r0, n, cols=None):
        stmts.append(Invoke(f"{name}.wait_rows", (sig, r0, f"tl.minimum({r0} + {n}, {total})", f"wait=tl.{wait}")))
    return waits


def all_reduce(g: ProgramGenerator) -> None:
    """Each rank computes a partial tile and pushes it into every rank's slot for it (padded to
    whole tiles), notifying; each rank then waits for all W and sums the slots in rank order."""
    ch = g.ch
    W = g.world_size
    R, C = g.extent(24), g.extent(24)
    dtype = g.float_dtype()
    x = g.arg((R, C), dtype)
    BM, BN = g.tile(), g.tile()
    gm, gn = cdiv(R, BM), cdiv(C, BN)
    slot = gm * BM
    recv_dtype = ch.choice(("f32", "f16", "bf16"))
    recv = g.workspace((W * slot, C), recv_dtype, symmetric=True)
    sig = g.signal(gm * gn, "symmetric")
    stmts: list = [Assign("r0", f"pm * {BM}"), Assign("c0", f"pn * {BN}")]
    leaves = g.tile_leaves(stmts, {x: ((R, C), dtype, True)}, "r0", "c0", BM, BN, dtype)
    partial = g.bind(stmts, stages.fit(stages.normalised(g.tree(leaves, ch.integer(1, 2))), (BM, BN), recv_dtype), "p")
    send: list = [Assign("dest", f"(tl.rank() + s) % {W}")]
    if chance(ch, 50):
        send.append(Store(recv, (f"tl.rank() * {slot} + r0", "c0"), partial, peer="dest"))
    else:
        send.append(Call("tile_push_data", (f"{recv}.at(dest)", f"(tl.rank() * {slot} + r0, c0)", partial.name)))
    send.append(Call("peer_tile_notify", (sig, f"pm * {gn} + pn", "dest")))
    stmts.append(Loop("s", "0", str(W), "1", tuple(send), static=chance(ch, 50)))
    g.part("compute", (gm, gn), ("pm", "pn"), stmts)

    total: list = [Assign("r0", f"pm * {BM}"), Assign("c0", f"pn * {BN}"),
                   Call("peer_tile_wait", (sig, f"pm * {gn} + pn", f"count={W}"))]
    total.append(Fragment("acc", (BM, BN), "f32"))
    add = (Update("acc", Load(shape=(BM, BN), dtype=recv_dtype, tensor=recv, offsets=(f"q * {slot} + r0", "c0"),
                              box=(BM, BN))),)
    total.append(Loop("q", "0", str(W), "1", add, static=chance(ch, 50)))
    value = FragRead(shape=(BM, BN), dtype="f32", bound=float(W), name="acc")
    if chance(ch, 40):
        value = g.tree([value], 1)
    out = stages.output(g, (R, C), value, None)
    g.store(total, out.name, ("r0", "c0"), stages.fit(value, (BM, BN), out.dtype))
    g.part(weighted(ch, {"compute": 50, "comm": 50}), (gm, gn), ("pm", "pn"), total)



def generate_distinct(n: int, seed: int, max_attempts: int | None = None,
                      families=None) -> list[tuple[int, Program]]:
    """``n`` programs, no two with the same source: (attempt, program) pairs, where program
    ``attempt`` of ``seed`` is ``generate(RandomChooser(f"{seed}:{attempt}"), families)`` (so one
    can be made again alone)."""
    seen: set[str] = set()
    out: list[tuple[int, Program]] = []
    attempt = 0
    limit = max_attempts if max_attempts is not None else 4 * n + 100
    while len(out) < n and attempt < limit:
        program = generate(RandomChooser(f"{seed}:{attempt}"), families)
        text = program.source()
        if text not in seen:
            seen.add(text)
            out.append((attempt, program))
        attempt += 1
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} distinct programs in {attempt} attempts")
    return out


# -- the library's collectives (tldsl.collectives), under a drawn communication schedule ---------

def comm_schedule(g: ProgramGenerator, copy_engine_modes=("pull", "push"), tiles=(None, 8, 16)) -> str:
    ch = g.ch
    order = ch.choice(("ring", "full_mesh"))
    if chance(ch, 30):
        mode = ch.choice(copy_engine_modes)
        tile_m = ch.choice(tiles) if mode == "push" and copy_engine_modes == ("push",) else None
        return f'tl.CommSchedule(tile_m={tile_m}, order="{order}", mode="{mode}", engine="copy_engine")'
    return (f'tl.CommSchedule(tile_m={ch.choice(tiles)}, order="{order}", mode="{ch.choice(("pull", "push"))}", '
            f'engine="sm", sms={ch.integer(1, 2)})')


def library_all_gather(g: ProgramGenerator) -> None:
    """``collectives.all_gather`` of a symmetric shard; a compute stage waits with its ``wait_rows``."""
    W = g.world_size
    Ms, C = g.extent(16), g.extent(24)
    dtype = g.float_dtype()
    x = g.arg((Ms, C), dtype, symmetric=True)
    gathered = g.workspace((W * Ms, C), dtype, symmetric=True)
    g.comm = comm_schedule(g)
    ag = g.fresh("ag")
    g.decls.append(Assign(ag, f"collectives.all_gather({x}, {gathered}, comm)"))

    def waits(stmts, r0, rows, cols=None):
        stmts.append(Invoke(f"{ag}.wait_rows", (r0, f"tl.minimum({r0} + {rows}, {W * Ms})")))
    consume(g, Tensor(gathered, (W * Ms, C), dtype), waits)


def library_reduce_scatter(g: ProgramGenerator) -> None:
    """A producer stage writes every rank's partial [W * Ms, C] and hands rows over with
    ``notify_rows``; ``collectives.reduce_scatter`` sums them into each rank's [Ms, C]."""
    ch = g.ch
    W = g.world_size
    Ms, C = g.extent(12), g.extent(24)
    M = W * Ms
    partial_dtype = ch.choice(("f32", "f16", "bf16"))
    partial = Tensor(g.workspace((M, C), partial_dtype), (M, C), partial_dtype, exact=False)
    out = g.arg((Ms, C), g.float_dtype(), "output")
    g.comm = comm_schedule(g, copy_engine_modes=("push",))
    rs = g.fresh("rs")

    def notify(stmts, tiling: Tiling):
        stmts.append(Invoke(f"{rs}.notify_rows", ("r0", f"tl.minimum(r0 + {tiling.BM}, {M})")))

    if chance(ch, 50):
        K, a_dtype = g.extent(24), g.float_dtype()
        a = Tensor(g.arg((M, K), a_dtype), (M, K), a_dtype)
        _, tiling = stages.gemm(g, a, partial, tile=(ch.choice((16, 32)), ch.choice((16, 32))), notify=notify)
    else:
        x_dtype = g.float_dtype()
        _, tiling = stages.ewise(g, [Tensor(g.arg((M, C), x_dtype), (M, C), x_dtype)], partial, notify=notify)
    g.decls.append(Assign(rs, f"collectives.reduce_scatter({partial.name}, {out}, comm, producer_rows={tiling.BM}, "
                              f"producers_per_row={tiling.notifies_per_row_block})"))
