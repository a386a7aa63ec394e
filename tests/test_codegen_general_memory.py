"""The general lowering's memory-bound code (issue 18 item 5), checked without a GPU: the
benchmark's plain tile programs lower to kernels that run several tasks per CTA, move global
memory in 16-byte vectors, reduce rows with warp shuffles and spill nothing (their speed on an
H200 is in BENCHMARKS.md, "2026-12-01 (thirteenth session) — general path, memory-bound")."""
from __future__ import annotations

import re

import pytest

import tldsl as tl
from tldsl.bench import general_programs as gp
from tldsl.codegen import lower
from tldsl.codegen import toolchain as tcm
from tldsl.codegen.recipes.general import LoweredGeneral

S = tl.TensorSpec
BIG, ROW = S((16384, 8192), tl.float16), S((1, 8192), tl.float16)
FLAT, ROWS = tl.ComputeSchedule(tile=(32, 256, 16)), tl.ComputeSchedule(tile=(16, 256, 16))


def _memory_bound():
    """The benchmark's four programs at its shapes, schedules and keywords (tldsl/bench/general.py)."""
    from tldsl.bench.general import ROW_DEFAULTS

    def kw(name):
        return {k: v for k, v in ROW_DEFAULTS[name].items() if k != "threads"}
    return [gp.scale_shift.trace(1, BIG, BIG, compute=FLAT),
            gp.row_softmax.trace(1, BIG, BIG, compute=ROWS, **kw("row softmax")),
            gp.rms_norm.trace(1, BIG, ROW, BIG, compute=ROWS, **kw("RMSNorm")),
            gp.add_rms_norm.trace(1, BIG, BIG, ROW, BIG, BIG, compute=ROWS, **kw("residual add + RMSNorm"))]


def _lower(ir):
    """As the benchmark lowers it (its lowering threads, where it sets them)."""
    from tldsl.bench.general import ROW_DEFAULTS
    names = {"row_softmax": "row softmax", "rms_norm": "RMSNorm", "add_rms_norm": "residual add + RMSNorm"}
    t = ROW_DEFAULTS.get(names.get(ir.name, ""), {}).get("threads")
    return lower(ir, "part", **({"threads": t} if t else {}))


def test_memory_bound_parts_run_several_tasks_per_cta():
    """A CTA of the runtime's one-per-SM grid holds several tasks (groups with their own barrier
    and arena), every SM gets a task before any gets two, and a part with a dot keeps one task
    per CTA (its warp tiles span the CTA)."""
    for ir in _memory_bound():
        lk = lower(ir, "part")
        # two tasks of 256 threads where each holds two whole 8192-element rows in registers
        assert isinstance(lk, LoweredGeneral) and lk.groups >= (2 if len(lk.held) >= 2 else 4), lk.describe()
        assert lk.block[0] == lk.groups * lk.threads <= 512
        assert lk.smem_bytes <= 227 * 1024
        assert lk.grid(132) == (min(lk.num_tasks, 132), 1, 1)
        # the group's named barrier where its statements share memory (none in y = 2x + 1)
        assert "bar.sync" not in lk.source
        assert ("group_sync<kGroups>" in lk.source) == (ir.name != "scale_shift"), lk.source
        assert "task = (int)blockIdx.x + grp * (int)gridDim.x" in lk.source
    M, N, K = 256, 256, 128
    gemm = gp.gated_gemm.trace(1, S((M, K), tl.float16), S((K, N), tl.float16), S((1, N), tl.float16),
                               S((K, N), tl.float16), S((M, N), tl.float16), compute=tl.ComputeSchedule(tile=(64, 64, 32)))
    lk = lower(gemm, "part")
    assert lk.groups == 1 and lk.block == (lk.threads, 1, 1) and lk.threads == 128


def test_an_explicit_thread_count_is_the_groups():
    lk = lower(gp.scale_shift.trace(1, BIG, BIG, compute=FLAT), "part", threads=256)
    assert lk.threads == 256 and lk.groups == 2 and lk.block == (512, 1, 1)


def test_loads_stores_and_reductions_are_vectorised_in_the_source():
    """Loads and stores move 16-byte chunks of a tile's rows (element by element only at the
    tensor's edges, checked per chunk); a row reduction gives each row 32 lanes of a warp; a
    row-invariant value (rms_norm's 1 / sqrt(mean + eps)) is computed once per row block."""
    src = {ir.name: _lower(ir).source for ir in _memory_bound()}
    for name, s in src.items():
        assert "tldsl::comm::load_chunk<tldsl::comm::f16, 8>" in s, name
        assert "tldsl::comm::store_chunk<tldsl::comm::f16, 8>" in s, name
    for name in ("row_softmax", "rms_norm", "add_rms_norm"):
        assert "TLDSL_REDUCE_LANES(32)" in src[name] and "shfl_xor" in src[name], name
    for name in ("row_softmax", "rms_norm", "add_rms_norm"):      # whole rows: x read once, no loop
        assert not re.search(r"for \(int \w+_\d+ = ", src[name]), name
    wide = S((64, 2 * gp.WHOLE_ROW), tl.float16)                  # rows longer than WHOLE_ROW: two passes
    two = lower(gp.rms_norm.trace(1, wide, S((1, 2 * gp.WHOLE_ROW), tl.float16), wide, compute=ROWS), "part").source
    assert re.search(r"for \(int \w+_\d+ = ", two)
    rsqrt = [ln for ln in two.splitlines() if "tldsl::gen::rsqrt" in ln]
    assert len(rsqrt) == 1
    loop2 = two.rindex("for (int i_")
    assert two.index("tldsl::gen::rsqrt") < loop2      # once per row block, before the second column loop


def test_whole_rows_recompute_cheap_values_and_hold_the_row_in_registers():
    """The row softmax reads t = float(x) and e = exp(t - max) twice each; storing them in shared
    memory (96 KB a row of 8192) would leave two tasks per SM. The cast is computed again where
    read; the exp, costly, is held in registers beside x's row (codegen/plan/held.py) — a task
    of 256 threads holds both, two tasks a CTA —, and shared memory keeps only the two
    reductions' warp results (the row's max, sum and reciprocal: in every thread's registers)."""
    lk = lower(gp.row_softmax.trace(1, BIG, BIG, compute=ROWS, rows=1), "part")
    assert lk.groups == 2 and lk.threads == 256, lk.describe()
    assert len(lk.slots) == 2 and all("(reduce" in s for s in lk.slots), lk.describe()
    assert len(lk.replicated) == 3, lk.describe()      # max, sum, 1 / sum: in every thread's registers
    assert len(lk.held) == 2 and "1x8192 f16 (load" in lk.held[0] and "1x8192 f32 (ewise" in lk.held[1], lk.describe()
    assert lk.source.count("tldsl::gen::exp_(") == 1


@pytest.mark.nvrtc
def test_sass_has_128_bit_global_accesses_shuffles_and_no_spills(tmp_path):
    ok, why = tcm.toolchain_available()
    if not ok:
        pytest.skip(f"CUDA wheels missing (NVRTC compile tests): {why}")
    from tldsl.codegen.toolchain.cache import KernelCache
    from tldsl.codegen.toolchain.compiler import compile_many
    lks = [_lower(ir) for ir in _memory_bound()]
    for lk, ck in zip(lks, compile_many([lk.job() for lk in lks], cache=KernelCache(tmp_path), progress=False)):
        sass = ck.sass()[ck.name]
        assert sass.spill_instructions == 0 and sass.count("BPT.TRAP") == 0, (lk.entry, sass.summary())
        assert sass.count("LDG.E.128") >= 1 and sass.count("STG.E.128") >= 1, (lk.entry, sass.summary())
        if "group_sync<kGroups>" in lk.source:
            assert sass.count("BAR.SYNC") >= 1, lk.entry      # the groups' named barriers
        if lk.entry != "tldsl_scale_shift_part":
            assert sass.count("SHFL.BFLY") >= 1, lk.entry     # warp-shuffle row reductions


@pytest.mark.nvrtc
def test_rows_of_16384_hold_no_more_than_fits_and_do_not_spill(tmp_path):
    """Whole rows of 16384 (the programs' WHOLE_ROW): 512-thread tasks; the residual add +
    RMSNorm holds its loads within HELD_BYTES (with the residual and its f32 cast held as well,
    48 registers of held tiles, it spilled 208 bytes), and the softmax's exp is held or computed
    again — never a 64 KB slot of shared memory (slower than either: BENCHMARKS.md, nineteenth
    session)."""
    ok, why = tcm.toolchain_available()
    if not ok:
        pytest.skip(f"CUDA wheels missing (NVRTC compile tests): {why}")
    from tldsl.codegen.toolchain.cache import KernelCache
    from tldsl.codegen.toolchain.compiler import compile_many
    wide, w = S((256, 16384), tl.float16), S((1, 16384), tl.float16)
    lks = [lower(gp.add_rms_norm.trace(1, wide, wide, w, wide, wide, compute=ROWS, rows=1), "part"),
           lower(gp.row_softmax.trace(1, wide, wide, compute=ROWS, rows=1), "part")]
    assert not any("1x16384 f32" in s for s in lks[1].slots), lks[1].describe()
    for lk, ck in zip(lks, compile_many([lk.job() for lk in lks], cache=KernelCache(tmp_path), progress=False)):
        sass = ck.sass()[ck.name]
        assert sass.spill_instructions == 0, (lk.entry, lk.describe(), sass.summary())


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="the generated code runs on CPU threads")
@pytest.mark.parametrize("name,rows,threads", [("row_softmax", 1, None), ("rms_norm", 1, None),
                                               ("add_rms_norm", 2, 256), ("row_softmax", 1, 256)])
def test_whole_rows_reduced_by_several_warps_match_the_simulator(tmp_path, name, rows, threads):
    """A row reduction with fewer outputs than warps splits each row between warps whose partial
    results meet in shared memory (plan.general.reduce_partials): run on CPU threads, it agrees
    with the simulator (rows of 300, not a multiple of the warps' 32-element steps)."""
    import numpy as np
    from test_codegen_general import _stored_inputs, emulate, inputs_for
    from tldsl.codegen.plan.general import reduce_partials
    from tldsl.testing.program_tolerance import assert_agrees, reference_with_tolerances
    M, N = 37, 300
    x, w = S((M, N), tl.float16), S((1, N), tl.float16)
    specs = {"row_softmax": (x, x), "rms_norm": (x, w, x), "add_rms_norm": (x, x, w, x, x)}[name]
    k = getattr(gp, name).trace(1, *specs, compute=ROWS, rows=rows)
    lk = lower(k, "part", **({"threads": threads} if threads else {}))
    reduces = [op for op in k.parts[0].walk() if op.name == "reduce"]
    assert reduces and all(reduce_partials(op, lk.threads) > 1 for op in reduces)
    assert "warps an output" in lk.source
    arrays = inputs_for(k, np.random.default_rng(11))
    want, tolerances = reference_with_tolerances(k, 1, [dict(arrays)])
    assert_agrees([emulate(k, lk, _stored_inputs(k, arrays), tmp_path, threads=lk.threads)], want, tolerances)


def test_a_per_row_scale_broadcast_over_the_row_is_computed_once():
    """``rsqrt(sum(x * x) / N + eps)`` — two divisions and a square root — is a 1-element value
    broadcast over its 8192-element row: computed once per task (into a register of every
    thread), not again for each element it scales; a cast broadcast the same way (cheap) still is."""
    x, w = S((16384, 8192), tl.float16), S((1, 8192), tl.float16)
    lk = lower(gp.rms_norm.trace(1, x, w, x, compute=ROWS, rows=1), "part")
    assert any("1 f32 (ewise" in s for s in lk.replicated), lk.describe()   # every thread computes it once
    assert lk.source.count("tldsl::gen::rsqrt(") == 1
    chunk_loop = lk.source[lk.source.index("chunks of 8 from registers"):]
    assert "rsqrt" not in chunk_loop and "div(" not in chunk_loop
