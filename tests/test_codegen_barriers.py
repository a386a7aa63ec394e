"""Where the general lowering puts its group barriers (codegen/rules/barriers.py): between two
statements touching the same memory, one writing — and only there."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen import lower
from tldsl.codegen.rules.barriers import EVERYTHING, BarrierTracker, conflict, slot_access, tensor_access
from tldsl.codegen.rules.tile_ops import BARRIER
from programs import scale_rows

S = tl.TensorSpec

A_W, A_R = slot_access("arena", 0, 64, "w"), slot_access("arena", 0, 64, "r")
B_W = slot_access("arena", 64, 64, "w")
X_R, X_W = tensor_access(1, "r"), tensor_access(1, "w")


def test_conflicts_are_overlapping_accesses_one_of_them_a_write():
    assert conflict({A_W}, {A_R}) and conflict({A_R}, {A_W}) and conflict({A_W}, {A_W})
    assert not conflict({A_R}, {A_R})                       # two reads
    assert not conflict({A_W}, {B_W})                       # neighbouring slots
    assert conflict({slot_access("arena", 0, 65, "r")}, {B_W})   # one byte shared
    assert not conflict({slot_access("scratch", 0, 64, "w")}, {A_W})
    assert conflict({X_R}, {X_W}) and not conflict({X_R}, {tensor_access(2, "w")})
    assert conflict({X_W}, {X_W}) and not conflict({X_W}, {X_W}, tensor_writes=False)
    assert conflict({EVERYTHING}, {X_R}) and not conflict({EVERYTHING}, set())


def test_a_barrier_only_before_a_statement_meeting_what_is_pending():
    t = BarrierTracker()
    assert not t.before({A_W}); t.after({A_W}, False)
    assert not t.before({B_W}); t.after({B_W}, False)       # another slot: no barrier
    assert t.before({A_R}); t.after({A_R}, False)           # reads A written before: barrier
    assert t.pending == {A_R}
    assert not t.before({A_R}); t.after({A_R}, False)       # reading again: none
    assert t.before({A_W})                                  # overwriting what was read: barrier


def test_a_statement_with_barriers_of_its_own_leaves_its_accesses_pending():
    t = BarrierTracker()
    t.before({A_W}); t.after({A_W}, True)
    assert t.pending == {A_W} and not t.prefix_open
    assert t.prefix == {A_W}


def test_opaque_statements_flush_and_leave_nothing_pending():
    t = BarrierTracker()
    assert not t.opaque()                                   # nothing pending: no barrier before
    t.before({A_W}); t.after({A_W}, False)
    assert t.opaque() and t.pending == set()


def test_a_loop_body_ends_with_a_barrier_where_anything_is_pending():
    t = BarrierTracker()
    t.before({A_W}); t.after({A_W}, False)
    t.enter()
    assert t.before({B_W}) is False; t.after({B_W}, False)
    assert t.leave(loop=True)                               # B pending at the body's end
    assert t.pending == {A_W}                               # what was pending before stays
    t.enter()
    t.after(set(), False)
    assert not t.leave(loop=False)                          # an if: no barrier at its end
    assert t.before({A_R})


def test_the_task_end_checks_only_what_the_next_task_touches_first():
    t = BarrierTracker()
    t.before({A_W}); t.after({A_W}, True)                   # a reduction into A: its own barrier
    t.before({B_W}); t.after({B_W}, True)                   # another into B
    t.before({X_W}); t.after({X_W}, False)                  # the store
    assert not t.task_end()                                 # next task: A written first, then its barrier
    t1 = BarrierTracker()
    t1.before({A_W}); t1.after({A_W}, True)                 # one reduction only: its warp results are
    t1.before({X_W}); t1.after({X_W}, False)                # still read when the next task writes them
    assert t1.task_end()
    t2 = BarrierTracker()
    t2.before({B_W}); t2.after({B_W}, False)                # B written before any barrier ...
    t2.before({X_W}); t2.after({X_W}, False)
    assert t2.task_end()                                    # ... and by the next task's first statement
    t3 = BarrierTracker()
    t3.before({X_W}); t3.after({X_W}, False)                # a store of each task, nothing else
    assert not t3.task_end()


@tl.kernel
def sum_then_scale(x, y, *, compute: tl.ComputeSchedule = None):
    """A row sum (a slot) read by the next statement: a barrier between them, none elsewhere."""
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        t = tl.load(x, (pm * BM, 0), (BM, N))
        s = tl.sum(t, axis=1)
        tl.store(y, (pm * BM, 0), t * tl.expand_dims(s, 1))


def test_an_elementwise_part_has_no_barrier():
    k = scale_rows.trace(1, S((512, 512), tl.float16), S((512, 512), tl.float16),
                         compute=tl.ComputeSchedule(tile=(16, 256, 16)))
    lk = lower(k, "part")
    assert BARRIER not in lk.source, lk.source


def test_a_slot_read_by_the_next_statement_has_a_barrier_between():
    k = sum_then_scale.trace(1, S((256, 64), tl.float32), S((256, 64), tl.float32),
                             compute=tl.ComputeSchedule(tile=(16, 64, 16)))
    lk = lower(k, "part", threads=64)
    src = lk.source
    red, store = src.index("sum over"), src.index("store -> y")
    assert BARRIER in src[red:store], src


@tl.kernel
def write_then_index(t, y, *, compute: tl.ComputeSchedule = None):
    """Each task writes a table, then reads an entry of it as a scalar: a barrier between."""
    M, N = y.shape

    @tl.compute_part(grid=(M // 16,))
    def part(pm):
        tl.store(t, (pm * 16,), tl.full((16,), 3, tl.int32))
        k = tl.load_scalar(t, (pm * 16,))
        tl.store(y, (pm * 16, 0), tl.full((16, N), 1.0, tl.float32) * k)


def test_a_table_read_after_the_part_writes_it_has_a_barrier_before():
    k = write_then_index.trace(1, S((64,), tl.int32), S((64, 32), tl.float32))
    src = lower(k, "part", threads=64).source
    write, read = src.index("store -> t"), src.index("tbl_t[")
    assert BARRIER in src[write:read], src



@tl.kernel
def stage_then_swap(x, y, *, compute: tl.ComputeSchedule = None):
    """A tile stored in shared memory, read transposed by other threads, then its slot reused:
    barriers for the read after the write and for the write after the read."""
    M, N = x.shape

    @tl.compute_part(grid=(M // 32,))
    def part(pm):
        t = tl.load(x, (pm * 32, 0), (32, 32)) * 2.0
        u = tl.trans(t) + t
        s = tl.sum(u, axis=1)
        tl.store(y, (pm * 32, 0), u * tl.expand_dims(s, 1))


def _tsan_case(name: str):
    """(traced kernel, lowering threads or None) of one of :data:`TSAN_CASES`."""
    from tldsl.bench import general_programs as gp
    rows = tl.ComputeSchedule(tile=(16, 256, 16))
    x, w = S((12, 256), tl.float16), S((1, 256), tl.float16)
    wide = S((5, 300), tl.float16)
    return {
        "row_softmax": lambda: (gp.row_softmax.trace(1, x, x, compute=rows, rows=1), None),
        "rms_norm": lambda: (gp.rms_norm.trace(1, x, w, x, compute=rows, rows=1), None),
        "add_rms_norm": lambda: (gp.add_rms_norm.trace(1, x, x, w, x, x, compute=rows, rows=1), None),
        "row_softmax_300": lambda: (gp.row_softmax.trace(1, wide, wide, compute=rows, rows=1), 256),
        "sum_then_scale": lambda: (sum_then_scale.trace(1, S((48, 64), tl.float32), S((48, 64), tl.float32),
                                                        compute=tl.ComputeSchedule(tile=(16, 64, 16))), 64),
        "write_then_index": lambda: (write_then_index.trace(1, S((64,), tl.int32), S((64, 32), tl.float32)), 64),
        "stage_then_swap": lambda: (stage_then_swap.trace(1, S((96, 32), tl.float32), S((96, 32), tl.float32)), 64),
    }[name]()


TSAN_CASES = ("row_softmax", "rms_norm", "add_rms_norm", "row_softmax_300", "sum_then_scale", "write_then_index",
              "stage_then_swap")


@pytest.mark.skipif(shutil.which("g++") is None, reason="the generated code runs on CPU threads")
@pytest.mark.parametrize("name", TSAN_CASES)
def test_kernels_under_thread_sanitizer_have_no_race_and_agree(tmp_path, name):
    """The generated kernels on CPU threads built with ThreadSanitizer, one CTA taking every task
    in turn (so a task's statements meet the next task's too): no race between the group's
    threads — the barriers the lowering left out were not needed — and the simulator's result."""
    from test_codegen_general import _stored_inputs, emulate, inputs_for
    from tldsl.testing.program_tolerance import assert_agrees, reference_with_tolerances
    k, threads = _tsan_case(name)
    lk = lower(k, "part", **({"threads": threads} if threads else {}))
    arrays = inputs_for(k, np.random.default_rng(3))
    want, tolerances = reference_with_tolerances(k, 1, [dict(arrays)])
    got = emulate(k, lk, _stored_inputs(k, arrays), tmp_path, threads=lk.threads, grid=1, sanitize=True)
    assert_agrees([got], want, tolerances)


def _fuzzed_signal_free_programs(seed: int = 2026, n: int = 800, others: int = 6):
    """The fuzzer's programs (``seed``, the first ``n``) whose parts all go through the general
    lowering and that link no parts by signals (ThreadSanitizer does not model the fences of the
    signal protocol): every one whose kernels keep values in every thread's registers, and the
    first ``others`` with slots in shared memory."""
    from tldsl.codegen.recipes.general import LoweredGeneral
    from tldsl.testing.program_case import FuzzCase
    from tldsl.testing.program_families import generate_distinct
    picked, plain = [], 0
    for i, p in generate_distinct(n, seed):
        case = FuzzCase(p, f"fuzz seed {seed} program {i}")
        k = case.trace()
        if k.signals:
            continue
        lks = [lower(k, q.name) for q in k.parts]
        if not all(isinstance(lk, LoweredGeneral) for lk in lks):
            continue
        if any(lk.replicated for lk in lks):
            picked.append((i, case, k, lks))
        elif any(lk.slots for lk in lks) and plain < others:
            picked.append((i, case, k, lks))
            plain += 1
    return picked


@pytest.mark.skipif(shutil.which("g++") is None, reason="the generated code runs on CPU threads")
def test_fuzzed_programs_under_thread_sanitizer_have_no_race_and_agree(tmp_path):
    """The fuzzer's signal-free general-lowering programs, every rank's kernels on CPU threads
    built with ThreadSanitizer, one CTA each: no race, and the simulator's outputs within the
    fuzzer's tolerances."""
    from test_codegen_general import emulate_kernel
    picked = _fuzzed_signal_free_programs()
    assert sum(any(lk.replicated for lk in lks) for _, _, _, lks in picked) >= 3, [i for i, *_ in picked]
    poison = {"f16": np.float16, "f32": np.float32, "bf16": np.float32}
    for i, case, k, lks in picked:
        arrays = []
        for r in range(k.world_size):
            d = {n: np.array(a, copy=True) for n, a in case.inputs[r].items()}
            for b in k.buffers:         # workspaces, poisoned as the simulator leaves them unwritten
                if b.name not in d:
                    dt = b.type.dtype.name
                    d[b.name] = np.full(b.type.shape, np.nan, poison[dt]) if dt in poison else \
                        np.full(b.type.shape, -0x5A5A5A5A, np.int32)
            arrays.append(d)
        got = emulate_kernel(k, lks, arrays, tmp_path / str(i), grid=1, sanitize=True)
        want, _ = case.reference()
        assert not case.mismatches(want.outputs, got), (i, case.source)
