"""The fused GEMM ops' schedules without a hand-built path run on the one fused-op runtime
(runtime/dist/program_engine.py): ``AllGatherMatmul`` with the generated SM all-gather (push and
pull) or the codegen copy-engine plan, ``MatmulReduceScatter`` with the SM reduce-scatter — each
the library's tile program as a FusedProgram. Every rank's real op is built in a thread of its own
and run on the fake GPU of tests/test_program_op.py (each kernel launch runs the tile program it
was lowered from on the memory its arguments name; streams interleaved at random), and its results
are checked against numpy over several launches with new inputs each."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl

torch = pytest.importorskip("torch")

from test_program_op import Group, host  # noqa: E402
from test_reprs import assert_notebook_native  # noqa: E402

from tldsl.runtime.dist import ag_gemm, gemm_rs, program_op  # noqa: E402
from tldsl.runtime.dist.ag_gemm import AllGatherMatmul  # noqa: E402
from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter  # noqa: E402
from tldsl.runtime.dist.program_engine import ProgramEngine  # noqa: E402
from tldsl.runtime.dist.timeline import format_phases, segments  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::tldsl.runtime.dist.symmetric.SymmetricMemoryWarning")

C16 = tl.ComputeSchedule(tile=(16, 16, 16))
AG_SCHEDULES = {
    "sm-pull": dict(comm=tl.CommSchedule(engine="sm", mode="pull", tile_m=16, sms=1)),
    "sm-push": dict(comm=tl.CommSchedule(engine="sm", mode="push", order="full_mesh", tile_m=16, sms=2)),
    "plan-pull": dict(comm=tl.CommSchedule(engine="copy_engine", mode="pull"), ce_executor="plan"),
    "plan-push": dict(comm=tl.CommSchedule(engine="copy_engine", mode="push"), ce_executor="plan"),
}


def ops_group(monkeypatch, W, seed=0):
    """A fake group whose ranks build the fused GEMM ops (their host-side operand checks are for
    CUDA tensors: tested elsewhere)."""
    g = Group(monkeypatch, W, seed)
    monkeypatch.setenv("TLDSL_WAIT_TIMEOUT_NS", str(2_000_000_000))     # a wait nothing satisfies: an error
    for m in (ag_gemm, gemm_rs):
        monkeypatch.setattr(m, "dist_context", program_op.dist_context)
    monkeypatch.setattr(AllGatherMatmul, "_check", lambda self, a, b: None)
    monkeypatch.setattr(AllGatherMatmul, "_check_out", lambda self, out, a, b: None)
    monkeypatch.setattr(gemm_rs, "validate_operands", lambda *a, **k: None)
    monkeypatch.setattr(gemm_rs, "check_output", lambda *a, **k: None)
    return g


def f16(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float16))


def close_to(got, want, k):
    np.testing.assert_allclose(host(got).astype(np.float32), want, rtol=2e-2, atol=2e-2 * max(1.0, np.sqrt(k) / 4))


@pytest.mark.parametrize("variant", sorted(AG_SCHEDULES))
@pytest.mark.parametrize("W", [2, 3])
def test_allgather_matmul_schedules_on_the_runtime(monkeypatch, variant, W):
    Ms, K, N = 32, 16, 48
    g = ops_group(monkeypatch, W, seed=W)
    ops = g.build(lambda r, dev: AllGatherMatmul(Ms, K, N, torch.float16, compute=C16, **AG_SCHEDULES[variant]))
    assert all(isinstance(op._engine, ProgramEngine) for op in ops)
    assert ops[0].engine == ("sm" if variant.startswith("sm") else "copy_engine-plan")
    rng = np.random.default_rng(W)
    for L in (1, 2, 3):                                 # new inputs every launch
        shards = [f16(rng, Ms, K) for _ in range(W)]
        b = f16(rng, K, N)
        outs = [torch.full((W * Ms, N), float("nan"), dtype=torch.float16) for _ in range(W)]
        for r in g.fake.rng.sample(range(W), W):        # the hosts enqueue in any order
            # the gathered rows: a copy of the op's buffer, or (launch 3) none at all
            gathered, c = ops[r](shards[r], b, out=outs[r], return_gathered=L < 3)
            buffer = ops[r].workspace_tensors()["a_gathered"]
            assert c is outs[r] and (gathered is None if L == 3 else gathered.data_ptr() != buffer.data_ptr())
        for op in ops:
            op._engine.program.synchronize()
        want = np.concatenate([host(s) for s in shards]).astype(np.float32)
        for r, op in enumerate(ops):
            assert op.launches == L
            assert np.array_equal(host(op.workspace_tensors()["a_gathered"]), want.astype(np.float16))
            close_to(outs[r], want @ host(b).astype(np.float32), K)
    for op in ops:
        op.close()
    with pytest.raises(Exception, match="closed"):
        ops[0].signal_tensors()


@pytest.mark.parametrize("W", [2, 4])
def test_matmul_reduce_scatter_sm_schedule_on_the_runtime(monkeypatch, W):
    Ms, K, N = 16, 16, 32
    g = ops_group(monkeypatch, W, seed=W)
    comm = tl.CommSchedule(engine="sm", tile_m=16, sms=1)
    ops = g.build(lambda r, dev: MatmulReduceScatter(W * Ms, K, N, torch.float16, compute=C16, comm=comm))
    assert all(isinstance(op._engine, ProgramEngine) for op in ops) and ops[0].lanes == 1
    rng = np.random.default_rng(W)
    for L in (1, 2):
        a = [f16(rng, W * Ms, K) for _ in range(W)]
        b = [f16(rng, K, N) for _ in range(W)]
        outs = [torch.full((Ms, N), float("nan"), dtype=torch.float16) for _ in range(W)]
        for r in g.fake.rng.sample(range(W), W):
            assert ops[r](a[r], b[r], out=outs[r]) is outs[r]
        for op in ops:
            op._engine.program.synchronize()
        # partials rounded to fp16 before the sum (partial_dtype="out", the default)
        parts = [(host(a[q]).astype(np.float32) @ host(b[q]).astype(np.float32)).astype(np.float16)
                 .astype(np.float32) for q in range(W)]
        total = sum(parts)
        for r in range(W):
            close_to(outs[r], total[r * Ms:(r + 1) * Ms], K * W)
    assert [s[0] for s in ops[0].signal_map()][-1] == "handshake"
    assert set(ops[0].signal_tensors()) == {s.name for s in ops[0].ir.signals}
    assert "partial" in ops[0].workspace_tensors()
    assert_notebook_native(ops[0], f"<MatmulReduceScatter rank 0/{W}: A [{W * Ms}, {K}]", "engine='sm'",
                           "2 launches>")
    text = ops[0].describe()
    assert "fused-op runtime" in text and "part gemm" in text and "part reduce_scatter" in text
    for op in ops:
        op.close()


def test_hooks_and_timeline_see_every_part(monkeypatch):
    """The distributed checks' straggler hooks and the phase timeline, through the runtime: each
    launch calls ``before_comm`` and ``before_compute`` once (with the op and the part's stream)
    and marks its start (before the entry handshake) and each part's start and end."""
    W, Ms, K, N = 2, 16, 16, 16
    g = ops_group(monkeypatch, W)
    ops = g.build(lambda r, dev: AllGatherMatmul(Ms, K, N, torch.float16, compute=C16, **AG_SCHEDULES["sm-push"]))
    seen = []

    class Marks:
        def __init__(self):
            self.labels = []

        def mark(self, label, stream, name):
            self.labels.append((label, name))
    ops[0].hooks = {"before_compute": lambda op, L, s: seen.append(("compute", L, s, op.engine)),
                    "before_comm": lambda op, L, s: seen.append(("comm", L, s, op.engine))}
    ops[0].timeline = Marks()
    rng = np.random.default_rng(0)
    kept = []                                       # (the fake GPU reads them when it runs)
    for _ in range(2):
        b = f16(rng, K, N)
        for r in range(W):
            kept.append(f16(rng, Ms, K))
            kept.append(ops[r](kept[-1], b))        # (C: written by the fake GPU later)
        kept.append(b)
    for op in ops:
        op._engine.program.synchronize()
    assert sorted((k, L) for k, L, _, _ in seen) == [("comm", 1), ("comm", 2), ("compute", 1), ("compute", 2)]
    assert len({s for _, _, s, _ in seen}) == 2              # each part on a stream of its own
    assert {e for *_, e in seen} == {"sm"}                   # hooks get the op the caller holds
    assert ops[0].timeline.labels == [("start", "caller"), ("gather_a start", "comm"), ("gather_a done", "comm"),
                                      ("gemm start", "compute"), ("gemm done", "compute")] * 2
    for op in ops:
        op.close()


def test_ops_without_a_direct_path_hold_no_symmetric_memory_of_their_own(monkeypatch):
    """The op's own lease stays empty: the program's lease holds every block, and the op's
    close() frees it (collectively, every rank)."""
    from tldsl.runtime.dist import symmetric
    W = 2
    g = ops_group(monkeypatch, W)
    ops = g.build(lambda r, dev: AllGatherMatmul(16, 16, 16, torch.float16, compute=C16, **AG_SCHEDULES["sm-pull"]))
    own = symmetric._LEDGER[ops[0]._lease.key]
    program = symmetric._LEDGER[ops[0]._engine.program._lease.key]
    assert not own.blocks and program.blocks
    keys = [op._engine.program._lease.key for op in ops]
    g.build(lambda r, dev: ops[r].close())
    assert all(k not in symmetric._LEDGER or symmetric._LEDGER[k].state == "lingering" for k in keys)


# =================================================================================================
# the NVSHMEM transport: symmetric memory and counters from NVSHMEM's heap
# =================================================================================================

def fake_nvshmem(monkeypatch, group):
    """NVSHMEM's heap on the fake GPU: each rank's workspace one host block, every rank's base
    exchanged at its construction (as ``nvshmem_malloc`` is collective), peer addresses found on
    the device as ``nvshmem_ptr`` finds them; each module's NVSHMEM initialisation recorded."""
    import types
    import torch.distributed._symmetric_memory as symm_mem
    from tldsl.runtime.dist import nvshmem
    from tldsl.runtime.dist.regions import layout_regions
    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32,
              "u64": torch.int64}
    seen = types.SimpleNamespace(inits=[], closed=0, regions=[])

    class Workspace:
        def __init__(self, ctx, specs, lease=None, **kw):
            self.regions, total = layout_regions(specs, 512)
            raw = torch.zeros(total + 512, dtype=torch.uint8)
            pad = (-raw.data_ptr()) % 512
            self.raw = raw[pad:pad + total]
            bases = symm_mem.rendezvous(self.raw, "nvshmem").buffer_ptrs      # every rank's block
            group.fake.heaps.append((ctx.rank, self.raw.data_ptr(), total, tuple(bases)))
            self.tensors = {r.name: self.raw[r.offset:r.offset + r.nbytes].view(dtypes[r.dtype]).view(r.shape)
                            for r in self.regions}
            self.addresses = {r.name: tuple(b + r.offset for b in bases) for r in self.regions}
            self.nv = types.SimpleNamespace(init_module=seen.inits.append)
            seen.regions.append([r.name for r in self.regions])

        def close(self):
            seen.closed += 1
    monkeypatch.setattr(nvshmem, "NvshmemWorkspace", Workspace)
    return seen


@pytest.mark.parametrize("W", [2, 3])
def test_a_program_on_the_nvshmem_transport(monkeypatch, W):
    """transport='nvshmem': the communication kernel reaches peers through NVSHMEM (no pointer
    tables), so every symmetric buffer and counter lives in NVSHMEM's heap; its module is
    initialised once; the results agree with the simulator over two launches."""
    from test_gpu_run import assert_agrees
    from test_program_op import library_case, simulated, tensors
    fn, inputs, kw = library_case("allgather_gemm", W)
    kw = dict(kw, comm=kw["comm"].with_(transport="nvshmem"))
    want = simulated(fn, W, inputs, 2, **kw)
    g = Group(monkeypatch, W, seed=W)
    seen = fake_nvshmem(monkeypatch, g)
    ops = g.build(lambda r, dev: program_op.FusedProgram(fn, None, inputs[r], device=dev, timeout_s=2.0, **kw))
    args = [tensors(inputs[r]) for r in range(W)]
    for _ in range(2):
        for r in g.fake.rng.sample(range(W), W):
            ops[r](**args[r])
    for op in ops:
        op.synchronize()
    assert_agrees([{n: host(t) for n, t in a.items()} for a in args], want.outputs, want.kernel, sums=True)
    comm_entry = ops[0].lowered["gather_a"].entry
    assert seen.inits == [f"module of {comm_entry}"] * W                 # the communication kernel's only
    assert seen.regions[0] == sorted(["a", "a_gathered", program_op.COUNTERS], key=seen.regions[0].index)
    assert all(p.source.split(":")[0] not in ("peers", "peer_signals") for p in ops[0].lowered["gather_a"].params)
    for op in ops:
        op.close()
    assert seen.closed == W


def test_the_timeline_names_each_part_of_a_program_launch():
    """A program launch's marks read as phases: the entry handshake's wait, the all-gather kernel
    beside the GEMM (each from its own start), and the text timeline has a glyph for each."""
    phases = [("start", "caller", 0.0), ("gather_a start", "comm", 0.2), ("gather_a done", "comm", 0.5),
              ("gemm start", "compute", 0.2), ("gemm done", "compute", 1.0)]
    assert segments(phases) == [("comm", "barrier", 0.0, 0.2), ("comm", "all-gather", 0.2, 0.5),
                                ("compute", "barrier", 0.2, 0.2), ("compute", "GEMM", 0.2, 1.0)]
    text = format_phases([phases], width=10)
    assert "?" not in text and "A" in text and "G" in text


@pytest.mark.parametrize("variant", ["sm-pull", "plan-push", "default"])
def test_allgather_matmul_of_a_linear_weight_runs_its_tile_program(monkeypatch, variant):
    """``weights="nk"``: B given as stored by a torch Linear ([N, K]), read K-major by the GEMM with no
    copy — the op's tile program on the fused-op runtime whatever the schedule (the direct copy-engine
    paths take B [K, N] only); the same C as torch's ``gathered @ b.T``."""
    W, Ms, K, N = 2, 32, 16, 48
    g = ops_group(monkeypatch, W, seed=7)
    kw = {} if variant == "default" else AG_SCHEDULES[variant]
    ops = g.build(lambda r, dev: AllGatherMatmul(Ms, K, N, torch.float16, compute=C16, weights="nk", **kw))
    assert all(isinstance(op._engine, ProgramEngine) for op in ops)
    assert ops[0]._problem() == "A shard [32, 16] @ B [48, 16]^T torch.float16" and ops[0].b_shape == (N, K)
    rng = np.random.default_rng(3)
    shards = [f16(rng, Ms, K) for _ in range(W)]
    w = f16(rng, N, K)
    outs = [torch.full((W * Ms, N), float("nan"), dtype=torch.float16) for _ in range(W)]
    for r in g.fake.rng.sample(range(W), W):
        ops[r](shards[r], w, out=outs[r])
    for op in ops:
        op._engine.program.synchronize()
    want = np.concatenate([host(s) for s in shards]).astype(np.float32) @ host(w).astype(np.float32).T
    for r in range(W):
        close_to(outs[r], want, K)
    for op in ops:
        op.close()


def test_allgather_matmul_refuses_a_linear_weight_on_the_direct_path(monkeypatch):
    from tldsl.errors import InputError
    g = ops_group(monkeypatch, 2)
    with pytest.raises(InputError, match="weights='nk': the direct copy-engine path takes B \\[K, N\\]"):
        g.build(lambda r, dev: AllGatherMatmul(32, 16, 48, torch.float16, ce_executor="direct", weights="nk"))
    with pytest.raises(InputError, match="weights must be one of"):
        g.build(lambda r, dev: AllGatherMatmul(32, 16, 48, torch.float16, weights="t"))


def test_a_linear_weight_at_the_shapes_whose_default_stages_rows_in_the_gemm(monkeypatch):
    """Where the direct path would stage this rank's rows in the GEMM (its default at these shapes), a
    ``weights="nk"`` op takes the tile program, with none of the direct path's options set for it."""
    from tldsl.runtime.dist import ag_gemm as agm
    W, Ms, K, N = 2, 256, 512, 4096
    g = ops_group(monkeypatch, W)
    monkeypatch.setattr(agm, "default_staging", lambda *a, **k: ("gemm", 3))      # what the direct path would take
    ops = g.build(lambda r, dev: AllGatherMatmul(Ms, K, N, torch.float16, weights="nk",
                                                 comm=tl.CommSchedule(engine="copy_engine", mode="pull")))
    assert all(isinstance(op._engine, ProgramEngine) for op in ops)
    for op in ops:
        op.close()


@pytest.mark.parametrize("engine", [None, "sm"])
def test_matmul_reduce_scatter_of_a_linear_weight_on_the_runtime(monkeypatch, engine):
    """``weights="nk"``: each rank's B given as a torch Linear keeps it ([N, K]); the SM schedule on
    the runtime (the default for it), the same sums as numpy's on the transposed B; the copy-engine
    path, which takes B [K, N] only, refused by name."""
    from tldsl.errors import InputError
    W, Ms, K, N = 2, 16, 16, 32
    g = ops_group(monkeypatch, W, seed=4)
    ops = g.build(lambda r, dev: MatmulReduceScatter(W * Ms, K, N, torch.float16, compute=C16, engine=engine,
                                                     weights="nk"))
    assert all(isinstance(op._engine, ProgramEngine) for op in ops)
    assert ops[0]._problem() == f"A [{W * Ms}, {K}] @ B [{N}, {K}]^T -> out [{Ms}, {N}] torch.float16"
    rng = np.random.default_rng(9)
    a = [f16(rng, W * Ms, K) for _ in range(W)]
    w = [f16(rng, N, K) for _ in range(W)]
    outs = [torch.full((Ms, N), float("nan"), dtype=torch.float16) for _ in range(W)]
    for r in g.fake.rng.sample(range(W), W):
        assert ops[r](a[r], w[r], out=outs[r]) is outs[r]
    for op in ops:
        op._engine.program.synchronize()
    parts = [(host(a[q]).astype(np.float32) @ host(w[q]).astype(np.float32).T).astype(np.float16).astype(np.float32)
             for q in range(W)]
    for r in range(W):
        close_to(outs[r], sum(parts)[r * Ms:(r + 1) * Ms], K * W)
    for op in ops:
        op.close()
    with pytest.raises(InputError, match="weights='nk' runs the SM schedule"):
        g.build(lambda r, dev: MatmulReduceScatter(W * Ms, K, N, torch.float16, engine="copy_engine", weights="nk"))
