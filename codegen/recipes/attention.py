"""The flash-attention recipe: the compute part of a flash-attention tile program
(:mod:`tldsl.ops.sp_attention`; the shape it must have: :mod:`..match.attention`) as a Hopper
(sm_90a) kernel: TMA + WGMMA, warp-specialized, online softmax in registers.

Design:

* **Rows of a shard as a 3-D TMA box.** ``load_rows`` with ``where(j + KB < L, j + R0, -1)``
  reads rows ``KB .. KB+BN-1`` of shard ``(R0 - KB) / L``, rows past the shard end as zero. A
  3-D tensor map over the gathered tensor viewed as ``[N / L, L, width]`` gives exactly that:
  box ``(E, BN, 1)`` at ``(col, KB, shard)``; TMA zero-fills what lies past ``L`` and never
  reads it, so no read crosses into rows the tile program did not wait for.
* **Head groups and layouts are control code.** GQA's key/value head (``h // group``) is a
  column the control code computes; the chunks of a zig-zag layout are shards of ``L = Sl/2``
  rows of the 3-D view; a causal query block whose rows come from two runs of positions
  (``tl.where(i < SPLIT, i + Y, i + Y1)``: it straddles a rank's two zig-zag chunks) hands the
  kernel an ``attn::SplitKeyBlock`` (``SPLIT`` and ``Y1`` besides the ``KeyBlock``), which
  shifts the causal limit of the rows past the split; one run keeps the plain ``KeyBlock``
  and the kernel of before.
* **Generated control code, fixed math.** The scalar part of the tile program — the loop nest
  over key blocks, its bounds (causal skipping), the waits and every coordinate — is emitted
  as C++ (``Prog::run``), run by the producer (with the waits: acquire loads, then
  ``fence.proxy.async.global`` before the TMA loads) and by the consumers (without). The tile
  math must match the pattern op by op; anything else is a :class:`LoweringError` at the
  user's line. The C++ template is ``include/tldsl/sm90_attention.hpp``.
* **Pipeline**: a producer warp (TMA, the waits) and one consumer warpgroup per 64 query rows;
  K and V of a block share one of ``stages`` shared-memory stages (separate full barriers, so
  S = Q K^T starts before V lands). With ``overlap`` (default with >= 2 stages) block j issues
  S_j and then P_{j-1} V_{j-1}, so that P V runs on the tensor cores during block j's softmax;
  the first block of a tile issues a P V with P = 0 on its own V stage, which keeps every
  WGMMA out of data-dependent branches (ptxas serialises WGMMAs otherwise). Masks are selects.
* **Folded scale, mask-free blocks** (``softmax``): with ``"fold"`` exponentials are
  ``2^(s c - m)`` with ``c = scale log2 e``: one FFMA + EX2 per score, the row max taken over
  the raw scores and scaled once (``"plain"``: FMUL, FADD and EX2 per score, the kernel of
  before). ``"split"`` (the default) also gives a key block that masks no key of a consumer
  warpgroup's 64 rows (inside the shard, wholly below the causal diagonal) a second
  instantiation of the block body without the mask selects; the branch between the two bodies
  is warpgroup-uniform and no WGMMA is in flight across it (each body issues and retires the
  same WGMMA sequence). Its two bodies push ptxas over the 168 registers of a 384-thread block:
  a few tile-level values spill (stored once per tile, reloaded for the epilogue). On the H200
  (BENCHMARKS.md, sixteenth session) split ran 1.23-1.25x faster than fold non-causal and
  1.12-1.15x causal at S 8192, W 2.
* **Simplified against a production FA3-class kernel**: no thread-block clusters / TMA
  multicast of K and V; no ping-pong ordering of the two consumer warpgroups (their softmax
  and WGMMAs interleave only as the warp schedulers find them); K and V share a stage and are
  released together; O is
  staged through the Q buffer, so a persistent CTA's next tile (its Q, then its K/V) waits for
  the previous tile's store; no FP8; D <= 128, BM <= 128.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ...ir import core
from ...ir.opdefs import WAIT_OPS
from ..abi import KernelParam, LoweredKernel, TmaDescriptorSpec, kernel_entry, marker, signal_param, table_param
from ..dtypes import c_type, ctype
from ..errors import fail
from ..ir_queries import CONTROL_OPS, only_part
from ..match.attention import LOG2E, WHAT, AttentionMatch, describe as describe_op, match_attention
from ..plan.attention import AttentionConfig, AttentionPlan, ControlCode, plan_attention
from ..plan.tile_order import order_group_m
from ..plan.wgmma import ORDERS
from ..rules.sync import SignalEmitter
from .recipe import Recipe


@dataclass(frozen=True)
class LoweredAttention(LoweredKernel):
    """A generated kernel: CUDA source, entry point, launch shape and host-side descriptions."""
    kernel_name: str                 # the IR kernel
    part: str                        # the compute part
    entry: str                       # extern "C" symbol
    source: str                      # one self-contained CUDA C++ translation unit
    control_source: str              # the generated control code alone (struct Prog; plain C++)
    config: AttentionConfig
    params: tuple[KernelParam, ...]
    tma: tuple[TmaDescriptorSpec, ...]
    buffers: dict                    # IR buffer name -> (shape, dtype name) of every tensor the kernel reads/writes
    shard_rows: int                  # L: rows per shard of the gathered K / V
    world_size: int
    align_shift: int
    waits: int                       # wait ops in the tile program (compiled into the producer)
    signals: tuple[str, ...]         # signals the waits read (kernel params "sig_<name>")
    tables: tuple[str, ...]          # int tables the control code reads (kernel params "tbl_<name>")
    options: tuple[str, ...] = ()    # extra NVRTC options (defines)
    notes: tuple[str, ...] = field(default=())

    @property
    def grid_tiles(self) -> tuple[int, int]:
        return self.config.grid

    @property
    def num_tiles(self) -> int:
        return self.config.num_tiles

    def describe(self) -> str:
        c = self.config
        lines = [f"{self.entry}: {self.kernel_name}.{self.part}  flash attention {c.in_dtype}->{c.out_dtype}"
                 f"{' causal' if c.causal else ''}, scale {c.scale:.6g}",
                 f"  tile BM={c.BM} BN={c.BN} D={c.D}, {c.stages} stages, order {c.order}, "
                 f"{c.consumer_wgs} consumer warpgroup(s) + 1 producer ({c.threads} threads), "
                 f"{c.acc_per_thread} fp32 acc/thread, smem {c.smem_bytes} B, overlap={c.overlap}, "
                 f"softmax {c.softmax}",
                 f"  tiles {c.grid[0]}x{c.grid[1]} = {c.num_tiles}, persistent; key shards of {self.shard_rows} rows; "
                 f"{self.waits} wait(s) on {list(self.signals) or 'no signals'}",
                 "  params: " + ", ".join(f"{p.ctype} {p.name}" for p in self.params)]
        lines += self.describe_tma()
        return "\n".join(lines)


# -- the control code --------------------------------------------------------------------------

class _Control(SignalEmitter):
    """C++ for ``Prog::run`` (what it runs: the plan's :class:`ControlCode`): the tile program's
    scalar code, loops and waits around the key blocks, calling ``on_tile`` once and
    ``on_block`` for each key block. Waits (and the loops that hold only waits) are wrapped in
    ``if constexpr (kWaits)``: the producer runs them, the consumers only walk the blocks."""

    def __init__(self, kernel: core.Kernel, m: AttentionMatch, control: ControlCode):
        self.m, self.control = m, control
        super().__init__(kernel, m.part.body.ops, WHAT, control.needed)
        self._in_waits = False
        self._block_text: str | None = None

    # hooks ------------------------------------------------------------------------------------
    def emit_op(self, op: core.Op, ind: str, lines: list[str]) -> None:
        if (op.name in WAIT_OPS or (op.name in CONTROL_OPS and op not in self.m.chain)) and not self._in_waits:
            lines.append(f"{ind}if constexpr (kWaits) {{")
            self._in_waits = True
            try:
                super().emit_op(op, ind + "  ", lines)
            finally:
                self._in_waits = False
            lines.append(f"{ind}}}")
        elif op in self.m.chain:
            if op.name == "for":                     # one key block per iteration: never unrolled
                lines.append(f"{ind}#pragma unroll 1")
            super().emit_op(op, ind, lines)
            if op is self.m.chain[-1]:               # the loop / condition whose body is one key block
                if self._block_text is None:
                    raise self.fail("internal: the key-block call was not emitted", op)
                lines.insert(len(lines) - 1, f"{ind}  {self._block_text}")
                self._block_text = None
        else:
            super().emit_op(op, ind, lines)

    def leave_region(self, block: core.Block, ind: str, lines: list[str]) -> None:
        if block is self.m.block:                    # the block's values are still in scope here
            self._block_text = self._block_call()

    def emit_other(self, op: core.Op, ind: str, lines: list[str]) -> None:
        if op.name not in WAIT_OPS:
            raise self.fail(f"{describe_op(op)} is not supported here", op)
        lines.append(ind + self.wait_statement(op))

    # emission ------------------------------------------------------------------------------------
    def emit_run(self, ind: str = "    ") -> list[str]:
        m = self.m
        lines: list[str] = []
        for op in self.control.prologue:             # index code, then the waits before the key blocks
            self.emit_op(op, ind, lines)
        q_row, q_col = (self.name(v, m.q_load) for v in m.q_load.operands[1:3])
        o_row, o_col = (self.name(v, m.store) for v in m.store.operands[1:3])
        lines.append(f"{ind}on_tile(tldsl::attn::TileInfo{{{q_row}, {q_col}, {o_row}, {o_col}}});"
                     f"{marker(m.q_load.loc)}")
        self.emit_op(m.chain[0], ind, lines)
        return lines

    def _block_call(self) -> str:
        m = self.m
        kb = self.name(m.kb, m.k_load)
        terms = []
        for k, c in m.shard_terms.items():           # (R0 - KB) / L, term by term
            c //= m.cond_bound
            if k == "":
                terms.append(str(c))
                continue
            # a leaf is a value, or "pid<axis>" (match.affine's name of a program id)
            nm = self.pid_expr(int(k[3:]), m.k_load) if isinstance(k, str) else self.name(k, m.k_load)
            terms.append(nm if c == 1 else f"{c} * {nm}")
        shard = " + ".join(terms) if terms else "0"
        k_col, v_col = self.name(m.k_load.operands[2], m.k_load), self.name(m.v_load.operands[2], m.v_load)
        key0 = self.name(m.key_base, m.k_load) if m.causal else "0"
        q0 = self.name(m.q_base, m.k_load) if m.causal else "0"
        block = f"KeyBlock{{{k_col}, {v_col}, {kb}, {shard}, {m.cond_bound} - {kb}, {key0}, {q0}}}"
        if m.causal and m.q_split is not None:   # query rows from two runs of positions (zig-zag)
            block = (f"SplitKeyBlock{{{block[8:]}, {self.name(m.q_split, m.k_load)}, "
                     f"{self.name(m.q_base1, m.k_load)}}}")
        return f"on_block(tldsl::attn::{block});{marker(m.k_load.loc)}"


def _control_source(control: ControlCode, run_lines: list[str]) -> str:
    members = ["  int rank;", "  unsigned long long launch;"]
    members += [f"  const unsigned long long* {signal_param(s)};" for s in control.signals]
    members += [f"  const int* {table_param(t)};" for t in control.tables]
    L = ["// The tile program's control code: coordinates, the loop nest over key blocks and its waits.",
         "// run<true> (the producer) also waits; run<false> (the consumers) only walks the blocks.",
         "struct Prog {",
         f"  static constexpr bool kHasWaits = {'true' if control.waits else 'false'};",
         *members,
         "  template <bool kWaits, class OnTile, class OnBlock>",
         "  TLDSL_CONTROL void run(int pid0, int pid1, OnTile&& on_tile, OnBlock&& on_block) const {",
         "    (void)pid0; (void)pid1;",
         *run_lines,
         "  }",
         "};"]
    return "\n".join(L) + "\n"


# -- the translation unit ------------------------------------------------------------------------

def _c_float(x: float) -> str:
    """A float constant as an exact C++ literal (the float32 value, in hex)."""
    return f"{float(np.float32(x)).hex()}f" if x != 0 else "0.0f"


def _emit_source(plan: AttentionPlan, control: str) -> str:
    kernel, part, m, cfg, entry, params = plan.kernel, plan.part, plan.match, plan.config, plan.entry, plan.params
    dt = ctype(cfg.in_dtype).gmma
    gmma_s = f"cute::SM90::GMMA::MMA_64x{cfg.BN}x16_{dt}_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>"
    gmma_o = f"cute::SM90::GMMA::MMA_64x{cfg.D}x16_{dt}_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>"
    digest = hashlib.sha256(repr((kernel.name, part.name, cfg)).encode()).hexdigest()[:12]
    qk_dot = next(op for op in m.block.ops if op.name == "dot")
    L = [
        f"// Generated by tldsl.codegen, recipe attention — do not edit. Kernel '{kernel.name}', compute part "
        f"'{part.name}' ({part.loc}).",
        f"// flash attention: Q '{m.q_load.operands[0].owner.name}', K '{m.k_load.operands[0].owner.name}', "
        f"V '{m.v_load.operands[0].owner.name}' -> '{m.store.operands[0].owner.name}'; "
        f"{cfg.in_dtype}->{cfg.out_dtype}{', causal' if cfg.causal else ''}",
        f"// BM={cfg.BM} BN={cfg.BN} D={cfg.D}, {cfg.stages} stages, order {cfg.order}, key shards of "
        f"{m.cond_bound} rows; config {digest}",
        '#include "tldsl/sm90_attention.hpp"',
        "",
        "namespace {",
        "",
        control,
        "struct Cfg {",
        f"  using Elem = {c_type(cfg.in_dtype)};",
        f"  using ElemO = {c_type(cfg.out_dtype)};",
        f"  using GmmaS = {gmma_s};{marker(qk_dot.loc)}",
        f"  using GmmaO = {gmma_o};",
        f"  static constexpr int BM = {cfg.BM}, BN = {cfg.BN}, D = {cfg.D};{marker(part.loc)}",
        f"  static constexpr int kStages = {cfg.stages}, kConsumerWGs = {cfg.consumer_wgs};",
        f"  static constexpr int kOrder = {ORDERS[cfg.order]}, kGroupM = {order_group_m(cfg.group_m)}, kGridM = {cfg.grid[0]}, "
        f"kGridN = {cfg.grid[1]};",
        f"  static constexpr int kWorldSize = {kernel.world_size}, kAlignShift = {plan.align_shift};",
        f"  static constexpr int kProducerRegs = {cfg.producer_regs}, kConsumerRegs = {cfg.consumer_regs};",
        f"  static constexpr bool kCausal = {'true' if cfg.causal else 'false'}, "
        f"kOverlap = {'true' if cfg.overlap else 'false'}, kFoldScale = {'true' if cfg.softmax != 'plain' else 'false'}, "
        f"kMaskFree = {'true' if cfg.softmax == 'split' else 'false'};",
        f"  static constexpr float kScaleLog2 = {_c_float(cfg.scale * LOG2E)};   // scale {cfg.scale!r} * log2(e)",
        f"  static constexpr float kFillLog2 = {_c_float(cfg.fill * LOG2E)};    // masked score {cfg.fill!r}",
        f"  static constexpr float kInitLog2 = {_c_float(cfg.init_max * LOG2E)};    // initial max {cfg.init_max!r}",
        "};",
        "using Tr = tldsl::sm90::AttnTraits<Cfg>;",
        "// The host computed these (TMA boxes, dynamic shared memory); the template must agree.",
        f"static_assert(Tr::kSmemBytes == {cfg.smem_bytes}, \"host/device shared-memory size mismatch\");",
        f"static_assert(Tr::E == {cfg.E} && Tr::S == {cfg.S}, \"host/device TMA box mismatch\");",
        f"static_assert(Tr::kThreads == {cfg.threads}, \"host/device block size mismatch\");",
        "",
        "}  // namespace",
        "",
    ]
    init = ", ".join(["rank", "launch"] + [p.name for p in params if p.name.startswith(("sig_", "tbl_"))])
    L += kernel_entry(entry, cfg.threads, params, [
        f"  const Prog prog{{{init}}};",
        f"  tldsl::sm90::attention_kernel<Cfg>(&tma_q, &tma_k, &tma_v, &tma_o, prog);{marker(part.loc)}"])
    return "\n".join(L)


# -- the recipe ------------------------------------------------------------------------------------

def render_attention(plan: AttentionPlan) -> LoweredAttention:
    """The kernel of a plan: its control code (``struct Prog``) and the template instantiation."""
    ctl = plan.control
    emitter = _Control(plan.kernel, plan.match, ctl)
    control = _control_source(ctl, emitter.emit_run())
    if (tuple(emitter.signals), tuple(emitter.tables)) != (ctl.signals, ctl.tables):
        raise fail(WHAT, "internal: the control code reads other signals or tables than the plan lists", plan.part)
    return LoweredAttention(plan.kernel.name, plan.part.name, plan.entry, _emit_source(plan, control), control,
                            plan.config, plan.params, plan.tma, plan.buffers, plan.match.cond_bound,
                            plan.kernel.world_size, plan.align_shift, ctl.waits, tuple(s.name for s in ctl.signals),
                            tuple(t.name for t in ctl.tables), plan.nvrtc_options, plan.notes)


RECIPE = Recipe("attention", "compute", 10, match_attention, plan_attention, render_attention,
                options=frozenset({"stages", "overlap", "softmax", "wait_timeout_ns", "entry"}),
                summary="flash attention forward")


def lower_attention(kernel: core.Kernel, part: str | core.Part | None = None, *, stages: int | None = None,
                    overlap: bool | None = None, softmax: str | None = None,
                    wait_timeout_ns: int | None = None, entry: str | None = None) -> LoweredAttention:
    """Lower ``kernel``'s flash-attention compute part (the only one, or the one named) to a
    Hopper kernel: this recipe's match → plan → render, with the matcher's error (at the user's
    line) when the part does not fit. Options: :func:`..plan.attention.plan_attention`."""
    p = only_part(kernel, part, WHAT, "compute parts", lambda q: q.role == "compute")
    return RECIPE.run(kernel, p, stages=stages, overlap=overlap, softmax=softmax,
                      wait_timeout_ns=wait_timeout_ns, entry=entry)
