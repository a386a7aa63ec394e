"""The flash-attention recipe (``tldsl.codegen.recipes.attention``): pattern matching, host-side
numbers, the generated control code (compiled with the host C++ compiler and run against the
simulator: same key blocks, same rows, same waits, same causal mask, in the same order), clear
errors at the user's line, and -- where the CUDA wheels are installed -- NVRTC compiles for
sm_90a checked on their SASS.

SASS expectations for every generated attention kernel: WGMMA ran as tensor-core code
(``HGMMA``, both the 64xBN S = Q K^T and the 64xD O += P V shapes), TMA loads (``UTMALDG``:
2-D for Q, 3-D for the K/V shard views) and stores (``UTMASTG``), mbarriers (``SYNCS``), no trap
(``BPT.TRAP``), no ptxas note about serialised WGMMAs, and the spill budget below. A kernel whose
tile program waits has the acquire loads of its signals (``LDG.E.64.STRONG.GPU`` / ``.SYS``)
and the async-proxy fence (``FENCE.VIEW.ASYNC.G``); one without waits has neither.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen import toolchain as tcm
from tldsl.codegen.toolchain.cache import KernelCache
from tldsl.codegen.toolchain.compiler import CompileJob, compile_many
from tldsl.codegen import LoweredAttention, LoweringError, lower_attention
from tldsl.kernel import TensorSpec as S
from tldsl.ops.sp_attention import SPEC, sp_attention

import host_build

INCLUDE = Path(__file__).resolve().parent.parent / "codegen" / "include"

#: Spill budget: no bytes of spill stores/loads, no local-memory instructions, no stack.
SPILL_BUDGET_BYTES = 0
#: softmax="split" (the default): its two key-block bodies cost a few registers over the 168 of a
#: 384-thread block, so a few tile-level values spill (stored once per tile, reloaded for the
#: epilogue; measured faster than the one-body kernels on every row, BENCHMARKS.md)
SPLIT_SPILL_BUDGET_BYTES = 32
#: softmax="plain" (not the default), causal: one word (4 bytes, 8 of stack)
PLAIN_CAUSAL_SPILL_BUDGET_BYTES = 8


def trace_sp(W=4, Sl=1024, H=2, D=128, tile=(128, 128, 64), causal=True, comm=None, dt=tl.float16, Hkv=None,
             layout="contiguous", **sched):
    comm = comm or tl.CommSchedule(tile_m=128, mode="pull")
    q, kv = S((Sl, H * D), dt), S((Sl, (Hkv or H) * D), dt)
    extra = dict(kv_heads=Hkv) if Hkv else {}
    if layout != "contiguous":
        extra["layout"] = layout
    return sp_attention.trace(W, q, kv, kv, q, heads=H, causal=causal,
                              compute=tl.ComputeSchedule(tile=tile, **sched), comm=comm, **extra)


# -- a local (single-rank) attention, and variants outside the pattern ---------------------------------

@tl.kernel
def local_attention(q, k, v, o, *, variant: tl.constexpr = "ok", head_dim: tl.constexpr = None,
                    compute: tl.ComputeSchedule = None):
    Sq = q.shape[0]
    D = head_dim or q.shape[1]
    N = k.shape[0]
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(Sq, BM),))
    def attn(pm):
        q0 = pm * BM
        qt = tl.load(q, (q0, 0), (BM, D))
        j = tl.iota(BN)
        m = tl.fragment((BM,), tl.float32, fill=-1.0e30)
        l_sum = tl.fragment((BM,), tl.float32)
        acc = tl.fragment((BM, D), tl.float32)
        for kb in tl.range(0, N, BN):
            in_range = (j + kb) < N
            shift = 1 if variant == "rows_shifted" else 0
            rows = tl.where(in_range, j + (kb + shift), -1)
            kt = tl.load_rows(k, rows, 0, D)
            vt = tl.load_rows(v, rows, 0, D)
            mask = in_range[None, :]
            s = tl.dot(qt, tl.trans(kt))
            s = s * (tl.exp(s) if variant == "tile_scale" else 0.125)
            sc = s if variant == "unmasked" else tl.where(mask, s, -1.0e30)
            m_old = m[...]
            m_new = tl.maximum(m_old, tl.max(sc, 1))
            alpha = tl.exp(m_old - m_new)
            e = tl.exp2(sc - m_new[:, None]) if variant == "exp2" else tl.exp(sc - m_new[:, None])
            p = tl.where(mask, e, 0.0)
            l_sum[...] = l_sum[...] * alpha + tl.sum(p, 1)
            acc[...] = acc[...] * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m[...] = m_new
            if variant == "extra_store":
                tl.store(o, (q0, 0), acc[...])
        denom = l_sum[...]
        denom = tl.where(denom > 0.0, denom, 1.0)
        tl.store(o, (q0, 0), acc[...] / denom[:, None])


def trace_local(variant="ok", Sq=200, N=300, D=64, tile=(128, 64, 64), dt=tl.float16, odt=None, width=None,
                head_dim=None, **sched):
    w = width or D
    return local_attention.trace(1, S((Sq, w), dt), S((N, w), dt), S((N, w), dt), S((Sq, w), odt or dt),
                                 variant=variant, head_dim=head_dim, compute=tl.ComputeSchedule(tile=tile, **sched))


# -- recognition and host-side numbers ------------------------------------------------------------------

def test_lower_sp_attention_host_description():
    la = lower_attention(trace_sp())
    c = la.config
    assert isinstance(la, LoweredAttention)
    assert (c.BM, c.BN, c.D, c.stages, c.consumer_wgs, c.threads) == (128, 128, 128, 3, 2, 384)
    assert (c.causal, c.overlap, c.in_dtype, c.out_dtype) == (True, True, "f16", "f16")
    assert c.scale == pytest.approx(1 / np.sqrt(128)) and c.fill == -1e30 and c.init_max == -1e30
    assert la.grid_tiles == (2, 8) and la.num_tiles == 16 and la.shard_rows == 1024      # (heads, query blocks)
    assert la.grid(132) == (16, 1, 1) and la.grid(10) == (10, 1, 1) and la.block == (384, 1, 1)
    assert la.waits == 2 and la.signals == ("gather_k_ready", "gather_v_ready") and la.tables == ()
    assert [p.name for p in la.params] == ["tma_q", "tma_k", "tma_v", "tma_o", "rank", "launch",
                                           "sig_gather_k_ready", "sig_gather_v_ready"]
    assert [p.source for p in la.params][4:] == ["rank", "launch", "signal:gather_k_ready", "signal:gather_v_ready"]
    q, k, v, o = la.tma
    assert (q.buffer, q.global_dims, q.global_strides, q.box_dims, q.swizzle) == \
        ("q", (256, 1024), (512,), (64, 128), "CU_TENSOR_MAP_SWIZZLE_128B")
    # the gathered K / V as [shards, rows per shard, width]: rows past a shard end read zero
    assert (k.buffer, k.global_dims, k.global_strides, k.box_dims) == \
        ("k_gathered", (256, 1024, 4), (512, 1024 * 512), (64, 128, 1))
    assert (v.buffer, v.global_dims, v.box_dims) == ("v_gathered", (256, 1024, 4), (64, 128, 1))
    assert (o.buffer, o.global_dims, o.box_dims) == ("o", (256, 1024), (64, 64))
    assert all(t.oob_fill == "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE" for t in la.tma)     # zeros
    assert la.buffers == {"q": ((1024, 256), "f16"), "k_gathered": ((4096, 256), "f16"),
                          "v_gathered": ((4096, 256), "f16"), "o": ((1024, 256), "f16")}
    # Q + 3 stages of K and V + barriers + alignment slack
    assert la.smem_bytes == 32768 + 3 * 2 * 32768 + (2 + 3 * 3) * 8 + 1024
    assert f"Tr::kSmemBytes == {la.smem_bytes}" in la.source
    assert 'extern "C" __global__ void __launch_bounds__(384, 1)' in la.source
    assert "kCausal = true, kOverlap = true" in la.source and "MMA_64x128x16_F32F16F16_RS" in la.source
    assert "flash attention f16->f16 causal" in la.describe()


def test_control_code_follows_the_tile_program():
    la = lower_attention(trace_sp(W=4, comm=tl.CommSchedule(tile_m=64, mode="push", order="full_mesh")))
    src = la.control_source
    # own shard first, key blocks of the loop nest, per-block waits only in the producer
    assert "tldsl::floormod(" in src and "#pragma unroll 1" in src
    assert src.count("if constexpr (kWaits) {") == 2
    assert src.count("tldsl::wait_at_least<tldsl::kScopeSys>(sig_gather_k_ready + ") == 1
    assert "* launch" in src                                             # epoch counting
    assert re.search(r"on_block\(tldsl::attn::KeyBlock\{\w+, \w+, \w+, \w+, 1024 - \w+, \w+, \w+\}\);", src)
    # every generated statement carries the tile program's line
    code = [l for l in src.splitlines() if l.strip().startswith(("const int", "for (", "tldsl::wait", "on_"))]
    assert code and all("// tldsl: " in l and "sp_attention.py:" in l for l in code)
    assert la.control_source in la.source


def test_non_causal_and_local_variants():
    la = lower_attention(trace_sp(causal=False, D=64, tile=(64, 128, 64), stages=2, dt=tl.bfloat16))
    c = la.config
    assert (c.causal, c.BM, c.consumer_wgs, c.threads, c.D, c.S, c.E, c.in_dtype) == \
        (False, 64, 1, 256, 64, 128, 64, "bf16")
    assert "kCausal = false" in la.source and "MMA_64x64x16_F32BF16BF16_RS" in la.source
    loc = lower_attention(trace_local())
    assert loc.waits == 0 and loc.signals == () and "kHasWaits = false" in loc.source
    assert [p.name for p in loc.params] == ["tma_q", "tma_k", "tma_v", "tma_o", "rank", "launch"]
    k = loc.tma[1]
    assert k.global_dims == (64, 300, 1) and k.box_dims == (64, 64, 1)          # one shard of 300 rows
    assert loc.grid_tiles == (2, 1)


@pytest.mark.parametrize("D,s", [(16, 32), (32, 64), (64, 128), (128, 128)])
def test_swizzle_follows_the_head_dim(D, s):
    la = lower_attention(trace_sp(Sl=256, D=D, tile=(64, 64, 64), stages=2))
    assert (la.config.S, la.config.E, la.config.chunks) == (s, s // 2, D // (s // 2))
    assert all(t.swizzle.endswith(f"_{s}B") and t.box_dims[0] == s // 2 for t in la.tma)


def test_stages_and_overlap_options():
    assert lower_attention(trace_sp(), stages=2).config.stages == 2
    la = lower_attention(trace_sp(stages=1))
    assert la.config.overlap is False and "kOverlap = false" in la.source
    assert lower_attention(trace_sp(), overlap=False).config.overlap is False


def test_softmax_option():
    """``softmax`` picks the exponentials' form (fold) and the mask-free bodies (split: the
    default, fastest on the H200 at every row measured); the kernel of before stays selectable
    (plain); anything else is refused."""
    flags = {sm: (f"kFoldScale = {'false' if sm == 'plain' else 'true'}, "
                  f"kMaskFree = {'true' if sm == 'split' else 'false'};") for sm in ("plain", "fold", "split")}
    la = lower_attention(trace_sp())
    assert la.config.softmax == "split" and flags["split"] in la.source
    for sm in ("plain", "fold"):
        la = lower_attention(trace_sp(), softmax=sm)
        assert la.config.softmax == sm and flags[sm] in la.source and f"softmax {sm}" in la.describe()
    with pytest.raises(LoweringError, match="softmax='exp'"):
        lower_attention(trace_sp(), softmax="exp")


def test_gqa_and_zigzag_lower_through_the_attention_recipe():
    """GQA reads the key/value head h // group (the K/V columns are control code); the zig-zag
    layout walks the gathered K/V as 2W chunks of Sl/2 rows (a 3-D TMA view [2W, Sl/2, width])
    and hands the kernel the split of a query block that straddles a rank's two chunks."""
    from tldsl.codegen import pipeline
    gqa = trace_sp(W=2, Sl=512, H=8, Hkv=2, D=64, causal=False)
    assert pipeline.match(gqa, gqa.part("attention")).recipe.name == "attention"
    la = lower_attention(gqa)
    k = la.tma[1]
    assert (k.global_dims, k.box_dims) == ((128, 512, 2), (64, 128, 1)) and la.shard_rows == 512
    assert la.buffers["k_gathered"] == ((1024, 128), "f16") and la.buffers["q"] == ((512, 512), "f16")
    assert "tldsl::floordiv(" in la.control_source                     # h // 4
    assert re.search(r"KeyBlock\{(\w+), \1, \w+, \w+, 512 - \w+, 0, 0\}", la.control_source)
    zz = trace_sp(W=2, Sl=502, H=4, Hkv=1, D=64, layout="zigzag")      # chunks of 251 rows
    assert pipeline.match(zz, zz.part("attention")).recipe.name == "attention"
    la = lower_attention(zz)
    k = la.tma[1]
    assert la.shard_rows == 251 and (k.global_dims, k.global_strides) == ((64, 251, 4), (128, 251 * 128))
    assert la.config.causal and la.waits == 2 and la.signals == ("gather_k_ready", "gather_v_ready")
    # the chunk index 2 * peer + half, and two more fields: the split row and the second run's base
    assert re.search(r"SplitKeyBlock\{\{(\w+), \1, (\w+), 2 \* \w+ \+ \w+, 251 - \2, \w+, \w+\}, \w+, \w+\}\);",
                     la.control_source), la.control_source
    # non-causal: the layout changes nothing, the kernel is the contiguous one
    a = lower_attention(trace_sp(W=2, Sl=502, causal=False, layout="zigzag")).source
    b = lower_attention(trace_sp(W=2, Sl=502, causal=False)).source
    strip = lambda src: re.sub(r"(test_codegen_attention|sp_attention)\.py:\d+", "", src)  # noqa: E731
    assert strip(a) == strip(b)


def test_the_pipeline_picks_the_attention_recipe():
    from tldsl.codegen import pipeline
    k = trace_sp()
    assert pipeline.match(k, k.part("attention")).recipe.name == "attention"
    assert isinstance(pipeline.lower(k, "attention"), LoweredAttention)
    from test_codegen_host import trace_plain
    g = trace_plain()
    assert pipeline.match(g, g.parts[0]).recipe.name == "gemm"
    assert pipeline.match(k, k.part("gather_k")).recipe.role == "comm"


# -- errors at the user's line ------------------------------------------------------------------------

def _raises_at(fn, text):
    with pytest.raises(LoweringError) as ei:
        fn()
    assert text in str(ei.value), str(ei.value)
    return ei.value


@pytest.mark.parametrize("variant,text,line", [
    ("exp2", "the probabilities must be 'ewise exp'", "tl.exp2(sc - m_new"),
    ("tile_scale", "the scores may only be scaled by a constant", "s = s * (tl.exp(s)"),
    ("unmasked", "the masked scores tl.where(mask, s, FILL) must be 'ewise where'", "s = s * (tl.exp(s)"),
    ("extra_store", "expected one tl.store of the output, found 2", "tl.store(o, (q0, 0), acc[...] / denom"),
    ("rows_shifted", "must be a multiple of the shard length 300", "rows = tl.where(in_range"),
])
def test_outside_the_pattern_points_at_the_user_line(variant, text, line):
    e = _raises_at(lambda: lower_attention(trace_local(variant)), text)
    assert "attention lowering:" in str(e)
    assert e.loc is not None and e.loc.filename == __file__
    if variant != "unmasked":
        assert line in e.loc.source, e.loc.source


def test_unmasked_error_names_the_op():
    e = _raises_at(lambda: lower_attention(trace_local("unmasked")), "got 'ewise mul'")
    assert "s * (tl.exp(s) if" in e.loc.source


def test_rejected_configurations():
    _raises_at(lambda: lower_attention(trace_sp(W=2, Sl=256, D=96, H=2)), "head dim D=96")
    _raises_at(lambda: lower_attention(trace_sp(W=2, Sl=256, D=256, H=1, tile=(64, 16, 64))), "head dim D=256")
    _raises_at(lambda: lower_attention(trace_sp(W=2, Sl=256, tile=(32, 64, 64))), "BM=32")
    _raises_at(lambda: lower_attention(trace_sp(W=2, Sl=256, tile=(256, 64, 64))), "BM=256")
    _raises_at(lambda: lower_attention(trace_sp(W=2, Sl=256, tile=(128, 8, 64))), "BN=8")
    _raises_at(lambda: lower_attention(trace_sp(W=2, Sl=256, tile=(128, 256, 64), D=64)), "BN=256")
    _raises_at(lambda: lower_attention(trace_sp(W=2, Sl=256, tile=(128, 128, 64), stages=4)), "shared memory")
    _raises_at(lambda: lower_attention(trace_sp(stages=1), overlap=True), "overlap=True needs at least 2 stages")
    _raises_at(lambda: lower_attention(trace_sp(W=2, Sl=256, dt=tl.float32, D=64)), "f16 or bf16")
    _raises_at(lambda: lower_attention(trace_local(odt=tl.float32)), "o must be f16 or bf16")
    _raises_at(lambda: lower_attention(trace_local(width=20, head_dim=16, tile=(64, 64, 64))), "16-byte aligned rows")
    k = trace_sp()
    _raises_at(lambda: lower_attention(k, "gather_k"), "is a comm part")
    from test_codegen_host import trace_plain
    _raises_at(lambda: lower_attention(trace_plain()), "expected one 2-d accumulator and two 1-d fragments")


# -- the generated control code == the simulator, block by block ------------------------------------------

HARNESS_HEAD = r"""
#include <cstdio>
#include <cstdlib>
namespace tldsl {
enum Scope : int { kScopeGpu = 0, kScopeSys = 1 };
inline constexpr int floordiv(int a, int b) { return (a / b) - (((a % b) != 0) && ((a < 0) != (b < 0)) ? 1 : 0); }
inline constexpr int floormod(int a, int b) { return a - floordiv(a, b) * b; }
inline constexpr int imin(int a, int b) { return a < b ? a : b; }
inline constexpr int imax(int a, int b) { return a > b ? a : b; }
const unsigned long long* g_sig[8];
const char* g_sig_name[8];
int g_sig_slots[8];
int g_nsig = 0;
template <int S>
inline void wait_at_least(const unsigned long long* slot, unsigned long long target) {
  for (int k = 0; k < g_nsig; ++k)
    if (slot >= g_sig[k] && slot < g_sig[k] + g_sig_slots[k]) {
      printf("wait %s %d %llu %d\n", g_sig_name[k], int(slot - g_sig[k]), target, S);
      return;
    }
  printf("wait ? -1 %llu %d\n", target, S);
}
}  // namespace tldsl
#include "tldsl/sm90_attention.hpp"
"""


SPLIT_PRINT = r"""
// one run of query positions: every row at q_pos0 + row (no split inside any tile)
inline void print_split(const tldsl::attn::KeyBlock&) { printf(" 2147483647 0\n"); }
inline void print_split(const tldsl::attn::SplitKeyBlock& b) {
  printf(" %d %d\n", b.q_split, b.q_pos1);
  for (int row = -2; row < 260; ++row)   // the kernel's mask shift agrees with the fields
    if (tldsl::attn::query_shift(b, row) != (row < b.q_split ? 0 : b.q_pos1 - b.q_pos0)) abort();
}
"""


def _harness(la: LoweredAttention, kernel) -> str:
    sigs = [kernel.signals[[s.name for s in kernel.signals].index(n)] for n in la.signals]
    decl = "\n".join(f"static unsigned long long sig{i}[{s.type.slots}];" for i, s in enumerate(sigs))
    setup = "\n".join(f"  tldsl::g_sig[{i}] = sig{i}; tldsl::g_sig_name[{i}] = \"{s.name}\"; "
                      f"tldsl::g_sig_slots[{i}] = {s.type.slots};" for i, s in enumerate(sigs))
    init = ", ".join(["rank", "launch"] + [f"sig{i}" for i in range(len(sigs))])
    gm, gn = la.grid_tiles
    return HARNESS_HEAD + SPLIT_PRINT + la.control_source + decl + f"""
int main(int argc, char** argv) {{
  const int world = atoi(argv[1]);
  const unsigned long long launch = strtoull(argv[2], nullptr, 10);
{setup}
  tldsl::g_nsig = {len(sigs)};
  for (int rank = 0; rank < world; ++rank)
    for (int p0 = 0; p0 < {gm}; ++p0)
      for (int p1 = 0; p1 < {gn}; ++p1) {{
        printf("task %d %d %d\\n", rank, p0, p1);
        const Prog prog{{{init}}};
        prog.run<true>(p0, p1,
          [](const tldsl::attn::TileInfo& t) {{ printf("tile %d %d %d %d\\n", t.q_row, t.q_col, t.o_row, t.o_col); }},
          [](const auto& b) {{
            printf("block %d %d %d %d %d %d %d", b.k_col, b.v_col, b.row, b.shard, b.valid, b.key_pos0, b.q_pos0);
            // whether each consumer warpgroup's rows take the masked body (softmax="split")
            printf(" %d %d", int(tldsl::attn::block_needs_mask(b, {la.config.BN}, {str(la.config.causal).lower()}, 0, 64)),
                   int(tldsl::attn::block_needs_mask(b, {la.config.BN}, {str(la.config.causal).lower()}, 64, 128)));
            print_split(b);
          }});
      }}
  return 0;
}}
"""


def _run_harness(tmp_path, la, kernel, launch):
    src = _harness(la, kernel)
    (tmp_path / "control.cpp").write_text(src)
    exe = host_build.build(src, ["-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unknown-pragmas", f"-I{INCLUDE}"])
    out = subprocess.run([str(exe), str(kernel.world_size), str(launch)], check=True, capture_output=True,
                         text=True).stdout
    tasks: dict = {}
    cur = None
    for line in out.splitlines():
        f = line.split()
        if f[0] == "task":
            cur = tasks.setdefault((int(f[1]), (int(f[2]), int(f[3]))), [])
        else:
            cur.append((f[0], *[x if f[0] == "wait" and i == 0 else int(x) for i, x in enumerate(f[1:])]))
    return tasks


def _simulate_recording(monkeypatch, case, W, seed):
    """Simulate and record, per compute task and launch, what it loads, waits for and stores."""
    from tldsl.runtime.sim.interpreter import Interpreter
    log: dict = {}

    def rec(task, item):
        if task.part.role == "compute":
            log.setdefault((task.launch, task.rank, tuple(task.coords)), []).append(item)

    orig = {n: getattr(Interpreter, n) for n in ("op_load", "op_load_rows", "op_store", "op_ewise",
                                                 "op_consumer_tile_wait", "op_peer_tile_wait", "op_rank_wait")}

    def op_load(self, op, env, task):
        rec(task, ("load", *[env[o.id] for o in op.operands[1:]]))
        return orig["op_load"](self, op, env, task)

    def op_load_rows(self, op, env, task):
        rec(task, ("rows", op.operands[0].hint, tuple(int(r) for r in env[op.operands[1].id]),
                   env[op.operands[2].id]))
        return orig["op_load_rows"](self, op, env, task)

    def op_store(self, op, env, task):
        rec(task, ("store", *[env[o.id] for o in op.operands[1:-1]]))
        return orig["op_store"](self, op, env, task)

    def op_ewise(self, op, env, task):
        out = orig["op_ewise"](self, op, env, task)
        if op.attrs["op"] == "le" and len(op.result.type.shape) == 2:
            rec(task, ("causal", env[op.result.id].copy()))
        return out

    def wait(name):
        def f(self, op, env, task):
            scope = 1 if name in ("op_peer_tile_wait", "op_rank_wait") else 0
            count = env[op.operands[2].id]
            rec(task, ("wait", op.operands[0].hint, env[op.operands[1].id], count * task.launch, scope))
            return orig[name](self, op, env, task)
        return f

    for n, fn in (("op_load", op_load), ("op_load_rows", op_load_rows), ("op_store", op_store),
                  ("op_ewise", op_ewise)):
        monkeypatch.setattr(Interpreter, n, fn)
    for n in ("op_consumer_tile_wait", "op_peer_tile_wait", "op_rank_wait"):
        monkeypatch.setattr(Interpreter, n, wait(n))
    tl.simulate(sp_attention, W, case.inputs, seed=seed, **case.kwargs)
    monkeypatch.undo()
    return log


CONTROL_CASES = {
    # W, Sl, heads, D, tile, causal, comm: Sl not a multiple of BN, comm tiles smaller / larger than BN
    "pull-commtile16-causal": (3, 70, 2, 16, (64, 16, 16), True, tl.CommSchedule(tile_m=16, mode="pull")),
    "push-mesh-commtile64-full": (3, 100, 1, 16, (64, 32, 16), False,
                                  tl.CommSchedule(tile_m=64, mode="push", order="full_mesh")),
    "copy-engine-BM128-causal": (2, 130, 1, 16, (128, 64, 16), True, tl.CommSchedule(engine="copy_engine")),
    "single-rank-causal": (1, 77, 1, 32, (64, 64, 16), True, tl.CommSchedule(tile_m=32)),
    # zig-zag: chunks of 45 and 77 rows (query blocks straddle a rank's two chunks), GQA
    "zigzag-gqa-pull-commtile16": (3, 90, (2, 1), 16, (64, 16, 16), True, tl.CommSchedule(tile_m=16, mode="pull"),
                                   "zigzag"),
    "zigzag-BM128-copy-engine": (2, 154, 1, 16, (128, 64, 16), True, tl.CommSchedule(engine="copy_engine"), "zigzag"),
}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("name", sorted(CONTROL_CASES))
def test_generated_control_code_matches_the_simulator(tmp_path, monkeypatch, name):
    W, Sl, H, D, tile, causal, comm, *layout = CONTROL_CASES[name]
    H, Hkv = H if isinstance(H, tuple) else (H, None)
    compute = tl.ComputeSchedule(tile=tile)
    case = SPEC.make_case(np.random.default_rng(1), W, seq_per_rank=Sl, heads=H, head_dim=D, causal=causal,
                          compute=compute, comm=comm, kv_heads=Hkv, layout=(layout or ["contiguous"])[0])
    q, kv = S((Sl, H * D), tl.float16), S((Sl, (Hkv or H) * D), tl.float16)
    kernel = sp_attention.trace(W, q, kv, kv, q, **case.kwargs)
    la = lower_attention(kernel)
    L, BN, BM = la.shard_rows, la.config.BN, la.config.BM
    log = _simulate_recording(monkeypatch, case, W, seed=3)
    launches = sorted({k[0] for k in log})
    assert launches == [1, 2]
    blocks_seen = 0
    for launch in launches:
        got = _run_harness(tmp_path, la, kernel, launch)
        assert sorted(got) == sorted((r, c) for (lc, r, c) in log if lc == launch)
        for (rank, coords), events in got.items():
            sim = log[(launch, rank, coords)]
            # the simulator's sequence: load q, then per block [waits..., rows k, rows v, (causal)], store o
            assert sim[0][0] == "load" and sim[-1][0] == "store"
            tile = events[0]
            assert tile[0] == "tile" and tile[1:3] == sim[0][1:] and tile[3:5] == sim[-1][1:], (tile, sim[0], sim[-1])
            want, i = [], 1
            while i < len(sim) - 1:
                ev = sim[i]
                if ev[0] == "wait":
                    want.append(ev)
                    i += 1
                    continue
                kr, vr = sim[i], sim[i + 1]
                assert kr[0] == vr[0] == "rows" and kr[2] == vr[2]
                causal_m = sim[i + 2][1] if causal else None
                want.append(("block", kr[2], kr[3], vr[3], causal_m))
                i += 3 if causal else 2
            have = []
            for ev in events[1:]:
                if ev[0] == "wait":
                    have.append(ev)
                    continue
                _, kcol, vcol, row, shard, valid, key0, q0, needs0, needs1, split, q1 = ev
                assert valid == L - row and 0 <= row < L
                rows = tuple(shard * L + row + j if row + j < L else -1 for j in range(BN))
                i = np.arange(128)[:, None]
                cm = (np.arange(BN)[None, :] + key0 <= np.where(i < split, q0, q1) + i) if causal else None
                for r0, needs in ((0, needs0), (64, needs1)):    # exactly the blocks with a masked key
                    masked = valid < BN or (causal and not cm[r0:r0 + 64].all())
                    assert needs == masked, (rank, coords, r0, row, key0, q0, split, q1)
                cm = cm[:BM] if causal else None
                have.append(("block", rows, kcol, vcol, cm))
                blocks_seen += 1
            assert len(have) == len(want), (rank, coords, len(have), len(want))
            for h, w in zip(have, want):
                if h[0] == "wait":
                    assert h == w, (rank, coords, h, w)
                else:
                    assert h[:4] == w[:4], (rank, coords, h[:4], w[:4])
                    if causal:
                        assert np.array_equal(h[4], w[4]), (rank, coords)
    assert blocks_seen > 0


# -- NVRTC compiles for sm_90a, checked on the SASS --------------------------------------------------------

_OK, _WHY = tcm.toolchain_available()
needs_cuobjdump = pytest.mark.skipif(not _OK or tcm.find_toolchain().cuobjdump is None,
                                     reason="cuobjdump missing: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


@pytest.fixture
def cache(tmp_path):
    return KernelCache(tmp_path / "cache")


def check_attention_sass(la: LoweredAttention, ck, *, waits_scope=None, budget=None):
    info = ck.ptxas_info()[ck.name]
    if budget is None:
        budget = SPLIT_SPILL_BUDGET_BYTES if la.config.softmax == "split" else SPILL_BUDGET_BYTES
    assert info["spill_store_bytes"] <= budget and info["spill_load_bytes"] <= budget, info
    assert info["stack_bytes"] <= budget, info
    for note in ("C7510", "C7511", "C7514", "C7515", "C7517", "C7518"):   # serialised / fenced WGMMA pipelines
        assert note not in ck.log, ck.log
    k = ck.sass()[ck.name]
    s = k.summary()
    c = la.config
    assert s["HGMMA"] > 0 and s["UTMALDG"] > 0 and s["UTMASTG"] > 0 and s["SYNCS"] > 0, s
    assert s["BPT.TRAP"] == 0 and s["local_bytes"] <= budget, s
    assert s["LDL/STL"] == 0 if budget == 0 else s["LDL/STL"] <= budget // 2, s      # a few 4-byte words
    suffix = "" if c.in_dtype == "f16" else ".BF16"
    assert k.count(f"HGMMA.64x{c.BN}x16.F32{suffix}") > 0, sorted(k.opcodes)      # S = Q K^T
    assert k.count(f"HGMMA.64x{c.D}x16.F32{suffix}") > 0, sorted(k.opcodes)       # O += P V
    assert k.count("UTMALDG.2D") > 0 and k.count("UTMALDG.3D") > 0 and k.count("UTMASTG.2D") > 0
    assert k.count("USETMAXREG") == 2
    acquires = k.count("LDG.E.64.STRONG.SYS") + k.count("LDG.E.64.STRONG.GPU")
    if waits_scope is None:
        assert acquires == 0 and k.count("FENCE.VIEW.ASYNC.G") == 0
    else:
        assert k.count(f"LDG.E.64.STRONG.{waits_scope}") > 0, sorted(k.mnemonics)
        assert k.count("FENCE.VIEW.ASYNC.G") > 0
    return k


NVRTC_CASES = [
    # (label, trace kwargs, lowering kwargs, scope of the waits)
    ("D128-causal-pull-BM128", dict(D=128, tile=(128, 128, 64), causal=True), {}, "GPU"),
    ("D128-full-push-BM128-bf16", dict(D=128, tile=(128, 128, 64), causal=False, dt=tl.bfloat16,
                                       comm=tl.CommSchedule(tile_m=64, mode="push", order="full_mesh")), {}, "SYS"),
    ("D64-causal-BM128-BN128", dict(D=64, tile=(128, 128, 64), causal=True), {}, "GPU"),
    ("D64-full-copyengine-BM64-2stages", dict(D=64, tile=(64, 128, 64), causal=False, stages=2,
                                              comm=tl.CommSchedule(engine="copy_engine")), {}, "SYS"),
    ("D128-causal-BM64-no-overlap", dict(D=128, tile=(64, 128, 64), causal=True), dict(overlap=False), "GPU"),
    # 8 heads (the grid's rows) in two whole groups of 4
    ("D64-causal-BN64-swizzled", dict(D=64, H=8, tile=(128, 64, 64), causal=True, order="swizzled", group_m=4,
                                      stages=4), {}, "GPU"),
]


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
@needs_cuobjdump
def test_generated_attention_kernels_compile_for_sm90a(cache):
    las = [lower_attention(trace_sp(**tk), **lk) for _, tk, lk, _ in NVRTC_CASES]
    t0 = time.perf_counter()
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in las], cache=cache, progress=False)
    wall = time.perf_counter() - t0
    for (label, _, _, scope), la, ck in zip(NVRTC_CASES, las, cks):
        assert not ck.cached and ck.cubin[:4] == b"\x7fELF"
        k = check_attention_sass(la, ck, waits_scope=scope)
        print(f"{label}: {ck.compile_seconds:.1f} s {ck.timings} {k.summary()}")
    print(f"{len(las)} attention kernels in {wall:.1f} s")


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
@needs_cuobjdump
def test_attention_without_waits_and_small_head_dims_compile(cache):
    las = [lower_attention(trace_local(D=64, tile=(128, 64, 64))),
           lower_attention(trace_sp(Sl=100, D=32, H=2, tile=(64, 64, 64), stages=2)),
           lower_attention(trace_sp(Sl=77, D=16, H=1, tile=(64, 16, 16), causal=False, stages=2))]
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in las], cache=cache, progress=False)
    check_attention_sass(las[0], cks[0], waits_scope=None)
    check_attention_sass(las[1], cks[1], waits_scope="GPU")
    check_attention_sass(las[2], cks[2], waits_scope="GPU")


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
@needs_cuobjdump
def test_gqa_and_zigzag_kernels_compile(cache):
    """One kernel per new variant: GQA (4 query heads per key/value head, non-causal, bf16) and
    the zig-zag layout (causal, chunks of 501 rows, GQA, BM=128: query blocks straddle chunks)."""
    las = [lower_attention(trace_sp(H=8, Hkv=2, D=128, causal=False, dt=tl.bfloat16)),
           lower_attention(trace_sp(W=4, Sl=1002, H=4, Hkv=2, D=64, tile=(128, 128, 64), layout="zigzag",
                                    comm=tl.CommSchedule(tile_m=64, mode="push", order="full_mesh")))]
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in las], cache=cache, progress=False)
    check_attention_sass(las[0], cks[0], waits_scope="GPU")
    check_attention_sass(las[1], cks[1], waits_scope="SYS")


_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+([^;]*);")


def ex2_feeds(sass_text: str) -> dict:
    """What produced the input of each ``MUFU.EX2`` (the opcode that last wrote its source
    register, in program order): FFMA for a folded scale, FADD for ``s' - m``."""
    writer, feeds = {}, {}
    for m in _SASS_LINE.finditer(sass_text):
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        if op.startswith("MUFU.EX2"):
            src = writer.get(args[1].lstrip("-|"), "?").split(".")[0]
            feeds[src] = feeds.get(src, 0) + 1
        if args and re.fullmatch(r"R\d+", args[0]):
            writer[args[0]] = op
    return feeds


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
@needs_cuobjdump
def test_softmax_variants_in_the_sass(cache):
    """Per key block a consumer thread takes BN / 2 exponentials of scores and 2 of rescale
    factors. plain: all fed by FADD (s' - m); fold: the scores' by one FFMA each. split: a second,
    mask-free body (twice the WGMMAs and exponentials, its selects gone; no serialised WGMMAs), and
    where no block can be masked (non-causal, shards a multiple of BN) only that body remains."""
    cases = [(True, "plain"), (True, "fold"), (True, "split"), (False, "split")]
    las = [lower_attention(trace_sp(D=128, causal=c, dt=tl.bfloat16), softmax=sm) for c, sm in cases]
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in las], cache=cache, progress=False)
    half = las[0].config.BN // 2
    got = {}
    for (causal, sm), la, ck in zip(cases, las, cks):
        if sm == "split" and causal:
            # the two bodies cost a few registers over the 168 of a 384-thread block: tile-level
            # values spill once per tile (stored before the key blocks, reloaded for the epilogue)
            info = ck.ptxas_info()[ck.name]
            assert info["spill_store_bytes"] <= 32 and info["spill_load_bytes"] <= 32, info
            for note in ("C7510", "C7511", "C7514", "C7515", "C7517", "C7518"):
                assert note not in ck.log, ck.log
            k = ck.sass()[ck.name]
        else:
            # causal "plain" (not the default): one 4-byte word spills since the grid's heads went
            # outermost (ptxas's choice at the 168 registers of a 384-thread block)
            k = check_attention_sass(la, ck, waits_scope="GPU", budget=PLAIN_CAUSAL_SPILL_BUDGET_BYTES
                                     if (causal, sm) == (True, "plain") else None)
        got[causal, sm] = (ex2_feeds(ck.sass().sass_text), k.count("HGMMA"), k.count("FSEL"))
    assert got[True, "plain"][0] == {"FADD": half + 2}
    assert got[True, "fold"][0] == {"FFMA": half, "FADD": 2}
    assert got[True, "split"][0] == {"FFMA": 2 * half, "FADD": 4}
    hgmma = got[True, "fold"][1]
    assert got[True, "plain"][1] == hgmma and got[True, "split"][1] > hgmma       # S and P V issued in both bodies
    assert got[True, "split"][2] == got[True, "fold"][2] > 0                       # the mask-free body has no selects
    assert got[False, "split"][0] == {"FFMA": half, "FADD": 2} and got[False, "split"][2] == 0


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
def test_attention_compile_error_points_at_the_tile_program(cache):
    from tldsl.codegen.toolchain.compiler import CudaCompileError, compile_cuda
    la = lower_attention(trace_sp())
    needle = "tldsl::wait_at_least<tldsl::kScopeGpu>(sig_gather_k_ready"
    assert needle in la.source
    bad = la.source.replace(needle, "tldsl::wait_at_least<tldsl::kScopeGpu>(sig_not_declared")
    with pytest.raises(CudaCompileError) as ei:
        compile_cuda(bad, la.entry, cache=cache, progress=False)
    e = ei.value
    assert e.loc is not None and e.loc.filename.endswith("sp_attention.py") and "wait_rows" in e.loc.source
