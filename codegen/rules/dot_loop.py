"""The C++ of a pipelined dot loop (planned by :mod:`..plan.dot_loop`, run by
``include/tldsl/general_pipeline.hpp``): the loop's loads as TMA (one thread, an mbarrier per
stage) or cp.async copies into a ring of stages issued ``DotLoop.lookahead`` iterations ahead,
its dots as WGMMAs on the stage with the accumulators in registers, the fragments' slots written
once after the loop."""
from __future__ import annotations

from ...ir import core
from ..abi import buffer_param, marker
from ..dtypes import ctype
from ..plan.dot_loop import DotLoop
from .scalars import c_literal

MMA_KIND = {"f16": "tldsl::gen::MmaKind::kF16", "bf16": "tldsl::gen::MmaKind::kBF16"}


def emit_dot_loop(em, lp: DotLoop, ind: str, lines: list[str], barrier: str) -> None:
    """Render ``lp`` where its ``for`` op stands (``em``: the general lowering's TileEmitter)."""
    loop = lp.loop
    lo, hi, st = (em.name(v, loop) for v in loop.operands)
    k = em.fresh()
    S, B = lp.stages, lp.stage_bytes
    ring, nit, wg, it = f"ring{k}", f"nit{k}", f"wg{k}", f"it{k}"
    accs = {d.op.result.id: f"acc{k}_{i}" for i, d in enumerate(lp.dots)}
    i1, i2, i3 = ind + "  ", ind + "    ", ind + "      "
    names = ", ".join(ld.op.operands[0].owner.name for ld in lp.loads)
    copies = "TMA" if lp.tma else "cp.async"
    L = [f"{ind}{{  // pipelined dot loop: {S} stages of {B} B ({names}) by {copies}, {len(lp.dots)} dot(s) on "
         f"WGMMA, accumulators in registers{marker(loop.loc)}",
         f"{i1}const int {nit}l = {lo}, {nit}h = {hi}, {nit}s = {st};",
         f"{i1}const int {nit} = ({nit}s > 0 && {nit}l < {nit}h) ? (int)(((long long){nit}h - {nit}l + {nit}s - 1) / {nit}s) : 0;",
         f"{i1}unsigned char* const {ring} = reinterpret_cast<unsigned char*>((reinterpret_cast<unsigned long long>("
         f"{em.ring(loop)}) + 1023ull) & ~1023ull);",
         f"{i1}const int {wg} = tid / 128;"]
    bars = f"bars{k}"
    if lp.tma:                      # an mbarrier per stage, after the stages
        L += [f"{i1}uint64_t* const {bars} = reinterpret_cast<uint64_t*>({ring} + {S * B});",
              f"{i1}tldsl::gen::stage_bars_init({bars}, {S}, tid);",
              f"{i1}tldsl::gen::fence_proxy_async_all();   // ordinary stores before, TMA from here on",
              f"{i1}{barrier}"]
    for d in lp.dots:
        M, N = d.op.result.type.shape
        acc = accs[d.op.result.id]
        L.append(f"{i1}tldsl::gen::DotAcc<{lp.mb}, {N}> {acc};")
        if d.fill is not None:
            L.append(f"{i1}tldsl::gen::for_each_acc({acc}, {wg}, [&](int, int, float& v) {{ v = "
                     f"{c_literal(float(d.fill))}; }});")
        else:
            slot = em.slot(d.frag)
            L.append(f"{i1}tldsl::gen::for_each_acc({acc}, {wg}, [&](int i, int j, float& v) {{ v = "
                     f"tldsl::gen::get({slot}[i * {N} + j]); }});")
    # the copies of iteration `it` into stage it % S (nothing past the last; always one group)
    L.append(f"{i1}auto issue{k} = [&](int {it}) {{")
    L.append(f"{i2}if ({it} < {nit}) {{")
    iv = loop.regions[0].args[0]
    body: list[str] = []
    with em.scope():
        em.bind(iv, f"({nit}l + {it} * {nit}s)")
        origins = [v for ld in lp.loads for v in ld.op.operands[1:]]
        em.emit_values(origins, loop.regions[0].ops, i3, body)
        L += body
        L.append(f"{i3}unsigned char* const s{k} = {ring} + ({it} % {S}) * {B};")
        if lp.tma:
            L.append(f"{i3}if (tid == 0) tldsl::gen::stage_bar_expect({bars} + {it} % {S}, {B});")
        for ld in lp.loads:
            buf = ld.op.operands[0].owner
            R, C = ld.op.result.type.shape
            nrows, ncols = buf.type.shape
            r0, c0 = (em.name(v, ld.op) for v in ld.op.operands[1:])
            base = buffer_param(buf)
            if lp.tma:
                L.append(f"{i3}tldsl::gen::tma_stage_tile<{ctype(buf.type.dtype).comm}, {R}, {C}>(&{ld.tma.param}, "
                         f"{bars} + {it} % {S}, s{k} + {ld.offset}, {base}, {nrows}, {ncols}, {r0}, {c0}, tid, "
                         f"gthreads);{marker(ld.op.loc)}")
                continue
            vec = "true" if ncols % 8 == 0 else "false"
            if vec == "true":
                vec = f"(reinterpret_cast<unsigned long long>({base}) & 15ull) == 0ull && (({c0}) % 8) == 0"
            L.append(f"{i3}tldsl::gen::stage_tile_sw128<{ctype(buf.type.dtype).comm}, {R}, {C}>(s{k} + {ld.offset}, "
                     f"{base}, {nrows}, {ncols}, {r0}, {c0}, {vec}, tid, gthreads);{marker(ld.op.loc)}")
    L.append(f"{i2}}}")
    if not lp.tma:
        L.append(f"{i2}tldsl::gen::cp_async_commit();")
    L.append(f"{i1}}};")
    ahead, inflight = lp.lookahead, lp.inflight
    L.append(f"{i1}#pragma unroll 1")
    L.append(f"{i1}for (int {it} = 0; {it} < {ahead}; ++{it}) issue{k}({it});")
    L.append(f"{i1}#pragma unroll 1")
    L.append(f"{i1}for (int {it} = 0; {it} < {nit}; ++{it}) {{")
    if lp.tma:
        L.append(f"{i2}tldsl::gen::stage_bar_wait({bars} + {it} % {S}, ({it} / {S}) & 1);   // this iteration's "
                 "copies have landed ...")
    else:
        L.append(f"{i2}tldsl::gen::cp_async_wait<{ahead - 1}>();   // this iteration's copies have landed ...")
        L.append(f"{i2}tldsl::gen::fence_view_async_shared();   // ... visible to the WGMMAs ...")
    L.append(f"{i2}{barrier}   // ... everyone's; and every WGMMA of {inflight + 1} iteration(s) ago is done")
    L.append(f"{i2}const unsigned char* const t{k} = {ring} + ({it} % {S}) * {B};")
    offs = {id(ld.op): ld.offset for ld in lp.loads}
    if lp.tma:                      # one thread's copies, before the WGMMAs take the accumulators
        L.append(f"{i2}issue{k}({it} + {ahead});   // into the stage of {inflight + 1} iteration(s) ago")
    for d in lp.dots:
        L.append(f"{i2}tldsl::gen::wgmma_fence_acc({accs[d.op.result.id]});")
    L.append(f"{i2}tldsl::gen::wgmma_begin();")
    for d in lp.dots:
        (M, K), N = d.op.operands[0].type.shape, d.op.operands[1].type.shape[1]
        kind = MMA_KIND[d.op.operands[0].type.dtype.name]
        b_major = ", true" if d.b_k_major else ""      # a right operand transposed: staged K-major
        L.append(f"{i2}tldsl::gen::wgmma_staged<{kind}, {M}, {N}, {K}, {lp.mb}{b_major}>(t{k} + {offs[id(d.a)]}, "
                 f"t{k} + {offs[id(d.b)]}, {accs[d.op.result.id]}, {wg});{marker(d.op.loc)}")
    L.append(f"{i2}tldsl::gen::wgmma_commit();")
    if not lp.tma:                  # every thread's copies, while the WGMMAs run
        L.append(f"{i2}issue{k}({it} + {ahead});   // into the stage of {inflight + 1} iteration(s) ago")
    L.append(f"{i2}tldsl::gen::wgmma_wait<{inflight}>();")
    for d in lp.dots:
        L.append(f"{i2}tldsl::gen::wgmma_fence_acc({accs[d.op.result.id]});")
    L.append(f"{i1}}}")
    L.append(f"{i1}tldsl::gen::wgmma_wait<0>();")
    L.append(f"{i1}tldsl::gen::cp_async_wait<0>();")
    for d in lp.dots:
        L.append(f"{i1}tldsl::gen::wgmma_fence_acc({accs[d.op.result.id]});")
    L.append(f"{i1}{barrier}   // the ring is read: the fragments' slots may share its memory")
    if lp.tma:
        L += [f"{i1}tldsl::gen::stage_bars_inval({bars}, {S}, tid);", f"{i1}{barrier}"]
    for d in lp.dots:
        L.append(f"{i1}tldsl::gen::store_acc({accs[d.op.result.id]}, {wg}, {em.slot(d.frag)});")
    L.append(f"{ind}}}")
    L.append(f"{ind}{barrier}")
    lines += L


def is_pipelined(plan, op: core.Op) -> bool:
    return op.name == "for" and id(op) in plan.dot_loops
