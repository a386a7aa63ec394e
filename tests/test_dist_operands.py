"""The fused ops' checks of sizes, operands, outputs and of the ranks agreeing
(runtime/dist/operands.py, group.built_alike): every one an InputError before anything is
enqueued. CUDA-looking CPU tensors stand in for device tensors (no GPU needed)."""
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tldsl.errors import InputError  # noqa: E402
from tldsl.runtime.dist import group as grp  # noqa: E402
from tldsl.runtime.dist import operands as ops  # noqa: E402


class OnGpu0(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0."""
    is_cuda = True

    @property
    def device(self):
        return torch.device("cuda", 0)


def gpu(t):
    return t.as_subclass(OnGpu0)


def _aligned(shape, dtype=torch.bfloat16):
    """A tensor whose data starts 16-byte aligned (and one element later: not)."""
    n = int(np.prod(shape))
    raw = torch.empty(n + 64, dtype=dtype)
    skip = (-raw.data_ptr() % 16) // raw.element_size()
    return raw[skip:skip + n].view(shape), raw[skip + 1:skip + 1 + n].view(shape)


def test_operands_every_problem_at_once():
    a, _ = _aligned((4, 8))
    with pytest.raises(InputError) as e:
        ops.check_operands("Op", (("A", torch.zeros(4, 8, dtype=torch.bfloat16), (4, 8)),
                                  ("B", gpu(torch.zeros(8, 3, dtype=torch.float16)), (8, 16)),
                                  ("C", "not a tensor", (1,))), torch.bfloat16, 0)
    msg = str(e.value)
    assert msg.startswith("Op: ") and "A must be a CUDA tensor (it is on cpu)" in msg
    assert "B has shape (8, 3); this op was built for (8, 16)" in msg and "B is torch.float16" in msg
    assert "C must be a torch tensor, got str" in msg
    ops.check_operands("Op", (("A", gpu(a), (4, 8)),), torch.bfloat16, 0)          # all well: no error


def test_operands_alignment_contiguity_and_the_copied_shard():
    good, unaligned = _aligned((4, 8))
    with pytest.raises(InputError, match="B must start 16-byte aligned"):
        ops.check_operands("Op", (("B", gpu(unaligned), (4, 8)),), torch.bfloat16, 0)
    with pytest.raises(InputError, match="B must be contiguous"):
        ops.check_operands("Op", (("B", gpu(good.t().contiguous().t()), (4, 8)),), torch.bfloat16, 0)
    with pytest.raises(InputError, match=r"B is on cuda:0; this op runs on cuda:1"):
        ops.check_operands("Op", (("B", gpu(good), (4, 8)),), torch.bfloat16, 1)
    # the AG's shard may be strided or unaligned: the op copies it
    ops.check_operands("Op", (("A shard", gpu(unaligned), (4, 8)), ("A shard", gpu(good.t().contiguous().t()),
                                                                        (4, 8))),
                       torch.bfloat16, 0, strided_ok=("A shard",))


def test_operands_that_require_grad_are_refused_while_autograd_records():
    """The fused ops have no backward: a grad-requiring operand is refused before anything is
    enqueued (the GEMM ops' fast paths included), unless autograd is off."""
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter
    a, _ = _aligned((4, 8))
    grad = gpu(a.clone().requires_grad_())
    with pytest.raises(InputError, match=r"Op: B requires grad, but the op has no backward .*torch.no_grad\(\)"):
        ops.check_operands("Op", (("B", grad, (4, 8)),), torch.bfloat16, 0)
    with torch.no_grad():
        ops.check_operands("Op", (("B", grad, (4, 8)),), torch.bfloat16, 0)
    b = gpu(_aligned((8, 8))[0])
    op = SimpleNamespace(_closed=False, ctx=SimpleNamespace(device=0), dtype=torch.bfloat16, _tensor_type=OnGpu0,
                         _a_size=torch.Size((4, 8)), _b_size=torch.Size((8, 8)), M=4, K=8, N=8, weights="kn",
                         _engine=lambda *a: pytest.fail("launched"))
    with pytest.raises(InputError, match="MatmulReduceScatter: A requires grad"):
        MatmulReduceScatter.__call__(op, gpu(a.clone().requires_grad_()), b)


def test_output_checks_and_overlap_with_the_inputs():
    big, _ = _aligned((16, 8))
    a, b = big[:4], big[8:16]                   # one allocation, disjoint rows
    out_ok, _ = _aligned((4, 8))
    ops.check_output("Op", gpu(out_ok), (4, 8), torch.bfloat16, 0, (("A", a), ("B", b)))
    with pytest.raises(InputError, match="out overlaps B in memory"):
        ops.check_output("Op", gpu(big[8:12]), (4, 8), torch.bfloat16, 0, (("A", a), ("B", b)))
    ops.check_output("Op", gpu(big[4:8]), (4, 8), torch.bfloat16, 0, (("A", a), ("B", b)))   # between them
    with pytest.raises(InputError, match=r"out must be .* \(4, 8\) of torch.bfloat16 on cuda:1"):
        ops.check_output("Op", gpu(out_ok), (4, 8), torch.bfloat16, 1)
    with pytest.raises(InputError, match="out must be"):
        ops.check_output("Op", out_ok, (4, 8), torch.bfloat16, 0)                  # on the CPU


def test_byte_spans_of_strided_views():
    x = torch.zeros(6, 10, dtype=torch.float32)
    col = x[:, 2]                                # one column: 6 elements, 10 apart
    assert ops.byte_span(col) == (x.data_ptr() + 8, x.data_ptr() + 8 + (5 * 10 + 1) * 4)
    assert ops.overlaps(col, x[5:, :3]) and not ops.overlaps(x[:2], x[2:])
    lo, hi = ops.byte_span(x[:0])
    assert lo == hi and not ops.overlaps(x[:0], x)                                   # nothing: overlaps nothing


def test_sizes_are_positive_integers():
    ops.check_sizes("Op", M=4, K=np.int64(8))
    for bad in (1024.9, True, 0, -8, "64", None):
        with pytest.raises(InputError, match=r"Op: K=.* must be a positive int"):
            ops.check_sizes("Op", M=4, K=bad)


def test_allgather_matmul_refuses_its_sizes_before_touching_the_process_group():
    from tldsl.runtime.dist.ag_gemm import AllGatherMatmul
    with pytest.raises(InputError, match="rows_per_rank=1024.9 must be a positive int"):
        AllGatherMatmul(1024.9, 64, 64, torch.bfloat16)
    with pytest.raises(InputError, match="K=60 and N=64 must be multiples of 8"):
        AllGatherMatmul(1024, 60, 64, torch.bfloat16)


def test_gemm_ops_refuse_wrong_typed_options_before_touching_the_process_group():
    """Schedules of the wrong type (a string, a tuple, the two swapped) and ints that are not
    positive ints (0 SMs is not the default 8; True is not 1 wave) refused at construction."""
    import tldsl as tl
    from tldsl.runtime.dist.ag_gemm import AllGatherMatmul
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter, traced_comm
    for op in (lambda **kw: AllGatherMatmul(256, 64, 64, torch.bfloat16, **kw),
               lambda **kw: MatmulReduceScatter(512, 64, 64, torch.bfloat16, **kw)):
        for kw, match in ((dict(compute="fast"), "compute must be a tl.ComputeSchedule .*got str 'fast'"),
                          (dict(compute=(128, 128, 64)), "compute must be a tl.ComputeSchedule"),
                          (dict(compute=tl.CommSchedule()), "compute must be a tl.ComputeSchedule .*got CommSchedule"),
                          (dict(comm="push"), "comm must be a tl.CommSchedule"),
                          (dict(comm=tl.ComputeSchedule()), "comm must be a tl.CommSchedule .*got ComputeSchedule")):
            with pytest.raises(InputError, match=match):
                op(**kw)
    for kw, match in ((dict(engine="sm", sms=0), "sms=0 must be a positive int"),
                      (dict(engine="sm", sms="8"), "sms='8' must be a positive int"),
                      (dict(staging="gemm", stage_waves=True), "stage_waves=True must be a positive int"),
                      (dict(pusher="bogus"), "pusher='bogus': choose 'copy_engine' or 'gemm'")):
        with pytest.raises(InputError, match=match):
            AllGatherMatmul(256, 64, 64, torch.bfloat16, **kw)
    for bad in ("4", 0, True, 2.0):
        with pytest.raises(InputError, match=f"ce_chunks={bad!r} must be a positive int"):
            MatmulReduceScatter(512, 64, 64, torch.bfloat16, ce_chunks=bad)
    c = tl.ComputeSchedule(tile=(64, 64, 64))
    for comm in (tl.CommSchedule(engine="sm", mode="push"), tl.CommSchedule(engine="copy_engine", tile_m=64)):
        with pytest.raises(InputError, match="ce_chunks=2 sets the copies per peer"):     # (given, it would be ignored)
            traced_comm(comm, 256, c, ce_chunks=2)
    assert traced_comm(tl.CommSchedule(engine="copy_engine", mode="push"), 256, c, ce_chunks=2).tile_m == 128


def test_a_group_that_is_not_a_process_group_is_refused():
    """0, "" or "tp" are not WORLD (a falsy one used to become it): refused before anything else."""
    for bad in (0, "", "tp", object()):
        with pytest.raises(InputError, match="group must be a torch.distributed process group .*None: WORLD"):
            grp.dist_context(bad)


def test_ops_refuse_calls_after_close():
    from tldsl.runtime.dist.ag_gemm import AllGatherMatmul
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter
    a, b = gpu(torch.zeros(4, 8, dtype=torch.bfloat16)), gpu(torch.zeros(8, 8, dtype=torch.bfloat16))
    closed = SimpleNamespace(_closed=True)
    assert repr(object.__new__(AllGatherMatmul)) == "<AllGatherMatmul (not built)>"       # (a failed build)
    assert repr(object.__new__(MatmulReduceScatter)) == "<MatmulReduceScatter (not built)>"
    with pytest.raises(InputError, match="AllGatherMatmul was closed"):
        AllGatherMatmul._check(closed, a, b)
    with pytest.raises(InputError, match="AllGatherMatmul was closed"):
        AllGatherMatmul.compute_only(closed, a, b)
    with pytest.raises(InputError, match="MatmulReduceScatter was closed"):
        MatmulReduceScatter.compute_only(closed, a, b)
    with pytest.raises(InputError, match="MatmulReduceScatter was closed"):
        MatmulReduceScatter.__call__(SimpleNamespace(_closed=True, ctx=SimpleNamespace(device=0),
                                                     dtype=torch.bfloat16, _tensor_type=torch.Tensor), a, b)


def _three_ranks(monkeypatch, builds):
    """Run ``builds[r](build)`` inside ``built_alike`` as each of three ranks would, every rank
    seeing every rank's payload; returns each rank's error text (None: built)."""
    import torch.distributed as dist
    payloads = []
    for fn in builds:                             # what each rank sends
        sent = {}
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
        monkeypatch.setattr(dist, "all_gather_object",
                            lambda out, obj, group=None: (sent.update(obj), out.__setitem__(slice(None), [obj] * 3)))
        try:
            with grp.built_alike("Op", group=object()) as build:
                fn(build)
        except Exception:   # noqa: BLE001 - only the payload matters here
            pass
        payloads.append(dict(sent))
    results = []
    for me, fn in enumerate(builds):              # each rank again, now seeing all three payloads
        monkeypatch.setattr(dist, "all_gather_object",
                            lambda out, obj, group=None: out.__setitem__(slice(None), payloads))
        try:
            with grp.built_alike("Op", group=object()) as build:
                fn(build)
            results.append(None)
        except Exception as e:   # noqa: BLE001
            results.append(f"{type(e).__name__}: {e}")
    return results


def _config(**kw):
    def fn(build):
        build.config = kw
    return fn


def _fails(build):
    raise InputError("K=60 must be a multiple of 8")


def test_ranks_leave_an_op_s_construction_alike(monkeypatch):
    same = _three_ranks(monkeypatch, [_config(M=4096, dtype="bf16")] * 3)
    assert same == [None, None, None]
    differ = _three_ranks(monkeypatch, [_config(M=4096, K=1024, dtype="bf16"), _config(M=4096, K=1024, dtype="f16"),
                                        _config(M=4096, K=2048, dtype="f16")])
    assert len(set(differ)) == 1 and differ[0].startswith("InputError: Op: the ranks built it differently")
    assert "K: ranks 0,1 1024, rank 2 2048" in differ[0] and "dtype: rank 0 'bf16', ranks 1,2 'f16'" in differ[0]
    # one rank's error: it raises its own, its peers one naming it (none waits in the next collective)
    one = _three_ranks(monkeypatch, [_config(M=4096), _fails, _config(M=4096)])
    assert one[1] == "InputError: K=60 must be a multiple of 8"
    assert one[0] == one[2] == "InputError: Op: rank 1 could not build it (InputError: K=60 must be a multiple of 8)"


def test_disagreements_name_the_ranks():
    configs = [dict(M=4096, K=1024, dtype="bf16"), dict(M=4096, K=1024, dtype="f16"),
               dict(M=4096, K=2048, dtype="f16")]
    assert grp.disagreements(configs) == ["K: ranks 0,1 1024, rank 2 2048", "dtype: rank 0 bf16, ranks 1,2 f16"]
    assert grp.disagreements([configs[0], dict(configs[0])]) == []


def test_built_alike_costs_nothing_without_a_process_group():
    with grp.built_alike("Op") as build:           # torch.distributed not initialised here
        build.config = {"M": 1}
    with pytest.raises(InputError, match="own error"):
        with grp.built_alike("Op"):
            raise InputError("own error")


def test_dense_copies_only_what_tma_cannot_read():
    good, unaligned = _aligned((4, 8))
    good.copy_(torch.arange(32).view(4, 8))
    unaligned.copy_(torch.arange(32).view(4, 8))
    assert ops.dense(good) is good
    for view in (unaligned, good.t().contiguous().t()):
        d = ops.dense(view)
        assert d is not view and d.is_contiguous() and d.data_ptr() % 16 == 0 and torch.equal(d, view)


def test_init_ranks_starts_a_torchrun_script(monkeypatch):
    """Multicast off where unset (a value already set is kept), the NCCL group, this rank's GPU
    from LOCAL_RANK, WORLD's name back."""
    import os
    import types
    import torch.distributed as dist
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")
    monkeypatch.setenv("RANK", "3")                                        # (LOCAL_RANK wins)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, device_id=None: calls.append(("init", backend, str(device_id))))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("device", d)))
    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=types.SimpleNamespace(group_name="0")))
    assert grp.init_ranks() == "0"
    # the group is bound to this rank's GPU (its barriers need not guess the device)
    assert calls == [("device", 1), ("init", "nccl", "cuda:1")] and os.environ["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("rank, peer_ok", [(0, True), (0, False), (1, True)])
def test_check_scripts_agree_on_one_verdict(monkeypatch, capsys, rank, peer_ok):
    """A torchrun check's end: the verdict is every rank's (a peer's failure fails rank 0 too),
    rank 0 prints every case, a peer only its own failures."""
    import torch.distributed as dist
    from tldsl.checks.verdict import report
    calls = []
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: t.clamp_(max=1.0 if peer_ok else 0.0))
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    results = [("case a", True, "right"), ("case b", rank == 0, "wrong" if rank else "right")]
    status = report("some_check", results, device="cpu")
    out = capsys.readouterr().out.splitlines()
    passed = peer_ok and rank == 0
    assert status == (0 if passed else 1) and calls == ["barrier", "destroy"]
    if rank == 0:
        assert out == ["some_check case a: PASS [rank 0] right", "some_check case b: PASS [rank 0] right",
                       f"some_check: {'all passed' if passed else 'FAILED'}"]
    else:
        assert out == ["some_check case b: FAIL [rank 1] wrong"]
