"""Programs and inputs tldsl must reject, with messages that point at the problem.

``tests/rejected/`` holds small tile programs, one mistake each (Halide's test/error idea).
Every file defines one ``@tl.kernel``, a ``trace()`` that traces it, ``ERROR`` (the exact
error type) and ``MESSAGE`` (a fragment of the message), and marks the offending line with
``# <-- error``. Tracing must raise that error, and its message must name the file and line
and show the line with a caret under it.

The second half checks ``tl.simulate``'s input validation: bad world sizes and per-rank
inputs raise :class:`tl.InputError` naming the problem, before anything is traced or run.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

import tldsl as tl
from tldsl.kernel import KernelFunction

REJECTED = Path(__file__).resolve().parent / "rejected"
MARK = "# <-- error"
FILES = sorted(REJECTED.glob("*.py"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"rejected_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rejected_folder_is_populated():
    # a glob that silently finds nothing would make the parametrized test below vacuous
    assert len(FILES) >= 15, [f.name for f in FILES]


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_rejected_program(path: Path):
    module = _load(path)
    assert module.__doc__, f"{path.name}: say in a docstring what is wrong with the program"
    assert isinstance(module.ERROR, type) and issubclass(module.ERROR, tl.TldslError), path.name
    assert isinstance(module.MESSAGE, str) and module.MESSAGE, path.name
    kernels = [v for v in vars(module).values() if isinstance(v, KernelFunction)]
    assert len(kernels) == 1, f"{path.name}: define exactly one @tl.kernel, found {len(kernels)}"

    source = path.read_text().splitlines()
    marked = [i + 1 for i, line in enumerate(source) if line.rstrip().endswith(MARK)]
    assert len(marked) == 1, f"{path.name}: mark exactly one line with '{MARK}'"
    lineno = marked[0]

    with pytest.raises(tl.TldslError) as info:
        module.trace()
    err = info.value
    message = str(err)
    assert type(err) is module.ERROR, f"{path.name}: raised {type(err).__name__}, expected " \
                                      f"{module.ERROR.__name__}:\n{message}"
    assert module.MESSAGE in message, f"{path.name}: message lacks {module.MESSAGE!r}:\n{message}"

    # file:line of the user's code, then the line itself, then a caret under it
    assert f"{path}:{lineno}:" in message, \
        f"{path.name}: the message does not name {path.name}:{lineno}:\n{message}"
    lines = message.splitlines()
    src = source[lineno - 1].rstrip()
    shown = [i for i, line in enumerate(lines) if line.strip() == src.strip()]
    assert shown, f"{path.name}: the message does not show line {lineno} ({src.strip()!r}):\n{message}"
    i = shown[0]
    assert i + 1 < len(lines) and re.fullmatch(r" *\^", lines[i + 1]), \
        f"{path.name}: no caret line under the source line:\n{message}"
    col = len(lines[i + 1]) - 1
    assert col < len(lines[i]) and not lines[i][col].isspace(), \
        f"{path.name}: the caret points at blank space:\n{message}"


# -- tl.simulate input validation ---------------------------------------------------------------

@tl.kernel
def gather_scale(a: tl.Symmetric, scale, out):
    """out = 2 * scale[0] * all_gather(a) on every rank (a: [R, C] shard, out: [W*R, C])."""
    W = tl.world_size()
    R, C = a.shape
    gathered = tl.local_buffer((W * R, C), a.dtype, "gathered")
    ready = tl.signal("ready", W)

    @tl.comm_part(grid=(W,), name="gather")
    def gather(step):
        peer = (tl.rank() + step) % W
        tl.tile_pull_data(a.at(peer), (0, 0), (R, C), gathered, (peer * R, 0))
        tl.producer_tile_notify(ready, peer)

    @tl.compute_part(grid=(W,), name="scale")
    def scale_rows(q):
        tl.consumer_tile_wait(ready, q)
        s = tl.load(scale, (0,), (C,))
        tl.store(out, (q * R, 0), tl.load(gathered, (q * R, 0), (R, C)) * s[None, :] * 2.0)


def _inputs(W, R=3, C=4, dtype=np.float32):
    # a different scale per column (so dropping it or mixing columns shows); out poisoned (NaN)
    rng = np.random.default_rng(7)
    return [{"a": rng.standard_normal((R, C)).astype(dtype), "scale": np.linspace(0.5, 2.0, C).astype(dtype),
             "out": np.full((W * R, C), np.nan, dtype)} for _ in range(W)]


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if simulate gets as far as tracing the kernel or building the engine."""
    def no_trace(self, *a, **k):
        raise AssertionError("the kernel was traced before the inputs were rejected")

    class NoEngine:
        def __init__(self, *a, **k):
            raise AssertionError("the simulator started before the inputs were rejected")

    # (the package re-exports the function `simulate` under the module's name: fetch the module)
    sim_module = importlib.import_module("tldsl.runtime.sim.simulate")
    monkeypatch.setattr(KernelFunction, "trace", no_trace)
    monkeypatch.setattr(sim_module, "Engine", NoEngine)


def test_valid_inputs_run():
    # the control: the same kernel and inputs, unbroken, simulate and compute the right thing
    inputs = _inputs(3)
    res = tl.simulate(gather_scale, 3, inputs, seed=1)
    gathered = np.concatenate([x["a"] for x in inputs])
    for r in range(3):
        want = 2 * inputs[r]["scale"][None, :] * gathered
        assert not np.isnan(res[r]["out"]).any(), f"rank {r}: elements of 'out' left unwritten"
        np.testing.assert_allclose(res[r]["out"], want, rtol=1e-6)


@pytest.mark.parametrize("world_size", [0, -1, -4])
def test_world_size_must_be_positive(nothing_runs, world_size):
    with pytest.raises(tl.InputError, match=rf"world size must be a positive int, got {world_size}"):
        tl.simulate(gather_scale, world_size, _inputs(2))


def test_world_size_must_be_an_int(nothing_runs):
    with pytest.raises(tl.InputError, match=r"world size must be a positive int, got 2\.0"):
        tl.simulate(gather_scale, 2.0, _inputs(2))


def test_a_numpy_world_size_is_the_int_it_stands_for():
    """np.int64(1) passed the Integral check but stayed numpy: the estimates became numpy, the
    progress switch np.False_ (called as a function: TypeError), and the trace cached under the
    equal key 1 broke every later call with the plain int too."""
    from tldsl.runtime.sim.options import SimOptions
    from tldsl.runtime.sim.simulate import _reporter

    @tl.kernel
    def double(x, y):
        @tl.compute_part(grid=(1,))
        def t(i):
            tl.store(y, (0,), tl.load(x, (0,), (4,)) * 2.0)
    x = np.arange(4, dtype=np.float32)
    for ws in (np.int64(1), 1, np.int32(1)):
        res = tl.simulate(double, ws, [{"x": x, "y": np.zeros(4, np.float32)}])
        np.testing.assert_array_equal(res[0]["y"], 2 * x)
        assert type(res.kernel.world_size) is int
    assert type(double.trace(np.int64(2), tl.TensorSpec((4,), tl.float32),
                             tl.TensorSpec((4,), tl.float32)).world_size) is int
    assert _reporter(SimOptions(), 10, np.False_, 1) is None        # a numpy "not long": no reporter


@pytest.mark.parametrize("given", [1, 3])
def test_one_input_per_rank(nothing_runs, given):
    with pytest.raises(tl.InputError, match=rf"got inputs for {given} ranks but world_size is 2"):
        tl.simulate(gather_scale, 2, _inputs(given))


def test_inputs_must_be_a_list_per_rank(nothing_runs):
    with pytest.raises(tl.InputError, match="one entry per rank, not a single dict"):
        tl.simulate(gather_scale, 2, _inputs(2)[0])


def test_missing_argument(nothing_runs):
    inputs = _inputs(2)
    del inputs[1]["scale"]
    with pytest.raises(tl.InputError, match=r"rank 1: missing argument\(s\) \['scale'\]"):
        tl.simulate(gather_scale, 2, inputs)


def test_unknown_argument(nothing_runs):
    inputs = _inputs(2)
    inputs[0]["bias"] = np.zeros(4, np.float32)
    with pytest.raises(tl.InputError, match=r"rank 0: unknown argument\(s\) \['bias'\]"):
        tl.simulate(gather_scale, 2, inputs)


def test_a_misspelt_argument_is_named_both_ways(nothing_runs):
    """A misspelt name is a missing argument and an unknown one: both are said (the unknown one,
    the misspelling, was left out while anything was missing)."""
    inputs = _inputs(2)
    inputs[0]["scael"] = inputs[0].pop("scale")
    with pytest.raises(tl.InputError, match=r"rank 0: missing argument\(s\) \['scale'\] and unknown argument\(s\) "
                                            r"\['scael'\]"):
        tl.simulate(gather_scale, 2, inputs)


def test_a_meta_tensor_is_named_as_having_no_values(nothing_runs):
    """Found by a user's round: torch's own NotImplementedError, from deep inside the copy, before."""
    torch = pytest.importorskip("torch")
    inputs = _inputs(2)
    inputs[1]["scale"] = torch.empty(inputs[1]["scale"].shape, dtype=torch.float32, device="meta")
    with pytest.raises(tl.InputError, match="argument 'scale' on rank 1 is a tensor on torch's meta device"):
        tl.simulate(gather_scale, 2, inputs)


def test_wrong_number_of_positional_arrays(nothing_runs):
    inputs = [[x["a"], x["out"]] for x in _inputs(2)]
    with pytest.raises(tl.InputError, match=r"rank 0: 2 arrays for arguments \['a', 'scale', 'out'\]"):
        tl.simulate(gather_scale, 2, inputs)


def test_symmetric_buffer_shapes_must_agree(nothing_runs):
    inputs = _inputs(3)
    inputs[2]["a"] = np.zeros((5, 4), np.float32)
    with pytest.raises(tl.InputError) as info:
        tl.simulate(gather_scale, 3, inputs)
    msg = str(info.value)
    assert "non-uniform symmetric buffer 'a'" in msg
    assert "(3, 4) on rank 0 but (5, 4) on rank 2" in msg
    assert "same shape on every rank" in msg


def test_plain_argument_shapes_must_agree(nothing_runs):
    inputs = _inputs(2)
    inputs[1]["scale"] = np.zeros(6, np.float32)
    with pytest.raises(tl.InputError, match=r"non-uniform argument 'scale': shape \(4,\) on rank 0 but \(6,\) on rank 1"):
        tl.simulate(gather_scale, 2, inputs)


def test_dtypes_must_agree_across_ranks(nothing_runs):
    inputs = _inputs(2)
    inputs[1]["a"] = inputs[1]["a"].astype(np.float16)
    with pytest.raises(tl.InputError, match="argument 'a': dtype float32 on rank 0 but float16 on rank 1"):
        tl.simulate(gather_scale, 2, inputs)


def test_unsupported_dtype(nothing_runs):
    inputs = [{k: v.astype(np.float64) for k, v in x.items()} for x in _inputs(2)]
    with pytest.raises(tl.InputError, match="argument 'a': unsupported dtype"):
        tl.simulate(gather_scale, 2, inputs)


def test_non_array_argument(nothing_runs):
    inputs = _inputs(2)
    for x in inputs:
        x["scale"] = [0.5] * 4
    with pytest.raises(tl.InputError, match="argument 'scale' on rank 0 is a list, not an array"):
        tl.simulate(gather_scale, 2, inputs)


def test_every_ranks_argument_is_checked_naming_the_rank(nothing_runs):
    """A list, an unsupported dtype or a tl.TensorSpec on a rank other than 0 was a misleading
    'non-uniform argument ... () on rank 1', a bare TypeError, or a TypeError from the copy."""
    cases = [([0.5] * 4, "argument 'scale' on rank 1 is a list, not an array"),
             (np.zeros(4), r"argument 'scale' on rank 1: unsupported dtype float64"),
             (tl.TensorSpec((4,), tl.float32), r"argument 'scale' on rank 1 is a tl.TensorSpec: it has a shape and "
                                               r"a dtype but no values to run on")]
    for bad, message in cases:
        inputs = _inputs(2)
        inputs[1]["scale"] = bad
        with pytest.raises(tl.InputError, match=message):
            tl.simulate(gather_scale, 2, inputs)
    inputs = _inputs(2)
    inputs[0]["a"] = tl.TensorSpec(inputs[0]["a"].shape, tl.float32)
    with pytest.raises(tl.InputError, match=r"argument 'a' on rank 0 is a tl.TensorSpec.*pass an array"):
        tl.simulate(gather_scale, 2, inputs)


def test_a_sparse_tensor_is_refused_as_not_dense(nothing_runs):
    """A torch sparse tensor was a TypeError from numpy's copy (tl.simulate) or a RuntimeError
    from torch's (tl.run)."""
    torch = pytest.importorskip("torch")
    inputs = _inputs(2)
    inputs[1]["a"] = torch.from_numpy(inputs[1]["a"]).to_sparse()
    with pytest.raises(tl.InputError, match=r"argument 'a' on rank 1 is a torch tensor of layout torch.sparse_coo: "
                                            r"tldsl runs on dense \(strided\) tensors; pass .to_dense\(\) of it"):
        tl.simulate(gather_scale, 2, inputs)
    with pytest.raises(tl.InputError, match="layout torch.sparse_coo"):
        tl.run(gather_scale, 2, inputs)


@tl.kernel
def broadcast_scalar(s, y, *, compute: tl.ComputeSchedule = None):
    @tl.compute_part(grid=(1,))
    def part(p):
        tl.store(y, (0,), tl.full((8,), tl.load_scalar(s, ()), tl.int32))


def test_a_zero_dimensional_tensor_is_refused_by_the_simulator_and_tl_run_alike():
    """A 0-d argument simulated, but the GPU's lowering emitted ``tbl_s[]`` (a CudaCompileError)
    and tl.run returned it with shape (1,)."""
    ins = [{"s": np.array(7, np.int32), "y": np.zeros(8, np.int32)}]
    message = r"argument 's': shape \(\) is a 0-d tensor, which a tile program cannot index: pass shape \(1,\)"
    for call in (tl.simulate, tl.run):
        with pytest.raises(tl.InputError, match=message):
            call(broadcast_scalar, 1, ins)
    with pytest.raises(tl.InputError, match=r"^tl.TensorSpec: shape \(\) is a 0-d tensor"):
        broadcast_scalar.trace(1, tl.TensorSpec((), tl.int32), tl.TensorSpec((8,), tl.int32))


def test_dimensions_and_grids_past_32_bit_indices_are_refused():
    """Offsets are i32 and the GPU passes a row's length as an int: a 3e9-long vector read zeros on
    the GPU (its length wrapped negative) while the simulator computed it; a grid of 2**32 tasks
    lowered to ``task < 4294967296``. Refused where they are made (nothing is allocated here)."""
    with pytest.raises(tl.InputError, match=r"^tl.TensorSpec: shape \(3000000000,\): dimension 0 is 3,000,000,000, "
                                            r"but kernels index each dimension with 32-bit ints"):
        tl.TensorSpec((3_000_000_000,), tl.float16)
    with pytest.raises(tl.InputError, match=r"shape \(4, 2147483648\): dimension 1"):
        tl.TensorSpec((4, 2 ** 31), tl.float16)
    tl.TensorSpec((70_000, 40_000), tl.float16)    # 2.8e9 elements: rows are offset in 64 bits
    tl.TensorSpec((2 ** 31 - 1,), tl.float16)

    @tl.kernel
    def tiled(y, *, n: tl.constexpr = 1):
        @tl.compute_part(grid=(n, n))
        def part(i, j):
            pass
    with pytest.raises(tl.CompilationError, match=r"a part's grid \(65536, 65536\) has 4,294,967,296 tasks, but "
                                                  r"program ids and task counters are 32-bit ints") as info:
        tiled.trace(1, tl.TensorSpec((4,), tl.float32), n=2 ** 16)
    assert info.value.loc.filename == __file__
    tiled.trace(1, tl.TensorSpec((4,), tl.float32), n=2 ** 14)

    @tl.kernel
    def big_scratch(y):
        tl.local_buffer((2 ** 31,), tl.float16)
    with pytest.raises(tl.CompilationError, match=r"buffer 'scratch' of shape \(2147483648,\): .* below 2\*\*31"):
        big_scratch.trace(1, tl.TensorSpec((4,), tl.float32))


def test_a_traced_kernel_refuses_arrays_of_other_dtypes_than_it_was_traced_for():
    """Simulating a traced kernel: an int32 array where it was traced for f16 (or a float32 one for
    i32) is an InputError naming the argument, not values converted silently (70000 -> f16's inf).
    A float32 array may stand for bf16, which numpy cannot hold."""
    @tl.kernel
    def added(a, idx, out):
        @tl.compute_part(grid=(1,))
        def v(p):
            n = tl.load_scalar(idx, (0,))
            tl.store(out, (0,), tl.load(a, (0,), (4,)) + tl.full((4,), n, a.dtype))

    S = tl.TensorSpec
    f16 = added.trace(1, S((4,), tl.float16), S((1,), tl.int32), S((4,), tl.float16))
    out = np.full(4, np.nan, np.float16)
    with pytest.raises(tl.InputError, match="argument 'a': dtype i32, the kernel was traced for f16"):
        tl.simulate(f16, 1, [{"a": np.array([70000, 1, 2, 3], np.int32), "idx": np.array([2], np.int32), "out": out}])
    with pytest.raises(tl.InputError, match="argument 'idx': dtype f32, the kernel was traced for i32"):
        two = added.trace(2, S((4,), tl.float16), S((1,), tl.int32), S((4,), tl.float16))
        bad = {"a": np.ones(4, np.float16), "idx": np.array([2.7], np.float32), "out": out}
        tl.simulate(two, 2, [bad, bad])
    bf16 = added.trace(1, S((4,), tl.bfloat16), S((1,), tl.int32), S((4,), tl.bfloat16))
    got = tl.simulate(bf16, 1, [{"a": np.ones(4, np.float32), "idx": np.array([2], np.int32),
                                 "out": np.full(4, np.nan, np.float32)}])[0]["out"]
    assert (got == 3).all()
    with pytest.raises(tl.InputError, match=r"traced for bf16 \(or float32 holding bf16 values\)"):
        tl.simulate(bf16, 1, [{"a": np.ones(4, np.float16), "idx": np.array([2], np.int32), "out": out}])


def test_minimum_and_maximum_take_fragments_and_refuse_what_is_not_a_number():
    """The online-softmax update ``m.write(tl.maximum(m, row_max))`` on a fragment; a string is a
    CompilationError, not Python's TypeError from ``max``."""
    @tl.kernel
    def clamped(x, out):
        @tl.compute_part(grid=(1,))
        def v(p):
            m = tl.fragment((8,), tl.float32, fill=-1.0)
            m.write(tl.maximum(m, tl.load(x, (0,), (8,))))
            m.write(tl.minimum(0.5, m))
            tl.store(out, (0,), m)

    x = np.array([-3, -0.5, 0, 0.25, 1, 2, -1, 0.5], np.float32)
    got = tl.simulate(clamped, 1, [{"x": x, "out": np.full(8, np.nan, np.float32)}])[0]["out"]
    np.testing.assert_array_equal(got, np.minimum(0.5, np.maximum(-1.0, x)))
    with pytest.raises(tl.CompilationError, match="tl.maximum takes tiles, fragments, traced scalars or Python "
                                                  "numbers, got str and int"):
        tl.maximum("a", 1)
    with pytest.raises(tl.CompilationError, match=r"cdiv\(5, 0\): dividing by zero"):
        tl.cdiv(5, 0)


def test_tile_shapes_may_be_lists_and_buffers_one_int():
    """``tl.full([8], ...)``, ``tl.fragment([8])`` and ``tl.local_buffer(8, ...)`` as their tuple forms."""
    @tl.kernel
    def listed(out):
        buf = tl.local_buffer(8, tl.int32, "scratch")

        @tl.compute_part(grid=(1,))
        def v(p):
            f = tl.fragment([8], tl.int32, fill=2)
            f.write(f + tl.full([8], 3, tl.int32))
            tl.store(buf, (0,), f)
            tl.store(out, (0,), tl.load(buf, (0,), (8,)))

    got = tl.simulate(listed, 1, [{"out": np.zeros(8, np.int32)}])[0]["out"]
    assert (got == 5).all()


def test_schedule_errors_point_at_the_users_line_through_with_():
    """A schedule derived with ``with_`` (dataclasses.replace underneath) reports the caller's
    line, not the standard library's — also for a field the schedule does not have."""
    base = tl.CommSchedule(engine="copy_engine", mode="push")
    with pytest.raises(tl.ScheduleError, match="CommSchedule has no field 'tile'; its fields: tile_m,") as info:
        base.with_(tile=(64, 64, 32))
    assert info.value.loc is not None and info.value.loc.filename == __file__
    with pytest.raises(tl.ScheduleError) as info:
        base.with_(engine="sm", col_tile=1024)          # the line the error must name
    err = info.value
    assert "column slices are the copy-engine all-gather's" in str(err)
    assert err.loc is not None and err.loc.filename == __file__
    assert "base.with_(engine=\"sm\", col_tile=1024)" in err.loc.source


def test_common_slips_get_tldsl_errors_not_python_ones():
    """Swapped schedules, lower() on the undecorated-trace kernel function or an unknown part,
    and a numpy dtype tldsl has not: each a tldsl error that says what to do."""
    from tldsl.codegen import lower

    @tl.kernel
    def copy(x, y, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
        @tl.compute_part(grid=(1,))
        def t(i):
            tl.store(y, (0,), tl.cast(tl.load(x, (0,), (4,)), np.float64))

    f32 = tl.TensorSpec((4,), tl.float32)
    with pytest.raises(tl.InputError, match=r"compute= takes a tl.ComputeSchedule, got CommSchedule "
                                            r"\(compute and comm swapped\?\)"):
        copy.trace(1, f32, f32, compute=tl.CommSchedule(), comm=tl.ComputeSchedule(tile=(16, 16, 16)))
    with pytest.raises(tl.CompilationError, match="tl.cast: unsupported dtype float64"):
        copy.trace(1, f32, f32)
    with pytest.raises(tl.CompilationError, match="lower\\(\\) takes a traced kernel .* got KernelFunction"):
        lower(copy, "t")

    @tl.kernel
    def fine(x, y):
        @tl.compute_part(grid=(1,))
        def t(i):
            tl.store(y, (0,), tl.load(x, (0,), (4,)))
    with pytest.raises(tl.CompilationError, match=r"kernel 'fine' has no part 'nosuch'; its parts: 't' \(compute\)"):
        lower(fine.trace(1, f32, f32), "nosuch")


def test_simulate_takes_options_as_a_dict_and_refuses_anything_else_clearly():
    import numpy as np
    from tldsl.ops.gemm import gemm
    a = np.ones((16, 16), np.float16)
    inputs = [{"a": a, "b": a, "c": np.full((16, 16), np.nan, np.float16)}]
    sched = tl.ComputeSchedule(tile=(16, 16, 16))
    res = tl.simulate(gemm, 1, inputs, compute=sched, options={"launches": 1})
    assert res.launches == 1 and np.allclose(res[0]["c"], 16.0)
    with pytest.raises(tl.InputError, match=r"unknown simulator option\(s\) \['launchs'\]"):
        tl.simulate(gemm, 1, inputs, compute=sched, options={"launchs": 1})
    with pytest.raises(tl.InputError, match="launches must be a positive int"):
        tl.simulate(gemm, 1, inputs, compute=sched, options={"launches": 0})
    with pytest.raises(tl.InputError, match="options must be a tl.SimOptions"):
        tl.simulate(gemm, 1, inputs, compute=sched, options=["launches"])


@pytest.mark.parametrize("a_shards, b, message", [
    ([], np.ones((8, 8), np.float16), "a non-empty list"),
    (np.ones((8, 8), np.float16), np.ones((8, 8), np.float16), "got ndarray"),
    ([np.ones(8, np.float16)], np.ones((8, 8), np.float16), r"a_shards\[0\] must be a 2-d array, got shape \(8,\)"),
    ([np.ones((8, 8), np.float16)], np.ones(8, np.float16), r"b\[0\] must be a 2-d array"),
    # these were CompilationErrors at the op's own lines (its static_assert, tl.dot, its gathered
    # buffer's shape), the last not saying which argument was wrong
    ([np.ones((32, 32), np.float16)] * 2, np.ones((16, 32), np.float16),
     re.escape("b is [16, 32] but the A shards are [32, 32]: B must be [32, N]")),
    ([np.ones((32, 32), np.float16)] * 2, [np.ones((32, 8), np.float16), np.ones((16, 8), np.float16)],
     re.escape("b[1] is [16, 8] but the A shards are [32, 32]")),
    ([np.ones((32, 32), np.float16)] * 2, np.ones((32, 32), np.float32),
     "b is f32 but the A shards are f16: A and B must share a dtype"),
    ([np.ones((0, 32), np.float16)] * 2, np.ones((32, 32), np.float16),
     re.escape("a_shards: each shard needs at least one row and one column, got shape [0, 32]")),
    ([np.ones((8, 8), np.float16)], np.ones((8, 0), np.float16), re.escape("b is [8, 0] but the A shards")),
])
def test_fused_all_gather_matmul_refuses_malformed_inputs_before_tracing(a_shards, b, message, nothing_runs):
    from tldsl.ops.allgather_gemm import fused_all_gather_matmul
    with pytest.raises(tl.InputError, match=message) as info:
        fused_all_gather_matmul(a_shards, b)
    assert "tldsl/ops" not in str(info.value)


@pytest.mark.parametrize("a_shards, b, says", [
    ([np.ones((4, 8))], np.ones((4, 4)), re.escape("b is [4, 4] but the A shards have K=8 columns: b must be [8, N]")),
    ([np.ones((4, 8)), np.ones((4, 6))], np.ones((8, 4)), "the A shards must share K"),
    ([], np.ones((8, 4)), "a_shards must be a non-empty list"),
    ([np.ones((4, 8))], np.ones(8), re.escape("b: a 2-d array of numbers, got float64 [8]")),
])
def test_the_allgather_gemm_reference_refuses_operands_that_do_not_multiply(a_shards, b, says):
    """numpy's gufunc ValueError came out of a K mismatch."""
    from tldsl.ops.allgather_gemm import reference
    with pytest.raises(tl.InputError, match="allgather_gemm.reference: " + says):
        reference(a_shards, b)


def test_sim_options_errors_are_input_errors_naming_the_options():
    """Built directly, SimOptions refuses a misspelt option or a wrong value with an InputError (a
    ValueError too, as before) — not the dataclass's TypeError."""
    with pytest.raises(tl.InputError, match="SimOptions has no option 'launch'; its options: launches,"):
        tl.SimOptions(launch=2)
    with pytest.raises(ValueError, match=r"SimOptions\(launches=...\): launches takes an int, got '2'"):
        tl.SimOptions(launches="2")
    with pytest.raises(tl.InputError, match="launches must be a positive int, got 0"):
        tl.SimOptions(launches=0)


@pytest.mark.parametrize("kw, says", [
    (dict(progress_interval_s=float("nan")), "progress_interval_s must be a finite number of seconds, 0 or more, got nan"),
    (dict(progress_interval_s=float("inf")), "progress_interval_s must be a finite number of seconds, 0 or more, got inf"),
    (dict(progress_interval_s=-1.0), "progress_interval_s must be a finite number of seconds, 0 or more, got -1.0"),
    (dict(warn_steps=-1), "warn_steps must be None (never warn) or an int of 0 or more"),
    (dict(max_steps=0), "max_steps must be a positive int"),
])
def test_sim_options_refuse_numbers_that_mean_nothing(kw, says):
    """A NaN progress interval and a negative warn_steps were accepted (nonsense that surfaced, if
    at all, as a report never or always made)."""
    with pytest.raises(tl.InputError, match=re.escape(says)):
        tl.SimOptions(**kw)
    assert tl.SimOptions(progress_interval_s=0.0, warn_steps=0).warn_steps == 0


@pytest.mark.parametrize("kw, says", [
    (dict(engine="copy_engine", col_tile=2 ** 70), "col_tile 1180591620717411303424: need a positive int below 2**31"),
    (dict(engine="copy_engine", col_tile=2 ** 31), "col_tile 2147483648: need a positive int below 2**31"),
    (dict(tile_m=2 ** 31), "communication tile_m 2147483648: need a positive int below 2**31"),
])
def test_a_communication_tile_past_a_tensor_dimension_is_refused(kw, says):
    """CommSchedule(col_tile=2**70) was accepted and acted as whole rows: a slice wider than any
    tensor dimension (below 2**31) can only mean None, which says so."""
    with pytest.raises(tl.ScheduleError, match=re.escape(says)) as info:
        tl.CommSchedule(**kw)
    assert "test_errors.py" in str(info.value)          # at the user's line


def test_a_result_is_indexed_by_rank_first():
    r = tl.simulate(gather_scale, 2, _inputs(2))
    assert set(r[1]) >= {"out"}
    with pytest.raises(tl.InputError, match=r"indexed by rank first: result\[rank\]\['out'\], not result\['out'\]"):
        r["out"]
    with pytest.raises(tl.InputError, match=r"rank 2: this result has ranks 0..1"):
        r[2]
    # len and iteration walk the ranks (they ran into r[2]'s error); `in` says to index a rank first
    assert len(r) == 2 and [set(outs) for outs in r] == [set(r[0]), set(r[1])]
    with pytest.raises(tl.InputError, match=r"'out' in result\[rank\], not 'out' in result"):
        "out" in r                                           # noqa: B015


def test_calling_a_kernel_like_a_function_is_a_typed_error_naming_simulate():
    with pytest.raises(tl.InputError, match=r"'gather_scale' is a tile program, not a Python function: run it with "
                                            r"tl.simulate\(gather_scale, world_size, inputs\)") as info:
        gather_scale(1, 2)
    assert isinstance(info.value, TypeError)


def test_a_wait_epoch_must_be_a_bool():
    @tl.kernel
    def waited(out):
        s = tl.signal("s", 1)

        @tl.compute_part(grid=(1,))
        def v(p):
            tl.producer_tile_notify(s, 0)
            tl.consumer_tile_wait(s, 0, count=1, epoch="no")
            tl.store(out, (0,), tl.zeros((8,)))

    with pytest.raises(tl.CompilationError, match="epoch takes True or False, got 'no'"):
        waited.trace(1, tl.TensorSpec((8,), tl.float32))


def test_a_tile_or_fragment_past_the_element_bound_is_refused_as_it_is_traced():
    """Every lowering indexes a tile's elements with 32-bit ints: a tile or fragment of more than
    2**30 elements is refused where the trace makes it (so the simulator refuses what no kernel could
    hold); one of 2**30 traces (the trace allocates nothing)."""
    from tldsl.tracing import MAX_TILE_ELEMENTS
    assert MAX_TILE_ELEMENTS == 2 ** 30

    def trace(n, dtype=tl.float32, make=lambda n, dt: tl.fragment((n,), dt)):
        @tl.kernel
        def k(c):
            @tl.compute_part(grid=(1,))
            def p(i):
                tl.store(c, (0,), make(n, dtype))
        return k.trace(1, tl.TensorSpec((n,), dtype))

    trace(MAX_TILE_ELEMENTS)
    with pytest.raises(tl.CompilationError, match=r"a 1073741825 f32 fragment has 1,073,741,825 elements: no kernel "
                                                  r"indexes one past 2\*\*30"):
        trace(MAX_TILE_ELEMENTS + 1)
    with pytest.raises(tl.CompilationError, match="a 1073741825 i1 tile has 1,073,741,825 elements"):
        trace(MAX_TILE_ELEMENTS + 1, tl.bool_, lambda n, dt: tl.full((n,), True, dt))
    with pytest.raises(tl.CompilationError, match="a 32768x32769 f32 tile has") as info:    # made by broadcasting
        @tl.kernel
        def outer(a, b, c):
            @tl.compute_part(grid=(1,))
            def p(i):
                tl.store(c, (0, 0), tl.load(a, (0, 0), (32768, 1)) * tl.load(b, (0, 0), (1, 32769)))
        outer.trace(1, tl.TensorSpec((32768, 1), tl.float32), tl.TensorSpec((1, 32769), tl.float32),
                    tl.TensorSpec((32768, 32769), tl.float32))
    assert info.value.loc is not None and info.value.loc.filename == __file__


def test_a_kernel_taking_star_args_is_refused_where_it_is_defined():
    with pytest.raises(tl.CompilationError, match=r"tl.kernel 'gathered' takes \*xs and \*\*options: a kernel's "
                                                  r"tensors are named positional parameters") as info:
        @tl.kernel
        def gathered(y, *xs, **options):
            pass
    assert info.value.loc.lineno == gathered_line() and info.value.loc.filename == __file__


def gathered_line():
    import inspect
    src = inspect.getsource(test_a_kernel_taking_star_args_is_refused_where_it_is_defined).splitlines()
    first = test_a_kernel_taking_star_args_is_refused_where_it_is_defined.__code__.co_firstlineno
    return first + next(i for i, line in enumerate(src) if "def gathered" in line) - 1


def test_an_empty_grid_is_named_as_such():
    @tl.kernel
    def k(y):
        @tl.compute_part(grid=())
        def p():
            pass
    with pytest.raises(tl.CompilationError, match=r"a part's grid is empty: give it one Python int per axis"):
        k.trace(1, tl.TensorSpec((4,), tl.float32))


def test_a_kernel_keyword_named_like_a_calls_own_parameter_is_refused_where_it_is_defined():
    """``seed=3`` went to the simulator's scheduler, ``sms=5`` to tl.run only (the simulator traced
    the kernel with 5, the GPU with the default): each is refused when the kernel is defined."""
    with pytest.raises(tl.CompilationError, match=r"keyword parameter\(s\) \['seed', 'sms'\], which tl.simulate "
                                                  r"/ tl.run / FusedProgram take as their own"):
        @tl.kernel
        def scaled(x, y, *, seed: tl.constexpr = 1, sms: tl.constexpr = 1):
            pass


@pytest.mark.parametrize("param", ["compute", "scale: tl.constexpr", "comm: tl.CommSchedule"])
def test_a_compile_time_parameter_before_the_star_is_refused(param):
    ns = {"tl": tl}
    exec(f"def k(x, {param}, y):\n    pass", ns)                  # noqa: S102 - the test's own source
    name = param.split(":")[0]
    with pytest.raises(tl.CompilationError, match=rf"parameter '{name}' is compile-time but comes before the `\*`"):
        tl.kernel(ns["k"])


@tl.kernel
def scaled_by(x, y, *, s: tl.constexpr = 1.0):
    @tl.compute_part(grid=(1,))
    def part(p):
        tl.store(y, (0,), tl.load(x, (0,), (8,)) * s * GLOBAL_SCALE)


GLOBAL_SCALE = 2.0


def test_equal_keyword_values_of_other_types_or_signs_and_changed_globals_trace_again():
    """The trace cache told keyword values apart by ``==``: ``s=-0.0`` after ``s=0.0`` kept +0's
    sign, ``s=2.0`` after ``s=np.float32(2)`` kept f32 math on an f16 tile; and a global the kernel
    reads kept its value of the first trace (a notebook setting ``GLOBAL_SCALE = 3.0`` saw 2.0)."""
    global GLOBAL_SCALE
    x = {"x": np.full(8, 1.0, np.float32), "y": np.full(8, np.nan, np.float32)}
    one = lambda **kw: tl.simulate(scaled_by, 1, [x], **kw)[0]["y"]          # noqa: E731
    assert not np.signbit(one(s=0.0)).any() and np.signbit(one(s=-0.0)).all()
    xh = {"x": np.full(8, 60000, np.float16), "y": np.full(8, np.nan, np.float16)}
    assert np.isinf(tl.simulate(scaled_by, 1, [xh], s=2.0)[0]["y"]).all()          # f16 math: overflows
    assert np.isinf(tl.simulate(scaled_by, 1, [xh], s=np.float32(2.0))[0]["y"]).all()
    assert (one(s=1.0) == 2.0).all()
    try:
        GLOBAL_SCALE = 3.0
        assert (one(s=1.0) == 3.0).all()
    finally:
        GLOBAL_SCALE = 2.0
    assert (one(s=1.0) == 2.0).all()


@tl.kernel
def shifted_copy(x: tl.Symmetric, *, engine: tl.constexpr = "copy_engine"):
    if engine == "copy_engine":
        @tl.comm_part(grid=(1,), engine="copy_engine")
        def move(i):
            tl.rank_copy_data(x, (2, 0), x, (0, 0), (4, 4))
    else:
        @tl.comm_part(grid=(1,))
        def push(i):
            tl.tile_push_data(x.at(tl.rank()), (2, 0), x, (0, 0), (4, 4))


@pytest.mark.parametrize("engine", ["copy_engine", "sm"])
def test_a_copy_onto_an_overlapping_region_of_its_source_is_a_race(engine):
    """The simulator moved it as one memmove; the copy engine (cuMemcpy2D, row by row) and the SMs'
    copies move it in pieces, so rows 4-5 came out as old rows 0-1 on one and not on the other
    (found by a helper): refused, naming both boxes."""
    x = np.arange(48, dtype=np.float32).reshape(8, 6)
    with pytest.raises(tl.RaceError, match=r"copies x\[0:4, 0:4\] onto x\[2:6, 0:4\] of rank 0: the regions overlap"):
        tl.simulate(shifted_copy, 1, [{"x": x}], engine=engine)
    np.testing.assert_array_equal(x, np.arange(48, dtype=np.float32).reshape(8, 6))
