"""``tl.run`` on a GPU against ``tl.simulate`` on the same inputs (skipped where there is no GPU).

Every rank of a multi-rank program runs on the one GPU, each on its own streams, with its own
memory. Outputs are compared as the differential fuzzer compares them
(``tldsl.testing.program_tolerance``): element by element, each within a bound on the GPU's
legitimate difference there (TF32 dots, other summation orders, CUDA's math functions, fp16/bf16
rounding of intermediates) carried through the program from the magnitudes that flow into it.

Run on a GPU host with: ``python -m pytest -m gpu tests/test_gpu_run.py``.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tldsl as tl
from tldsl.runtime.gpu import gpu_available

from test_run_plan import ag_gemm, gemm_rs, row_softmax, scale_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")]

#: relative tolerance by output dtype (of the output's largest magnitude)
RTOL = {"f16": 4e-3, "bf16": 1.6e-2, "f32": 1e-5, "i32": 0.0}
#: ... where the program has a dot or a reduction (another summation order)
RTOL_SUMS = {"f16": 8e-3, "bf16": 3e-2, "f32": 4e-3, "i32": 0.0}
S, F16 = tl.TensorSpec, tl.float16


def assert_agrees(got, want, kernel, sums: bool, tolerances=None):
    """``got`` agrees with the simulator's ``want``: with ``tolerances`` (from
    ``reference_with_tolerances``, as :func:`both` gets them) element by element, as the fuzzer
    compares; without, the older per-dtype tolerance of the output's largest magnitude."""
    if tolerances is not None:
        from tldsl.testing.program_tolerance import mismatches
        for r in range(kernel.world_size):
            for b in kernel.args:
                assert got[r][b.name].dtype == want[r][b.name].dtype, b.name
        bad = mismatches(got, want, tolerances, [b.name for b in kernel.args])
        assert not bad, "\n".join(bad)
        return
    for r in range(kernel.world_size):
        for b in kernel.args:
            g, w = np.asarray(got[r][b.name], np.float64), np.asarray(want[r][b.name], np.float64)
            assert g.shape == w.shape and got[r][b.name].dtype == want[r][b.name].dtype, b.name
            nan = np.isnan(w)
            assert np.array_equal(nan, np.isnan(g)), f"rank {r} '{b.name}': NaN at other places (unwritten tiles?)"
            rtol = (RTOL_SUMS if sums else RTOL)[b.type.dtype.name]
            scale = max(1.0, float(np.abs(w[~nan]).max(initial=0.0)))
            err = float(np.abs(g - w)[~nan].max(initial=0.0))
            assert err <= rtol * scale, f"rank {r} '{b.name}': max error {err:.3g} over {rtol * scale:.3g}"


def both(fn, W, inputs, sums=False, **kw):
    """tl.run and tl.simulate of the same call; asserts they agree and returns the run's result."""
    from tldsl.testing.program_tolerance import reference_with_tolerances
    want, tolerances = reference_with_tolerances(fn, W, inputs, **{k: v for k, v in kw.items()
                                                                    if k not in ("lowering", "timeout_s", "sms")})
    got = tl.run(fn, W, inputs, **kw)
    assert isinstance(got, tl.SimResult) and got.launches == want.launches
    assert_agrees(got.outputs, want.outputs, want.kernel, sums, tolerances)
    return got


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dt", ["float16", "float32"])
def test_scale_rows(dt):
    rng = np.random.default_rng(0)
    x = _rand(rng, (1000, 200), dt)                      # not a multiple of the tile either way
    res = both(scale_rows, 1, [{"x": x, "y": np.zeros_like(x)}], compute=tl.ComputeSchedule(tile=(64, 64, 16)))
    assert np.allclose(res[0]["y"], x.astype(np.float32) * 2 + 1, rtol=4e-3, atol=4e-3)
    assert len(res.launch_ms) == 2 and min(res.launch_ms) > 0        # the simulator's default: two launches


def test_scale_rows_with_torch_tensors_leaves_them_alone():
    import torch
    x = torch.randn(300, 96, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(300, 96, device="cuda", dtype=torch.float32)
    before = x.clone()
    res = tl.run(scale_rows, 1, [{"x": x, "y": y}], compute=tl.ComputeSchedule(tile=(32, 32, 16)))
    assert torch.equal(x, before) and not y.any()          # inputs are copied, as the simulator copies them
    want = x.float() * 2 + 1
    assert torch.allclose(res.tensors[0]["y"], want, rtol=1.6e-2, atol=1.6e-2)
    assert np.allclose(res[0]["y"], want.cpu().numpy(), rtol=1.6e-2, atol=1.6e-2)


def test_row_softmax():
    rng = np.random.default_rng(1)
    x = _rand(rng, (333, 96), np.float16)
    both(row_softmax, 1, [{"x": x, "y": np.zeros(x.shape, np.float32)}], sums=True,
         compute=tl.ComputeSchedule(tile=(16, 16, 16)))


@pytest.mark.parametrize("dt", ["float16", "float32"])
def test_rows_added_from_many_tiles_into_the_same_rows(dt):
    """tl.add_rows: 3000 weighted rows added into 500 (six on average a row, from tiles of every
    CTA, in no fixed order; ids of -1 skipped), poisoned nowhere: y holds the caller's values."""
    from programs import weighted_scatter
    rng = np.random.default_rng(2)
    inputs = [dict(x=_rand(rng, (3000, 200), dt), idx=rng.integers(-1, 500, 3000).astype(np.int32),
                   w=rng.uniform(0.1, 1.0, 3000).astype(np.float32), y=_rand(rng, (500, 200), dt))]
    res = both(weighted_scatter, 1, inputs, sums=True, compute=tl.ComputeSchedule(tile=(64, 64, 16)))
    x, idx, w, y = (inputs[0][n] for n in ("x", "idx", "w", "y"))
    want = y.astype(np.float64)
    np.add.at(want, idx[idx >= 0], (w[:, None] * x.astype(np.float64))[idx >= 0])
    assert np.allclose(res[0]["y"], want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tile,cluster", [((128, 256, 64), 1), ((128, 256, 64), 2), ((64, 256, 64), 1),
                                          ((128, 128, 64), 1), ((256, 128, 64), 1), ((128, 32, 64), 1),
                                          ((64, 64, 64), 1)])
def test_the_moe_combine_in_the_grouped_gemms_epilogue(tile, cluster):
    """moe_combined_experts: the grouped GEMM's held tiles added (times each row's top-k weight) into
    their tokens' rows of ``out`` by vector reductions (what tl.run launched: the grouped-GEMM recipe,
    no fallback), ``out`` holding values of its own; 128-row tiles (half tiles among them) alone and in
    clusters of two, 64-row tiles (the columns split between the consumers), 128 x 128, 256-row tiles
    (two 64-row blocks a consumer), 32 columns (8-byte pieces four to a row) and one consumer warpgroup."""
    import warnings
    from tldsl.codegen import lower
    from tldsl.ops.moe import moe_combined_experts, moe_routing
    rng = np.random.default_rng(3)
    T, E, topk, K, N = 3000, 16, 3, 192, 512
    ids = np.stack([rng.choice(E, topk, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (T, topk)).astype(np.float32)
    rt = moe_routing(ids, E, 1, T, tile[0])
    compute = tl.ComputeSchedule(tile=tile, order="swizzled", cluster=(cluster, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lw = lower(rt.trace_combined_experts(K, N, E, tl.float16, compute=compute), "grouped_gemm")
    assert "kAddRows = true" in lw.source
    ins = dict(h=_rand(rng, (rt.num_rows, K), np.float16), w2=(_rand(rng, (E, K, N), np.float16) * 0.1).astype(np.float16),
               row_weights=rt.row_weights(wts), sorted_token_ids=rt.sorted_token_ids, tile_expert=rt.tile_expert,
               tile_valid_rows=rt.tile_valid_rows, out=_rand(rng, (T, N), np.float16))
    res = both(moe_combined_experts, 1, [ins], sums=True, compute=compute)
    launched = [pk.lowered for pk in res.plan.kernels]
    assert len(launched) == 1 and "kAddRows = true" in launched[0].source, [type(x).__name__ for x in launched]



@pytest.mark.parametrize("tile,cluster", [((64, 128, 64), 1), ((128, 256, 64), 2)])
def test_the_moe_combine_waiting_for_its_output_to_be_cleared(tile, cluster):
    """The combine in the grouped GEMM's epilogue writing ``out`` (poisoned): a part clears it, each
    GEMM tile waits after its K loop, before its adds (``late_waits`` on the consumers) — tl.run
    against the simulator, twice (the second launch's waits count in its own epoch), the GEMM on the
    grouped-GEMM recipe beside the clear (chained after it, the stream would order them and the wait
    is dropped)."""
    from test_codegen_added_rows import clearing_program
    from tldsl.ops.moe import moe_routing
    rng = np.random.default_rng(5)
    T, E, topk, K, N = 2000, 12, 3, 192, 512
    ids = np.stack([rng.choice(E, topk, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (T, topk)).astype(np.float32)
    rt = moe_routing(ids, E, 1, T, tile[0])
    k = clearing_program(rt, K, N, E, tl.float16, tile=tile, cluster=cluster)
    ins = dict(h=_rand(rng, (rt.num_rows, K), np.float16), w2=(_rand(rng, (E, K, N), np.float16) * 0.1).astype(np.float16),
               row_weights=rt.row_weights(wts), sorted_token_ids=rt.sorted_token_ids, tile_expert=rt.tile_expert,
               tile_valid_rows=rt.tile_valid_rows, out=np.full((T, N), np.nan, np.float16))
    res = both(k, 1, [ins], sums=True, lowering={"chain": "beside"}, options={"launches": 2})
    gemm = [pk.lowered for pk in res.plan.kernels if pk.part == "grouped_gemm"]
    assert len(gemm) == 1 and "kHasLateWaits = true" in gemm[0].source

def _ag_inputs(k, seed):
    rng = np.random.default_rng(seed)
    b = _rand(rng, k.args[1].type.shape, np.float16)
    return [{"a": _rand(rng, k.args[0].type.shape, np.float16), "b": b,
             "c": np.full(k.args[2].type.shape, np.nan, np.float16)} for _ in range(k.world_size)]


@pytest.mark.parametrize("engine", ["sm", "copy_engine"])
def test_allgather_gemm_at_two_ranks(engine):
    k = ag_gemm(engine=engine)
    res = both(k, 2, _ag_inputs(k, 2), sums=True)
    assert [type(x).__name__ for x in res.plan.items] == (["PlannedKernel"] * 4 if engine == "sm" else
                                                          ["PlannedCopies", "PlannedKernel"] * 2)


@pytest.mark.parametrize("engine", ["sm", "copy_engine"])
def test_allgather_gemm_and_gemm_reduce_scatter_of_linear_weights_at_two_ranks(engine):
    """``weights="nk"``: B stored [N, K] as a torch Linear keeps it, read K-major by the GEMM recipe
    (N = 384: B not square, so a transposed read would show)."""
    from tldsl.ops.allgather_gemm import allgather_gemm
    from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter
    S, F16 = tl.TensorSpec, tl.float16
    comm = tl.CommSchedule(mode="pull", sms=2, engine="sm") if engine == "sm" else \
        tl.CommSchedule(mode="pull", engine="copy_engine")
    k = allgather_gemm.trace(2, S((256, 256), F16), S((384, 256), F16), S((512, 384), F16),
                             compute=tl.ComputeSchedule(tile=(128, 128, 64)), comm=comm, weights="nk")
    rng = np.random.default_rng(8)
    b = _rand(rng, (384, 256), np.float16)
    res = both(k, 2, [{"a": _rand(rng, (256, 256), np.float16), "b": b, "c": np.full((512, 384), np.nan, np.float16)}
                      for _ in range(2)], sums=True)
    assert all(x.lowered.config.b_k_major for x in res.plan.kernels if type(x.lowered).__name__ == "LoweredGemm")
    k = gemm_reduce_scatter.trace(2, S((512, 256), F16), S((384, 256), F16), S((256, 384), F16),
                                  compute=tl.ComputeSchedule(tile=(128, 128, 64)), comm=tl.CommSchedule(sms=2),
                                  weights="nk")
    both(k, 2, [{"a": _rand(rng, (512, 256), np.float16), "b": _rand(rng, (384, 256), np.float16),
                 "out": np.full((256, 384), np.nan, np.float16)} for _ in range(2)], sums=True)


def test_allgather_gemm_two_launches_in_every_enqueue_order():
    """Launch 2 waits for counters of launch 2 (epochs); the seed changes the order the ranks'
    kernels are enqueued in."""
    k = ag_gemm()
    for seed in range(3):
        both(k, 2, _ag_inputs(k, 3), sums=True, seed=seed, options={"launches": 2})


def test_gemm_reduce_scatter_at_two_ranks():
    k = gemm_rs()
    rng = np.random.default_rng(4)
    b = _rand(rng, (256, 256), np.float16)
    inputs = [{"a": _rand(rng, (512, 256), np.float16), "b": b, "out": np.full((256, 256), np.nan, np.float16)}
              for _ in range(2)]
    both(k, 2, inputs, sums=True)


def test_a_gemm_waiting_after_its_k_loop_runs_its_wait():
    """Tile row 1 waits, after its K loop, for a comm part released by tile row 0's notifies: the
    GEMM template would have dropped that wait, so the general lowering runs the part (with it)."""
    from test_codegen_pipeline import _waits_after_its_k_loop
    rng = np.random.default_rng(10)
    inputs = [{"a": _rand(rng, (256, 128), np.float16), "b": _rand(rng, (128, 256), np.float16),
               "c": np.full((256, 256), np.nan, np.float16)}]
    res = both(_waits_after_its_k_loop, 1, inputs, sums=True, compute=tl.ComputeSchedule(tile=(128, 128, 64)))
    assert any(type(x.lowered).__name__ == "LoweredGeneral" and x.part == "gemm" for x in res.plan.kernels)


@pytest.mark.parametrize("tile", [(128, 128, 64), (128, 256, 64)])
def test_gemm_reduce_scatter_holding_its_tiles_at_two_ranks(tile):
    """Partials in the output's dtype: the GEMM holds each tile and stores it during the next tile's K
    loop, notifying the reduce-scatter a tile later. At 128 x 128, 256 tiles a rank: more than the
    GPU's SMs, so CTAs walk two tiles and notify the first after the second's K loop; at 128 x 256,
    128 tiles: mostly one a CTA, notified after the loop."""
    from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter
    k = gemm_reduce_scatter.trace(2, S((4096, 256), F16), S((256, 1024), F16), S((2048, 1024), F16),
                                  compute=tl.ComputeSchedule(tile=tile), comm=tl.CommSchedule(sms=2),
                                  partial_dtype="out")
    rng = np.random.default_rng(9)
    inputs = [{"a": _rand(rng, (4096, 256), np.float16), "b": _rand(rng, (256, 1024), np.float16),
               "out": np.full((2048, 1024), np.nan, np.float16)} for _ in range(2)]
    res = both(k, 2, inputs, sums=True)
    gemm = [x for x in res.plan.kernels if type(x.lowered).__name__ == "LoweredGemm"]
    assert gemm and all(x.lowered.config.overlap_store and x.lowered.notifies == 1 for x in gemm)


@pytest.mark.parametrize("name", ["sp_attention", "allgather_moe", "allgather_moe_staged", "moe_reduce_scatter",
                                  "moe_reduce_scatter_out", "moe_reduce_scatter_pingpong",
                                  "moe_reduce_scatter_pingpong_many", "ring_exchange", "normed_gather",
                                  "allgather_moe_nk", "moe_reduce_scatter_pingpong_many_nk"])
def test_library_ops_and_general_programs_at_several_ranks(name):
    """Attention, the MoE grouped GEMM and combine, compute parts of the general recipe moving
    data through peer tables, a communication part of the general recipe."""
    from test_run_fake_device import library_case
    fn, W, inputs, kw = library_case(name)
    got = both(fn, W, inputs, sums=True, **kw)
    assert all(x.lowered.config.pingpong == ("_pingpong" in name) and x.lowered.config.b_k_major == name.endswith("_nk")
               for x in got.plan.kernels if type(x.lowered).__name__ == "LoweredGroupedGemm")


@pytest.mark.parametrize("name", ["moe_reduce_scatter", "moe_reduce_scatter_pingpong_many", "allgather_moe_staged"])
def test_a_chained_part_beside_its_producer_waits_for_real(name):
    """``chain="beside"``: the combine (MoE+ReduceScatter) or the grouped GEMM (AllGather+MoE, rows
    staged) runs on a stream of its own beside the part it waits on, started in either order by the
    seeds, so its waits on the other's per-tile notifies are what orders them (after it, the
    default, the signal between them is dropped); two launches, against the simulator."""
    from test_run_fake_device import library_case
    fn, W, inputs, kw = library_case(name)
    for seed in range(2):
        got = both(fn, W, inputs, sums=True, seed=seed, lowering={"chain": "beside"}, options={"launches": 2}, **kw)
        assert all(x.after is None for x in got.plan.kernels)
        waiting = [x.lowered for x in got.plan.kernels if x.part in ("combine", "grouped_gemm")]
        assert waiting and all(lk.waits > 0 or lk.notifies > 0 for lk in waiting)


@pytest.mark.parametrize("name,side", [("moe_reduce_scatter", "combine"), ("moe_reduce_scatter_out", "combine"),
                                       ("moe_reduce_scatter_pingpong", "combine"),
                                       ("moe_reduce_scatter_pingpong_many", "combine"),
                                       ("allgather_moe_staged", "gather_rows")])
def test_a_row_gather_part_folded_into_the_grouped_gemm(name, side):
    """``chain="folded"``: each rank's combine (MoE+ReduceScatter) or row gather (AllGather+MoE,
    rows staged) runs on its grouped GEMM kernel's spare producer warps (no launch of its own),
    two launches, against the simulator."""
    from test_run_fake_device import library_case
    fn, W, inputs, kw = library_case(name)
    got = both(fn, W, inputs, sums=True, lowering={"chain": "folded"}, options={"launches": 2}, **kw)
    kinds = sorted((x.rank, type(x.lowered).__name__) for x in got.plan.kernels)
    assert kinds == [(r, k) for r in range(W) for k in ("LoweredComm", "LoweredGroupedGemm")]
    assert all(x.lowered.side == side for x in got.plan.kernels if x.part == "grouped_gemm")
    assert all(x.lowered.config.pingpong == ("_pingpong" in name) for x in got.plan.kernels
               if x.part == "grouped_gemm")


@pytest.mark.gpu_alone      # beside other processes' kernels the trap's error once took over 92 s to arrive
@pytest.mark.parametrize("debugging", [False, True])
def test_a_wait_nothing_satisfies_is_reported_as_a_hang(debugging):
    """In a process of its own: the wait traps, and a trap leaves that process's CUDA context
    unusable (its teardown may then abort the process, so the script flushes what it says and
    leaves at once). Debugging (TLDSL_WAIT_TIMEOUT_NS set) the kernel prints the stuck slot
    first; otherwise it only traps, and the error says how to get that line."""
    code = textwrap.dedent('''
        import os, sys
        import numpy as np, tldsl as tl
        from tldsl.runtime.gpu.run_errors import GpuHangError

        @tl.kernel
        def short_of_notifies(x, y):
            ready = tl.signal("ready", 4)

            @tl.compute_part(grid=(4,))
            def produce(t):
                tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)))
                tl.producer_tile_notify(ready, t)

            @tl.compute_part(grid=(4,))
            def consume(t):
                tl.consumer_tile_wait(ready, t, count=2)          # one notify arrives, never two
                tl.store(x, (t * 8,), tl.load(y, (t * 8,), (8,)) * 2.0)

        # the host waits long enough for the kernel's own 2 s timeout to trap even while other processes'
        # kernels hold the GPU (the suite's workers share it): that trap, not the host's deadline, is tested
        import tldsl.runtime.gpu.run_program as rp
        rp.HOST_SLACK_S = 90.0
        try:
            # its signal kept (lowered "beside"): lowered for "after", 'consume' would run after 'produce'
            # with the signal between them dropped, and nothing would be left to wait for
            tl.run(short_of_notifies, 1, [{"x": np.ones(32, np.float32), "y": np.zeros(32, np.float32)}],
                   options={"static_checks": False}, timeout_s=2, lowering={"chain": "beside"})
            print("RETURNED: no hang was reported", flush=True)
        except GpuHangError as e:
            print("HANG REPORTED:", str(e).splitlines()[0], flush=True)
            print(str(e)[-2500:], file=sys.stderr, flush=True)     # all of it, for the assertion's message
            print("HOW TO SEE THE SLOT:", "with TLDSL_WAIT_TIMEOUT_NS=2000000000 set" in str(e), flush=True)
        except BaseException as e:
            print("OTHER ERROR:", type(e).__name__, str(e)[:2000], flush=True)
        sys.stderr.flush()
        os._exit(0)
    ''')
    import os
    env = {k: v for k, v in os.environ.items() if k != "TLDSL_WAIT_TIMEOUT_NS"}
    out = _run_alone(code, 180, env=dict(env, TLDSL_WAIT_TIMEOUT_NS="2000000000") if debugging else env)
    said = f"exit status {out.returncode}\n" + out.stdout[-3000:] + out.stderr[-3000:]
    assert "HANG REPORTED: launch 1 failed (" in out.stdout, said        # the kernel's trap, not the host's deadline
    assert f"HOW TO SEE THE SLOT: {not debugging}" in out.stdout, said
    assert ("tldsl: wait timed out: slot" in out.stdout + out.stderr) == debugging, said


def _run_alone(code: str, timeout: float, env=None) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python process of its own session, its output in files: waiting for the
    process, not for its pipes — the NVRTC compile pool's workers (and multiprocessing's resource
    tracker) outlive an ``os._exit`` and held captured pipes open until the test's timeout — then
    kill whatever of its session is left."""
    import os
    import signal
    import tempfile
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=so, stderr=se, text=True, start_new_session=True,
                             env=env)
        try:
            rc = p.wait(timeout=timeout)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        so.seek(0)
        se.seek(0)
        return subprocess.CompletedProcess(p.args, rc, so.read(), se.read())


def test_tiles_over_shared_memory_run_from_the_global_scratch():
    """256 x 256 f32 fragments are more than a CTA's shared memory: the general lowering keeps
    them in a global-memory scratch tl.run allocates, poisoned. Two accumulators of a K loop of
    dots (their operands in shared memory), and an element-wise accumulator with several task
    groups a CTA and more tasks than CTAs (each group's share reused task after task)."""
    from programs import outer_sums
    from test_codegen_general import gated_gemm
    rng = np.random.default_rng(12)
    M, N, K = 1300, 1100, 100
    ins = {"a": _rand(rng, (M, K), np.float32), "b": _rand(rng, (K, N), np.float32),
           "c": _rand(rng, (K, N), np.float32), "bias": _rand(rng, (N,), np.float32),
           "out": np.full((M, N), np.nan, np.float32)}
    res = both(gated_gemm, 1, [ins], sums=True, compute=tl.ComputeSchedule(tile=(256, 256, 32)))
    assert res.plan.kernels[0].lowered.scratch_bytes > 0
    u, v = _rand(rng, (5, 4000), np.float16), _rand(rng, (5, 4100), np.float16)
    res = both(outer_sums, 1, [{"u": u, "v": v, "y": np.full((4000, 4100), np.nan, np.float32)}], sums=True,
               compute=tl.ComputeSchedule(tile=(256, 256, 16)))
    [item] = res.plan.kernels
    assert item.lowered.groups > 1 and item.lowered.scratch_bytes > 0 and item.ctas < item.lowered.num_tasks


def test_a_whole_tensor_tile_runs_from_the_global_scratch():
    """A softmax over whole rows in one task holding the 1024 x 5000 f32 tensor (20 MB tiles, as
    the simulator runs them): its load and exponentials live in the global scratch."""
    from programs import whole_row_softmax
    x = _rand(np.random.default_rng(13), (1024, 5000), np.float32) * 3
    res = both(whole_row_softmax, 1, [{"x": x, "y": np.full(x.shape, np.nan, np.float32)}], sums=True)
    [item] = res.plan.kernels
    assert item.ctas == 1 and item.lowered.scratch_bytes_per_cta == 2 * x.nbytes


def test_a_whole_output_accumulator_and_a_dot_too_wide_for_wgmma():
    """A 4096 x 4096 f32 accumulator in one task (the global scratch) and a dot whose operands
    WGMMA could not stage (mma.sync instead)."""
    from programs import one_task_outer_product
    rng = np.random.default_rng(15)
    a, b = _rand(rng, (4096, 16), np.float16), _rand(rng, (16, 4096), np.float16)
    res = both(one_task_outer_product, 1, [{"a": a, "b": b, "y": np.full((4096, 4096), np.nan, np.float32)}],
               sums=True)
    assert res.plan.kernels[0].lowered.wgmma_dots == 0


def test_kernels_whose_scratch_would_not_fit_the_free_memory_run_on_fewer_ctas(monkeypatch):
    """With the device's free memory said to be short (the program's tensors, the headroom and
    the scratch of 40/7 CTAs, 7/8 of which the headroom leaves), the kernel taking scratch runs on five
    CTAs, not one an SM: same results."""
    from programs import outer_sums
    from tldsl.runtime.gpu.cuda_device import CudaDevice
    from tldsl.runtime.gpu.run_plan import lower_for_run
    rng = np.random.default_rng(14)
    u, v = _rand(rng, (5, 4000), np.float16), _rand(rng, (5, 4100), np.float16)
    sched = tl.ComputeSchedule(tile=(256, 256, 16))
    k = outer_sums.trace(1, S(u.shape, F16), S(v.shape, F16), S((4000, 4100), tl.float32), compute=sched)
    per_cta = lower_for_run(k)["part"].scratch_bytes_per_cta     # its task groups' 256 x 256 f32 fragments
    tensors = u.nbytes + v.nbytes + 4000 * 4100 * 4
    monkeypatch.setattr(CudaDevice, "free_memory", lambda self: tensors + 40 * per_cta // 7)
    res = both(outer_sums, 1, [{"u": u, "v": v, "y": np.full((4000, 4100), np.nan, np.float32)}], sums=True,
               compute=sched)
    [item] = res.plan.kernels
    assert item.lowered.scratch_bytes_per_cta == per_cta > 0 and item.ctas == 5


@pytest.mark.parametrize("sm_slot", [0, 1, -1])
def test_a_signal_the_copy_engine_and_an_sm_part_share(sm_slot):
    """Other slots (the copy engine writes values), the same slot or one read from memory (it adds
    from a one-thread kernel beside the SM part's atomic adds)."""
    from test_codegen_comm import ce_beside_sm
    from test_run_fake_device import ce_beside_sm_inputs
    ins = ce_beside_sm_inputs(2, N=4000, seed=11)
    got = both(ce_beside_sm, 2, ins, sm_slot=sm_slot, comm=tl.CommSchedule(engine="copy_engine"))
    for r in range(2):
        np.testing.assert_array_equal(got[r]["y"], 2 * ins[1 - r]["x"])


@pytest.mark.parametrize("launches", [1, 3])
def test_a_gather_counting_every_ranks_arrival_on_one_slot(launches):
    """Three ranks' copy engines each add 1 to rank 0's one slot after their copy; rank 0 waits
    for all three (then six, nine) before it reads the gathered rows."""
    from test_run_fake_device import gather_arrivals, gather_inputs
    ins = gather_inputs(3, N=100_000, seed=13)
    got = both(gather_arrivals, 3, ins, comm=tl.CommSchedule(engine="copy_engine"),
               options=tl.SimOptions(launches=launches))
    np.testing.assert_array_equal(got[0]["y"], 2 * np.concatenate([i["x"] for i in ins]))


@pytest.mark.parametrize("name,threads", [
    ("gated_gemm-f16-wgmma", None),                 # acc += dot: two accumulators over a K loop
    ("attention_like-f16-wgmma", None),             # a transposed operand; a chain of two dots, the second's
                                                    # operand computed (a softmax cast to f16)
    ("flash_attention-bf16-wgmma", None),           # where(mask, dot * scale, ...), acc * alpha + dot
    ("wide_dot-f16-chunks", None),                  # dot alone and of computed operands; K staged in chunks
    ("wide_dot-f16-chunks", 256),                   # ... by two warpgroups
    ("wide_dot-bf16-wide", 256),                    # 256-column tiles (200 inside the tensor), two WGMMA tiles
    ("gated_gemm-f16-256-wgmma-spilled", None),     # accumulators in the global scratch
])
def test_dots_on_wgmma_agree_with_the_simulator(name, threads):
    """The general lowering's dots on WGMMA (f16 / bf16 tiles of 64-row multiples): operands
    staged in shared memory in a GMMA layout, each warpgroup on 64-row tiles, the results into
    the statement after the dot; every dot of these programs runs there."""
    from test_codegen_general import CASES, inputs_for, trace
    fn, shapes, tile, kw = next(c.values for c in CASES if c.id == name)
    k = trace(fn, shapes, tile, kw)
    extra = {"lowering": {"threads": threads}} if threads else {}
    res = both(k, 1, [inputs_for(k, np.random.default_rng(21))], sums=True, **extra)
    [item] = res.plan.kernels
    lk = item.lowered
    assert type(lk).__name__ == "LoweredGeneral" and lk.dots == lk.wgmma_dots > 0, lk.describe()
    assert lk.threads == (threads or 128)


@pytest.mark.parametrize("name", ["gated_gemm-f16-pipelined", "gated_gemm-bf16-silu-pipelined-unaligned", "large",
                                  "large-inflight0", "gated_linear-f16-pipelined",
                                  "gated_linear-bf16-silu-pipelined-unaligned", "gated_linear-f16-pipelined-two-chunks"])
def test_pipelined_dot_loops_agree_with_the_simulator(name):
    """Loops that only load and accumulate dots, run as a mainloop (cp.async ring, WGMMA on the
    staged tiles, accumulators in registers): edges of M, N and K, rows that are not 16-byte
    multiples (staged element by element), a larger product in the schedule's swizzled order
    with several K tiles per stage pass, and a right operand stored [N, K] and transposed in the
    dot (staged as loaded, K-major: ``gated_linear``)."""
    from test_codegen_general import CASES, F16, _specs, gated_gemm, inputs_for, trace
    extra = {"lowering": {"wgmma_inflight": 0}} if name.endswith("inflight0") else {}
    if name.startswith("large"):
        shapes = [((520, 1000), F16), ((1000, 392), F16), ((1000, 392), F16), ((392,), F16), ((520, 392), F16)]
        k = gated_gemm.trace(1, *_specs(shapes), compute=tl.ComputeSchedule(tile=(128, 128, 64), stages=4,
                                                                            order="swizzled", group_m=3))
    else:
        fn, shapes, tile, kw = next(c.values for c in CASES if c.id == name)
        k = trace(fn, shapes, tile, kw)
    res = both(k, 1, [inputs_for(k, np.random.default_rng(5))], sums=True, **extra)
    [item] = res.plan.kernels
    lk = item.lowered
    assert "pipelined dot loop" in lk.source and lk.dots == lk.wgmma_dots == 2, lk.describe()


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "no_guard"])
@pytest.mark.parametrize("name", ["128x128 ping-pong", "128x256 half tiles", "128x256 clusters", "64x128 pairs",
                                  "64x256 split columns", "128x128 gathered", "128x256x32 (64-byte swizzle)"])
def test_grouped_gemms_of_weights_stored_n_by_k_agree_with_the_simulator(name, guard):
    """Experts' weights stored [E, N, K] (a stack of torch Linear weights), read as
    ``tl.trans(tile)``: the grouped recipe stages them K-major under each of its configurations;
    tiles full, partial (half tiles), and (guarded) skipped, expert -1, outputs poisoned with NaN.
    Without the ``tl.when`` guard every tile's expert is one of w's, and the grouped recipe still
    takes the part (no fallback)."""
    from test_codegen_grouped_k_major import CONFIGS, experts_nk, inputs, trace_experts
    cfg = dict(CONFIGS[name], dt=tl.float16)
    k = trace_experts(**cfg, guard=guard)
    kw = {key: cfg[key] for key in ("gather", "mask") if key in cfg}
    sched = tl.ComputeSchedule(tile=cfg["tile"], stages=cfg["stages"], cluster=(cfg.get("cluster", 1), 1))
    ins = inputs(k, 3 if guard else 4, np.float16, skipped=guard)
    assert guard or (ins["tile_expert"] >= 0).all()
    res = both(experts_nk, 1, [ins], compute=sched, guard=guard, **kw)
    [item] = res.plan.kernels
    assert type(item.lowered).__name__ == "LoweredGroupedGemm" and item.lowered.config.b_k_major
    assert item.lowered.declined == ()


def test_a_prepared_launch_keeps_its_tensors_when_the_caller_drops_them():
    """A grouped GEMM prepared once (its TMA descriptors and tables' addresses packed), its inputs'
    last references dropped and as many tensors of 7s allocated after: the launch still reads the
    tensors it was prepared with (it holds them), so the output is the reference's."""
    import gc

    import torch

    from test_codegen_grouped_k_major import CONFIGS, expected, inputs, trace_experts
    from tldsl.codegen import lower
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    k = trace_experts(**dict(CONFIGS["128x128 ping-pong"], dt=tl.float16))
    ins = inputs(k, 6, np.float16)
    want = expected(ins)
    bufs = {name: torch.from_numpy(v).cuda() for name, v in ins.items()}
    prepared = GroupedKernel(lower(k, "gg")).prepare(bufs, {})
    y = bufs["y"]
    del bufs
    gc.collect()
    others = [torch.full(v.shape, 7, dtype=torch.from_numpy(v).dtype, device="cuda") for v in ins.values()]
    prepared.launch(torch.cuda.current_stream().cuda_stream, 1)
    torch.cuda.synchronize()
    got = y.float().cpu().numpy()
    assert np.abs(got - want).max() <= 8e-3 * max(1.0, np.abs(want).max()), np.abs(got - want).max()
    assert all(bool((t == 7).all()) for t in others)


@pytest.mark.parametrize("sms", [None, 3])
def test_the_fuzzers_gpu_mode_runs_its_programs_with_tl_run(sms):
    """Every generated program whose parts all lower and compile agrees with the simulator; on
    three SMs (``--sms 3``) those whose kernels fit run there, their CTAs walking several tiles
    (in two or more of 24 programs: on an H100, 1 of the first 8 of this seed)."""
    assert _fuzzed_on_gpu(24 if sms else 8, 11, sms)


def _fuzzed_on_gpu(n: int, seed: int, sms: int | None, families=None) -> list:
    """The fuzzer's programs ``n`` of ``seed`` run with tl.run (on ``sms`` SMs where they fit):
    those whose parts all lowered and compiled, each checked to agree with the simulator and, on
    ``sms`` SMs, two or more with CTAs walking several tiles."""
    from tldsl.testing.fuzz import run
    reports = run(n, seed, gpu=True, sms=sms, families=families)
    whole = [r for r in reports if not (r.sim_error or r.not_lowered or r.compile_errors or r.lowering_crashes)]
    assert all(r.compared == "agrees" for r in whole), "\n".join(r.line() + "\n" + r.case.source for r in whole
                                                               if r.compared != "agrees")
    if sms:
        assert sum(r.sms == sms and r.multi_task_ctas for r in whole) >= 2, [r.line() for r in reports]
    return whole


@pytest.mark.parametrize("family", ["combine", "grouped_gemm", "attention"])
@pytest.mark.parametrize("sms", [None, 2])
def test_the_fuzzers_recipe_families_agree_with_the_simulator_on_the_gpu(sms, family):
    """``--family combine``: row-gather combines, most lowered by the combine recipe (its 1024-thread
    persistent CTAs, vector gathers, per-row scales); ``--family grouped_gemm``: expert GEMMs over
    run-time tables, most by the grouped GEMM recipe (TMA or gathered A, WGMMA, unused tiles, row
    masks, half tiles) — alone, or after a producer of their input; ``--family attention``:
    flash-attention parts, most by the attention recipe — on the whole GPU and on two SMs, agree
    with the simulator."""
    from tldsl.testing.fuzz import _recipe_name
    whole = _fuzzed_on_gpu(16, 7, sms, [family])
    assert len(whole) == 16, [r.line() for r in whole]
    recipes = [_recipe_name(lk) for r in whole for lk in r.lowered.values()]
    assert recipes.count(family) >= 9, recipes          # (each family is named after its recipe)


def test_a_push_between_two_other_ranks():
    """``tile_push_data`` from ``x.at(rank)``: rank r's SMs copy rank r+1's rows into rank r+2's y."""
    from test_codegen_comm import relay
    rng = np.random.default_rng(11)
    inputs = [{"x": _rand(rng, (10, 7), np.float32), "y": np.full((10, 7), np.nan, np.float32)} for _ in range(3)]
    got = both(relay, 3, inputs)
    for r in range(3):
        assert np.array_equal(got.outputs[r]["y"][:, 1:], inputs[(r - 1) % 3]["x"][:, :6]), r


@pytest.mark.parametrize("launches", [1, 3])
def test_every_launch_runs_on_the_callers_arguments(launches):
    """An in-place ``y += x`` (and a push into a peer's argument) returns one application of itself."""
    from test_simulator import accumulate
    rng = np.random.default_rng(4)
    inputs = [{"x": _rand(rng, 8, np.float32), "y": _rand(rng, 8, np.float32), "seen": _rand(rng, 8, np.float32)}
              for _ in range(2)]
    got = both(accumulate, 2, inputs, options=tl.SimOptions(launches=launches))
    for r in range(2):
        np.testing.assert_array_equal(got.outputs[r]["y"], inputs[r]["y"] + inputs[r]["x"])


@pytest.mark.parametrize("tiles,sms", [(1000, None), (40, 3)])
def test_a_running_sum_over_more_tiles_than_ctas(tiles, sms):
    """Each tile waits for the one before it (a look-back scan): the kernel's persistent CTAs take
    the tiles in order, so fewer CTAs than tiles finish it."""
    from test_run_plan import running_sum
    x = np.random.default_rng(9).integers(-4, 5, 8 * tiles).astype(np.float32)
    got = both(running_sum, 1, [{"x": x, "y": np.full(8 * tiles, np.nan, np.float32)}], sms=sms)
    assert got.plan.kernels[0].ctas < tiles
    np.testing.assert_array_equal(got[0]["y"], np.cumsum(x.reshape(tiles, 8), 0).reshape(-1))


def test_a_peer_load_in_a_compute_part():
    """The fuzzer's program 68 of seed 2026, which faulted (CUDA_ERROR_ILLEGAL_ADDRESS) on an
    H200 while its kernel matches the simulator on CPU threads and tl.run's bindings match it on
    the fake device. Last in this file: a fault leaves the process's CUDA context unusable."""
    from test_run_fake_device import peer_row_max, peer_row_max_inputs
    both(peer_row_max, 3, peer_row_max_inputs(), sums=True)


def test_a_waiting_general_part_walks_the_schedules_tile_order():
    """GEMM + ReduceScatter summing in the GEMM's epilogue, 16x16 tiles (the general recipe), three
    ranks on the one GPU: each rank's 64 own-row tiles wait for both peers' copies. In the
    comm_aligned order (own rows last, as the simulator runs them) every other tile is done first;
    walked row by row, as the general recipe walked a waiting part before, rank 0 takes its own
    rows first on every CTA it has (about 40 here) and the simulator, run in that order on as many
    slots, deadlocks."""
    from tldsl.ops.gemm_reduce_scatter import SPEC, gemm_reduce_scatter
    W, Ms, K, N = 3, 256, 32, 64
    comm = tl.CommSchedule(engine="copy_engine", mode="push", tile_m=16, reduce_in="epilogue")
    compute = tl.ComputeSchedule(tile=(16, 16, 16), order="comm_aligned", group_m=16)
    case = SPEC.make_case(np.random.default_rng(0), W, rows_per_rank=Ms, n=N, k_per_rank=K, compute=compute, comm=comm)
    got = both(gemm_reduce_scatter, W, case.inputs, sums=True, **case.kwargs)
    assert any(type(x.lowered).__name__ == "LoweredGeneral" and x.part == "gemm" for x in got.plan.kernels)


@pytest.mark.parametrize("order,group", [("row_major", 16), ("swizzled", 8)])
@pytest.mark.parametrize("sms", [None, 2])
def test_the_epilogue_sum_at_two_ranks_in_an_order_walking_a_ranks_rows_at_a_time(order, group, sms):
    """GEMM + ReduceScatter summing in the GEMM's epilogue, two ranks on the one GPU, 16x16 tiles
    (the general recipe) in row_major order, or swizzled in groups inside a rank's rows: rank 0
    reaches its own rows first, yet rank 1 computes rank 0's rows before its own, so nothing
    waits in a cycle and the tile program takes the order. On every SM and on two (each rank's
    GEMM on one CTA walking its 32 tile rows), the run agrees with the simulator."""
    from tldsl.ops.gemm_reduce_scatter import SPEC, gemm_reduce_scatter
    W, Ms, K, N = 2, 256, 32, 64
    comm = tl.CommSchedule(engine="copy_engine", mode="push", tile_m=16, reduce_in="epilogue")
    compute = tl.ComputeSchedule(tile=(16, 16, 16), order=order, group_m=group)
    case = SPEC.make_case(np.random.default_rng(3), W, rows_per_rank=Ms, n=N, k_per_rank=K, compute=compute, comm=comm)
    got = both(gemm_reduce_scatter, W, case.inputs, sums=True, sms=sms, **case.kwargs)
    gemms = [x for x in got.plan.kernels if x.part == "gemm"]
    assert gemms and all(type(x.lowered).__name__ == "LoweredGeneral" for x in gemms)
    if sms:
        assert all(x.ctas < (W * Ms // 16) * (N // 16) for x in gemms), got.plan.describe()
    for r in range(W):
        np.testing.assert_allclose(np.asarray(got[r]["out"], np.float32), case.expected[r]["out"], rtol=case.rtol,
                                   atol=case.atol)


@pytest.mark.parametrize("variant,ydt,vec", [("odd_col", "float32", 2), ("odd_col", "bfloat16", 2),
                                              ("col1", "float16", 1), ("col1", "float32", 1)])
def test_a_combine_gathering_at_column_offsets_no_multiple_of_4(variant, ydt, vec):
    """The combine recipe's 2- and 1-wide gathers and stores (a gather from column ``pn*BN + 2``
    or ``+ 1``, its last columns past the rows' end): the generated kernel agrees with the
    simulator, the inputs as torch tensors (bf16 too) for both."""
    import torch
    from test_codegen_moe import combine_like
    rng = np.random.default_rng(vec)
    T, R, C, topk = 300, 512, 256, 3
    inputs = [{"y": torch.from_numpy(_rand(rng, (R, C), np.float32)).to(getattr(torch, ydt)),
               "pos": torch.from_numpy(rng.integers(-1, R, topk * T).astype(np.int32)),
               "wts": torch.from_numpy(_rand(rng, (T, topk), np.float32)),
               "out": torch.full((T, C), float("nan"))}]
    got = both(combine_like, 1, inputs, compute=tl.ComputeSchedule(tile=(64, 64, 16)), variant=variant)
    [k] = got.plan.kernels
    assert type(k.lowered).__name__ == "LoweredCombine" and k.lowered.vec == vec, got.plan.describe()
    assert np.isfinite(got[0]["out"]).all()


@pytest.mark.parametrize("order", ["row_major", "comm_aligned"])
def test_a_waiting_column_of_tiles_in_the_schedules_order(order):
    """A one-axis grid of waiting tiles on the general recipe, rotated by comm_aligned to start on
    rank (rank + 1)'s share (as the simulator runs it), two ranks: every tile written once."""
    from test_codegen_tile_order import waiting_column
    n, W = 7, 2
    rng = np.random.default_rng(1)
    inputs = [{"x": _rand(rng, (8 * n, 8), np.float32), "y": np.full((8 * n, 8), np.nan, np.float32)}
              for _ in range(W)]
    got = both(waiting_column, W, inputs, n=n, compute=tl.ComputeSchedule(tile=(8, 8, 8), order=order))
    for r in range(W):
        np.testing.assert_array_equal(got[r]["y"], inputs[r]["x"])


def test_parts_waiting_on_each_other_run_on_fewer_ctas_than_tiles():
    """Two compute parts waiting on each other, in order (tile t of each on tile t of the other),
    1024 tiles each at two ranks: the run plan gives each part a share of the SMs, far fewer CTAs
    than tiles, each walking its tiles in order — as the simulator checks by default, on one
    slot per part."""
    from test_simulator import two_parts_each_way, two_parts_expected, two_parts_inputs
    W, n = 2, 1024
    inputs = two_parts_inputs(W, n)
    got = both(two_parts_each_way, W, inputs)
    assert {k.part for k in got.plan.kernels} == {"first", "second"}
    assert all(k.ctas < n // 4 for k in got.plan.kernels), got.plan.describe()
    for r in range(W):
        np.testing.assert_array_equal(got[r]["c"], two_parts_expected(inputs[r]["a"], n, False))


@pytest.mark.gpu_alone
def test_parts_waiting_on_each_other_in_crossed_order_hang_on_the_gpu():
    """The crossed order the simulator refuses by default (a deadlock on one slot per part) does
    hang on the GPU, where each part has fewer CTAs than tiles: the kernels' waits trap. In a
    process of its own (a trap leaves its CUDA context unusable)."""
    import os
    code = textwrap.dedent(f'''
        import os, sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import tldsl as tl
        from tldsl.runtime.gpu.run_errors import GpuHangError
        from test_simulator import two_parts_each_way, two_parts_inputs
        import tldsl.runtime.gpu.run_program as rp
        rp.HOST_SLACK_S = 90.0
        try:
            tl.simulate(two_parts_each_way, 1, two_parts_inputs(1, 1024), crossed=True)
            print("SIMULATED: no deadlock", flush=True)
        except tl.DeadlockError as e:
            print("SIMULATOR:", str(e).splitlines()[0], flush=True)
        try:
            tl.run(two_parts_each_way, 1, two_parts_inputs(1, 1024), crossed=True, timeout_s=2)
            print("RETURNED: no hang", flush=True)
        except GpuHangError as e:
            print("HANG REPORTED:", str(e).splitlines()[0], flush=True)
            print(str(e)[-2500:], file=sys.stderr, flush=True)     # all of it, for the assertion's message
        except BaseException as e:
            print("OTHER ERROR:", type(e).__name__, str(e)[:2000], flush=True)
        sys.stderr.flush()
        os._exit(0)
    ''')
    out = _run_alone(code, 180)
    said = f"exit status {out.returncode}\n" + out.stdout[-3000:] + out.stderr[-3000:]
    assert "SIMULATOR: deadlock in launch 1" in out.stdout, said
    assert "HANG REPORTED: launch 1 failed (" in out.stdout, said


@pytest.mark.parametrize("count, per_launch", [(0, None), (-3, None), (2, 1)])
def test_a_run_time_wait_count_the_simulator_refuses_is_a_run_check_error(count, per_launch):
    """A wait's count read from a table that the simulator refuses (not positive, or past the
    slot's notifies per launch): the kernel records it and tl.run raises RunCheckError at the
    wait's line after the launch (the wait used to pass at 0 and hang at a negative count); the
    GPU is fine afterwards — a valid count runs and agrees with the simulator."""
    from test_codegen_general import counted_wait
    from tldsl.runtime.gpu.run_errors import RunCheckError
    x = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)
    sched = dict(compute=tl.ComputeSchedule(tile=(8, 8, 8)), per_launch=per_launch)
    bad = [{"x": x, "cnt": np.array([count], np.int32), "y": np.full((8, 8), np.nan, np.float32)}]
    with pytest.raises(tl.SimulationError, match="wait count"):
        tl.simulate(counted_wait, 1, bad, **sched)
    beside = {"chain": "beside"}     # (after its producer on its stream, the wait is dropped: nothing to check)
    with pytest.raises(RunCheckError, match=f"consumer_tile_wait at .*its count was {count} at run time") as info:
        tl.run(counted_wait, 1, bad, timeout_s=5.0, lowering=beside, **sched)
    assert "test_codegen_general.py" in str(info.value)
    good = [{"x": x, "cnt": np.array([1], np.int32), "y": np.full((8, 8), np.nan, np.float32)}]
    got = tl.run(counted_wait, 1, good, timeout_s=5.0, lowering=beside, **sched)[0]["y"]
    np.testing.assert_array_equal(got, tl.simulate(counted_wait, 1, good, **sched)[0]["y"])
