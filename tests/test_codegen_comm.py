"""Communication lowering (recipes ``sm_comm`` and ``copy_engine``) and the GEMM epilogue's notifies
(recipe ``gemm``), checked three ways without a GPU:

* **NVRTC + SASS** (marker ``nvrtc``; skipped only where the CUDA wheels are missing): every
  communication variant the library ops use is lowered and compiled for sm_90a; its SASS must
  show the release reductions of its notifies (``REDG.E.ADD.64.STRONG.GPU`` / ``.SYS`` after a
  ``MEMBAR.ALL.GPU`` / ``.SYS``), the acquire loads of its waits (``LDG.E.64.STRONG.GPU`` /
  ``.SYS``), 16-byte vector loads / stores, no ``BPT.TRAP`` and the spill budget below.
* **CPU emulation** (needs ``g++``): the same generated source, compiled by the host compiler
  with ``TLDSL_HOST_EMULATION`` (one ``std::thread`` per CUDA thread, a ``std::barrier`` per
  CTA, host atomics for signals), runs every rank's CTAs at once; its results and signal
  counters must equal the simulator's bit for bit. This executes the generated index code,
  clipping, tails, vector / element paths, waits and notifies for real.
* **Copy-engine plans** are executed in numpy (raw bytes, the plan's offsets and pitches)
  and compared with the simulator.
"""
from __future__ import annotations

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
from tldsl.codegen import lower, lower_all
from tldsl.codegen import CeCopy, CeSignalWrite, CopyEnginePlan, LoweredComm, lower_comm, plan_copy_engine
from tldsl.codegen.plan.comm import task_decode
from tldsl.codegen import LoweringError, lower_gemm, match_gemm
from tldsl.kernel import TensorSpec as S
from tldsl.ops.allgather_gemm import allgather_gemm
from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter
from tldsl.ops.moe import allgather_moe, moe_num_tiles
from tldsl.ops.sp_attention import sp_attention
from tldsl.runtime.sim.engine import Engine
from tldsl.runtime.sim.memory import Memory, poison_value, to_storage
from tldsl.runtime.sim.options import SimOptions

import host_build

INCLUDE = Path(__file__).resolve().parent.parent / "codegen" / "include"

_OK, _WHY = tcm.toolchain_available()
needs_cuobjdump = pytest.mark.skipif(not _OK or tcm.find_toolchain().cuobjdump is None,
                                     reason=f"CUDA wheels missing (NVRTC + cuobjdump): {_WHY or 'no cuobjdump'}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++) for the CPU emulation")

#: Spill budget of every generated kernel: no spill bytes, no stack, no local-memory instructions.
SPILL_BUDGET_BYTES = 0
#: Communication kernels: 256 threads per CTA, so ptxas may use up to 255 registers.
COMM_MAX_REGISTERS = 255
#: The plain GEMM's SASS size (instructions) for tile 128x256x64, 4 stages, bf16 (1328 before the
#: epilogue notifies existed; 1216 since the 16-bit epilogue stores by stmatrix; 1400 since a tile's C is
#: held and stored during the next K loop: the store of each chunk is inlined once per chunk); NoNotifies
#: must compile to the same code (tolerance for toolchain noise).
PLAIN_GEMM_INSTRUCTIONS = 1400


# =================================================================================================
# the variants the library ops use
# =================================================================================================

def ag_kernel(W=4, comm=None, Ms=1000, K=512, dt=tl.float16, tile=(128, 128, 64), **sched):
    return allgather_gemm.trace(W, S((Ms, K), dt), S((K, 768), dt), S((W * Ms, 768), dt),
                                compute=tl.ComputeSchedule(tile=tile, **sched), comm=comm)


def rs_kernel(W=4, comm=None, Ms=250, N=768, K=512, dt=tl.float16, tile=(128, 128, 64), partial_dtype="f32",
              **sched):
    return gemm_reduce_scatter.trace(W, S((W * Ms, K), dt), S((K, N), dt), S((Ms, N), dt),
                                     compute=tl.ComputeSchedule(tile=tile, **sched), comm=comm,
                                     partial_dtype=partial_dtype)


def moe_kernel(W=4, comm=None, Ms=64, K=256, E=8, topk=2, BM=64):
    NT = moe_num_tiles(W * Ms * topk, E, BM)
    return allgather_moe.trace(W, S((Ms, K), tl.bfloat16), S((E, K, 128), tl.bfloat16), S((NT,), tl.int32),
                               S((NT,), tl.int32), S((NT, 2), tl.int32), S((NT,), tl.int32), S((NT * BM,), tl.int32),
                               S((NT * BM, 128), tl.bfloat16),
                               compute=tl.ComputeSchedule(tile=(BM, 128, 64)), comm=comm)


def spa_kernel(W=4, comm=None, Sl=512, H=4, D=64, dt=tl.bfloat16):
    return sp_attention.trace(W, S((Sl, H * D), dt), S((Sl, H * D), dt), S((Sl, H * D), dt),
                              S((Sl, H * D), dt), heads=H, compute=tl.ComputeSchedule(tile=(64, 64, 64)), comm=comm)


AG_SM = [tl.CommSchedule(tile_m=64, mode=m, order=o, sms=8) for m in ("pull", "push") for o in ("ring", "full_mesh")]
RS_SM = [tl.CommSchedule(tile_m=64, mode=m, order=o, sms=8) for m in ("push", "pull") for o in ("ring", "full_mesh")]
CE = [tl.CommSchedule(engine="copy_engine", mode=m) for m in ("pull", "push")]


def _name(c: tl.CommSchedule) -> str:
    return f"{c.engine}-{c.mode}-{c.order}-{c.tile_m}"


def comm_parts(k):
    return [p for p in k.parts if p.role == "comm"]


# =================================================================================================
# host-side lowering: structure, parameters, errors
# =================================================================================================

def test_task_decode_matches_schedule_order():
    for grid in [(4,), (3, 5), (4, 2, 3), (1, 7), (5, 1)]:
        for order in ("ring", "full_mesh"):
            dec = task_decode(grid, order)
            got = []
            for t in range(int(np.prod(grid))):
                c = [0] * len(grid)
                for axis, div, mod in dec:
                    c[axis] = t // div if mod is None else (t // div) % mod
                got.append(tuple(c))
            assert got == tl.CommSchedule(order=order).task_order(grid), (grid, order)


@pytest.mark.parametrize("comm", AG_SM, ids=_name)
def test_allgather_sm_parameters(comm):
    k = ag_kernel(W=4, comm=comm)
    lc = lower(k, comm_parts(k)[0])
    assert isinstance(lc, LoweredComm)
    src = {p.name: p.source for p in lc.params}
    assert src["rank"] == "rank" and src["launch"] == "launch"
    assert lc.grid() == (8, 1, 1) and lc.block == (256, 1, 1) and lc.smem_bytes == 0
    assert lc.num_tasks == 4 * 16 and lc.order == comm.order and lc.lanes == 8
    if comm.mode == "pull":      # read peers' shards, write this rank's gathered buffer, local notify
        assert src["buf_a_peers"] == "peers:a" and src["buf_a_gathered"] == "buffer:a_gathered"
        assert src["sig_gather_a_ready"] == "signal:gather_a_ready"
        assert "tldsl::comm::cta_notify<tldsl::kScopeGpu>(sig_gather_a_ready + " in lc.source
    else:                        # read the local shard, write peers' gathered buffers, notify peers
        assert src["buf_a"] == "buffer:a" and src["buf_a_gathered_peers"] == "peers:a_gathered"
        assert src["sig_gather_a_ready_peers"] == "peer_signals:gather_a_ready"
        assert "tldsl::comm::cta_notify<tldsl::kScopeSys>(sig_gather_a_ready_peers[" in lc.source
    ptr_types = {p.name: p.ctype for p in lc.params}
    assert all("__restrict__" in t for n, t in ptr_types.items() if n.endswith("_peers"))
    assert not any("__restrict__" in t for n, t in ptr_types.items() if n.startswith("buf_") and
                   not n.endswith("_peers")), "data pointers must not be restrict (no non-coherent loads)"
    assert lc.transfers == 1 and lc.notifies == 1 and lc.waits == 0
    # every generated index line carries the tile program's line
    body = [l for l in lc.source.splitlines() if l.strip().startswith("const int t_")]
    assert body and all("// tldsl: " in l and "allgather_gemm.py:" in l for l in body)


@pytest.mark.parametrize("comm", RS_SM, ids=_name)
def test_reduce_scatter_sm_parameters(comm):
    k = rs_kernel(W=4, comm=comm)
    lc = lower_comm(k)
    src = {p.name: p.source for p in lc.params}
    stage = "reduce_scatter_recv" if comm.mode == "push" else "reduce_scatter_send"
    assert src["buf_partial"] == "buffer:partial" and src["buf_out"] == "buffer:out"
    assert src["sig_reduce_scatter_ready"] == "signal:reduce_scatter_ready"
    assert src["sig_reduce_scatter_arrived"] == "signal:reduce_scatter_arrived"
    assert src["sig_reduce_scatter_arrived_peers"] == "peer_signals:reduce_scatter_arrived"
    assert src[f"buf_{stage}_peers"] == f"peers:{stage}"
    ctypes = {p.name: p.ctype for p in lc.params}
    assert ctypes["buf_partial"] == "const float*" and ctypes["buf_out"] == "tldsl::comm::f16*"
    assert "tldsl::comm::cta_wait<tldsl::kScopeGpu>(sig_reduce_scatter_ready + " in lc.source      # consumer
    assert "tldsl::comm::cta_wait<tldsl::kScopeSys>(sig_reduce_scatter_arrived + " in lc.source    # peer
    assert "* launch);" in lc.source                                                                # epochs
    tpr = lc.num_tasks // (4 if comm.order == "ring" else 2)
    if comm.order == "ring":    # (step, tile) tasks: a ready wait, then one branch per step kind
        assert (lc.waits, lc.notifies, lc.num_tasks) == (3, 2, 4 * tpr)
    else:                       # send phase (3 waits, 3 notifies), then the sum (3 + 1 waits)
        assert (lc.waits, lc.notifies, lc.num_tasks) == (2 * 4 - 1, 3, 2 * tpr)


def test_lower_all_gives_gemm_and_comm_kernels():
    from tldsl.codegen import LoweredGemm
    out = lower_all(rs_kernel(W=4, comm=RS_SM[0]))
    assert isinstance(out["gemm"], LoweredGemm) and out["gemm"].notifies == 1
    assert isinstance(out["reduce_scatter"], LoweredComm)
    out = lower_all(ag_kernel(W=4, comm=AG_SM[0]), wait_timeout_ns=10**9)
    assert out["gather_a"].options == ("-DTLDSL_WAIT_TIMEOUT_NS=1000000000ull",)


def test_copy_engine_part_lowers_to_a_plan():
    k = ag_kernel(W=4, comm=CE[0])
    out = lower_all(k)
    assert isinstance(out["gather_a"], CopyEnginePlan)
    with pytest.raises(LoweringError, match="copy engine"):
        lower_comm(k, "gather_a")


# -- what the lowering refuses, at the user's line -----------------------------------------------------

@tl.kernel
def comm_with_dot(x: tl.Symmetric, y, *, comm: tl.CommSchedule = None):
    W = tl.world_size()
    n = x.shape[0]

    @tl.comm_part(grid=(W,))
    def mix(s):
        t = tl.load(x.at((tl.rank() + s) % W), (0, 0), (n, n))
        tl.store(y, (s * n, 0), tl.dot(t, t))                                   # not elementwise


@tl.kernel
def comm_load_then_notify(x: tl.Symmetric, y: tl.Symmetric, *, comm: tl.CommSchedule = None):
    W = tl.world_size()
    n = x.shape[0]
    done = tl.signal("done", W, scope="symmetric")

    @tl.comm_part(grid=(W,))
    def send(s):
        peer = (tl.rank() + s) % W
        t = tl.load(x, (0, 0), (n, n))
        tl.peer_tile_notify(done, tl.rank(), peer)                               # release ...
        tl.store(y.at(peer), (tl.rank() * n, 0), t)                              # ... then the data


@tl.kernel
def comm_tile_across_loop(x, y, *, comm: tl.CommSchedule = None):
    n = x.shape[0]

    @tl.comm_part(grid=(1,))
    def rep(s):
        t = tl.load(x, (0, 0), (n, n))
        for i in tl.range(0, 4):
            tl.store(y, (i * n, 0), t)


@tl.kernel
def gemm_store_after_store(a, b, c, d, *, compute: tl.ComputeSchedule = None):
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def mm(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        tl.store(c, (pm * BM, pn * BN), acc)
        tl.store(d, (pm * BM, pn * BN), acc)


def _raises_here(fn, text):
    with pytest.raises(LoweringError) as ei:
        fn()
    e = ei.value
    assert text in str(e), str(e)
    assert e.loc is not None and e.loc.filename == __file__, e.loc
    return e


def test_lowering_errors_name_the_op_and_line():
    f16 = tl.float16
    comm = tl.CommSchedule()
    e = _raises_here(lambda: lower_comm(comm_with_dot.trace(2, S((16, 16), f16), S((32, 16), f16), comm=comm)),
                     "'dot' is not supported in a communication part on SMs")
    assert "tl.dot(t, t)" in e.loc.source
    e = _raises_here(lambda: lower_comm(comm_load_then_notify.trace(2, S((16, 16), f16), S((32, 16), f16),
                                                                    comm=comm)), "after a notify")
    assert "tl.load(x, (0, 0), (n, n))" in e.loc.source
    _raises_here(lambda: lower_comm(comm_tile_across_loop.trace(1, S((8, 8), f16), S((32, 8), f16), comm=comm)),
                 "inside a tl.range loop")
    sched = tl.ComputeSchedule(tile=(128, 128, 64))
    k = gemm_store_after_store.trace(1, S((256, 128), f16), S((128, 256), f16), S((256, 256), f16),
                                     S((256, 256), f16), compute=sched)
    e = _raises_here(lambda: lower_gemm(k), "after the tile's store is not supported")
    assert "tl.store(d" in e.loc.source


# =================================================================================================
# GEMM + ReduceScatter: the compute part's notifies in the epilogue
# =================================================================================================

@pytest.mark.parametrize("tile,tile_m", [((128, 256, 64), 64), ((64, 128, 64), 128), ((128, 128, 64), None)])
def test_gemm_epilogue_notifies_from_the_ir(tile, tile_m):
    k = rs_kernel(W=4, comm=tl.CommSchedule(tile_m=tile_m, order="ring", mode="push"), Ms=256, tile=tile, stages=3)
    lg = lower_gemm(k)
    assert lg.waits == 0 and lg.notifies == 1 and lg.notify_signals == ("reduce_scatter_ready",)
    p = {q.name: q for q in lg.params}
    assert p["sig_reduce_scatter_ready"].source == "signal:reduce_scatter_ready"
    assert p["sig_reduce_scatter_ready"].ctype.startswith("unsigned long long*")      # written
    assert "struct TileNotifies" in lg.source and "kScope = tldsl::kScopeGpu" in lg.source
    assert "tldsl::red_relaxed_add<tldsl::kScopeGpu>(sig_reduce_scatter_ready + " in lg.source
    assert "TileNotifies{rank, sig_reduce_scatter_ready}" in lg.source
    notify = lg.source.split("struct TileNotifies")[1].split("};")[0]
    code = [l for l in notify.splitlines() if "const int" in l or "for (" in l or "red_relaxed" in l]
    assert code and all("gemm_reduce_scatter.py:" in l for l in code)
    assert "notify(s) on ['reduce_scatter_ready']" in lg.describe()


def test_plain_gemm_source_has_no_notify_code():
    from test_codegen_host import trace_plain
    lg = lower_gemm(trace_plain())
    assert lg.notifies == 0 and "TileNotifies" not in lg.source
    assert "tldsl::sm90::NoWaits{});" in lg.source                # the call is unchanged: NoNotifies default


_NOTIFY_HARNESS = """\
#define TLDSL_HOST_EMULATION 1
#include <cstdio>
#include "tldsl/comm.hpp"
namespace {{
{struct}
}}
int main() {{
  static unsigned long long sig[{W}][{slots}] = {{}};
  for (int r = 0; r < {W}; ++r) {{
    TileNotifies n{{r, sig[r]}};
    for (int pm = 0; pm < {gm}; ++pm)
      for (int pn = 0; pn < {gn}; ++pn) n(pm, pn);
  }}
  for (int r = 0; r < {W}; ++r)
    for (int s = 0; s < {slots}; ++s) std::printf("%llu\\n", sig[r][s]);
  return 0;
}}
"""


@needs_gxx
@pytest.mark.parametrize("W,Ms,tile,tile_m", [(4, 20, (8, 16, 16), 8), (3, 24, (16, 16, 16), None),
                                               (2, 40, (32, 16, 16), 16), (2, 100, (64, 16, 16), 32),
                                               (3, 80, (128, 16, 16), 64)])
def test_emulated_gemm_epilogue_notifies_match_simulator(tmp_path, W, Ms, tile, tile_m):
    """The generated TileNotifies, run on the host for every tile of every rank, adds to the
    same slots as the simulator's producer notifies. For BM >= 64 it is the struct of the
    lowered GEMM's source itself; smaller tiles (which WGMMA cannot run) get it from the same
    emitter."""
    N, Kr = 24, 16
    comm = tl.CommSchedule(tile_m=tile_m, order="ring", mode="push")
    k = gemm_reduce_scatter.trace(W, S((W * Ms, Kr), tl.float16), S((Kr, N), tl.float16), S((Ms, N), tl.float16),
                                  compute=tl.ComputeSchedule(tile=tile), comm=comm)
    part = k.part("gemm")
    if tile[0] >= 64:
        src = lower_gemm(k).source
        struct = "struct TileNotifies {" + src.split("struct TileNotifies {")[1].split("\n};")[0] + "\n};"
    else:
        from tldsl.codegen.plan.gemm import epilogue_hook
        from tldsl.codegen.recipes.gemm import NotifyEmitter
        lines = NotifyEmitter(k, epilogue_hook(match_gemm(k, part))).emit("    ")
        struct = "\n".join(["struct TileNotifies {", "  int rank;", "  unsigned long long* sig_reduce_scatter_ready;",
                             "  void operator()(int pid0, int pid1) const {", "    (void)pid0; (void)pid1;", *lines,
                             "  }", "};"])
    slots = k.signals[0].type.slots
    gm, gn = part.grid
    src = _NOTIFY_HARNESS.format(struct=struct, W=W, slots=slots, gm=gm, gn=gn)
    (tmp_path / "n.cpp").write_text(src)
    exe = host_build.build(src, ["-std=c++20", "-O1", "-w", f"-I{INCLUDE}"])
    got = np.array(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split(),
                   np.int64).reshape(W, slots)
    rng = np.random.default_rng(0)
    inputs = [{"a": rng.standard_normal((W * Ms, Kr)).astype(np.float16),
               "b": rng.standard_normal((Kr, N)).astype(np.float16),
               "out": np.zeros((Ms, N), np.float16)} for _ in range(W)]
    _, eng = sim_state(k, inputs)
    want = np.stack([eng.signals[r]["reduce_scatter_ready"].values for r in range(W)])
    assert np.array_equal(got, want) and want.sum() > 0


NVSHMEM = [tl.CommSchedule(tile_m=64, mode=m, order=o, sms=8, transport="nvshmem")
           for m in ("push", "pull") for o in ("ring", "full_mesh")]


def test_transport_is_a_communication_schedule_choice():
    with pytest.raises(tl.ScheduleError, match="transport"):
        tl.CommSchedule(transport="mpi")
    with pytest.raises(tl.ScheduleError, match="needs engine='sm'"):
        tl.CommSchedule(engine="copy_engine", transport="nvshmem")
    # transport is a codegen choice only: the traced IR differs in the schedule line alone
    W, Ms = 2, 24
    c16 = tl.ComputeSchedule(tile=(16, 16, 16))
    ks = {t: allgather_gemm.trace(W, S((Ms, 16), tl.float16), S((16, 32), tl.float16), S((W * Ms, 32), tl.float16),
                                  compute=c16, comm=tl.CommSchedule(tile_m=8, transport=t)) for t in ("ptr", "nvshmem")}
    ir = {t: str(k).splitlines() for t, k in ks.items()}
    assert len(ir["ptr"]) == len(ir["nvshmem"])
    diff = [(x, y) for x, y in zip(ir["ptr"], ir["nvshmem"]) if x != y]
    assert len(diff) == 1 and diff[0][0].lstrip().startswith("comm schedule:"), diff
    assert "transport=ptr" in diff[0][0] and "transport=nvshmem" in diff[0][1]
    # ... but the lowering does change: same transfers, different way to reach the peers
    lc = {t: lower_comm(k, "gather_a") for t, k in ks.items()}
    assert lc["ptr"].source != lc["nvshmem"].source and lc["nvshmem"].transport == "nvshmem"
    assert (lc["ptr"].transfers, lc["ptr"].notifies) == (lc["nvshmem"].transfers, lc["nvshmem"].notifies)
    # each simulated run gives the exact all_gather(A) @ B: small integers, exact in fp16
    rng = np.random.default_rng(5)
    a = [rng.integers(-3, 4, (Ms, 16)).astype(np.float16) for _ in range(W)]
    b = rng.integers(-3, 4, (16, 32)).astype(np.float16)
    want = (np.concatenate(a).astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    for t, k in ks.items():
        inputs = [{"a": a[r], "b": b, "c": np.full((W * Ms, 32), np.nan, np.float16)} for r in range(W)]
        res = tl.simulate(k, W, inputs)
        for r in range(W):
            assert np.array_equal(res[r]["c"], want), (t, r)


@pytest.mark.parametrize("comm", NVSHMEM, ids=_name)
def test_nvshmem_transport_lowers_to_device_calls(comm):
    """transport='nvshmem': no peer-pointer tables; peer data through nvshmem_ptr on the device,
    peer notifies through nvshmemx_signal_op, header-only NVSHMEM."""
    for k, part in ((ag_kernel(W=4, comm=comm), "gather_a"), (rs_kernel(W=4, comm=comm, partial_dtype="out"),
                                                              "reduce_scatter")):
        lc = lower_comm(k, part)
        assert lc.transport == "nvshmem" and "-D__NVSHMEM_NUMBA_SUPPORT__" in lc.options
        assert '#include "tldsl/comm_nvshmem.hpp"' in lc.source
        assert not any(p.source.startswith(("peers:", "peer_signals:")) for p in lc.params)
        assert "tldsl::comm::peer(buf_" in lc.source
        # peers are notified by a push all-gather and by every reduce-scatter; a pull all-gather
        # notifies only this rank's own counters
        peer_notifies = comm.mode == "push" or part == "reduce_scatter"
        assert ("tldsl::comm::cta_notify_peer(sig_" in lc.source) == peer_notifies
        same = comm.with_(transport="ptr")
        ptr = lower_comm(ag_kernel(W=4, comm=same) if part == "gather_a" else
                         rs_kernel(W=4, comm=same, partial_dtype="out"), part)
        assert (lc.waits, lc.notifies, lc.transfers) == (ptr.waits, ptr.notifies, ptr.transfers)
        # the runtime puts exactly these on the symmetric heap: the same names for both transports
        assert (lc.remote_buffers, lc.remote_signals) == (ptr.remote_buffers, ptr.remote_signals)
        assert lc.remote_buffers and set(lc.remote_buffers) <= {b.name for b in k.buffers if b.symmetric}
        assert bool(lc.remote_signals) == peer_notifies


def test_nvshmem_comm_kernel_needs_the_library_and_inits_its_module():
    from types import SimpleNamespace
    from tldsl.runtime.dist.comm_kernel import CommKernel, kernel_specs
    k = ag_kernel(W=2, comm=NVSHMEM[0])
    lc = lower_comm(k, "gather_a")
    bufs, slots = kernel_specs(k)
    with pytest.raises(tl.InputError, match="nvshmem="):
        CommKernel(lc, rank=0, world_size=2, buffers=bufs, signal_slots=slots)
    inited = []
    nv = SimpleNamespace(init_module=inited.append)
    kern = SimpleNamespace(module=0xABC, function=None, smem_bytes=0, name=lc.entry)
    ck = CommKernel(lc, rank=0, world_size=2, buffers=bufs, signal_slots=slots, kernel=kern, nvshmem=nv)
    assert inited == [0xABC] and ck.tables == {}          # no peer tables: NVSHMEM finds peers on the device


def test_clusters_lower_for_the_grouped_gemm_and_are_rejected_by_attention():
    """The grouped GEMM runs clusters of two tiles (B multicast where both tiles share an expert);
    the attention recipe has no cluster form and says so rather than launching without it."""
    from tldsl.codegen import lower_attention, lower_grouped_gemm
    NT = moe_num_tiles(4 * 64 * 2, 8, 64)
    moe = allgather_moe.trace(4, S((64, 256), tl.bfloat16), S((8, 256, 128), tl.bfloat16), S((NT,), tl.int32),
                              S((NT,), tl.int32), S((NT, 2), tl.int32), S((NT,), tl.int32), S((NT * 64,), tl.int32),
                              S((NT * 64, 128), tl.bfloat16),
                              compute=tl.ComputeSchedule(tile=(64, 128, 64), cluster=(2, 1)), comm=AG_SM[0])
    assert lower_grouped_gemm(moe).cluster_dims == (2, 1, 1)
    spa = sp_attention.trace(4, *(S((512, 256), tl.bfloat16),) * 4, heads=4,
                             compute=tl.ComputeSchedule(tile=(64, 64, 64), cluster=(2, 1)), comm=AG_SM[0])
    with pytest.raises(Exception, match="cluster"):
        lower_attention(spa)


@pytest.mark.nvrtc
@needs_cuobjdump
def test_nvshmem_transport_compiles_header_only(tmp_path):
    """Every NVSHMEM-transport variant compiles with NVRTC against NVSHMEM 3.4.5's headers in
    header-only mode: the acquire waits and the peer stores stay; no spills."""
    tcm.find_toolchain().require_nvshmem()
    lcs = [lower_comm(ag_kernel(W=4, comm=c), "gather_a") for c in NVSHMEM] + \
          [lower_comm(rs_kernel(W=4, comm=c, partial_dtype="out"), "reduce_scatter") for c in NVSHMEM]
    cks = [lc.compile(cache=KernelCache(tmp_path), progress=False) for lc in lcs]
    for lc, ck in zip(lcs, cks):
        info = ck.ptxas_info()[ck.name]
        assert info["spill_store_bytes"] == 0 and info["spill_load_bytes"] == 0, (lc.entry, info)
        k = ck.sass()[ck.name]
        assert k.count("LDG.E.64.STRONG.GPU") + k.count("LDG.E.64.STRONG.SYS") > 0 or lc.waits == 0
        assert {"ST", "STG"} & set(k.mnemonics), sorted(k.mnemonics)          # stores (to peers via nvshmem_ptr)
        assert {"ATOM", "ATOMG", "RED", "REDG"} & set(k.mnemonics) or lc.notifies == 0   # nvshmemx_signal_op
        assert "TLDSL_NVSHMEM_VERSION" in " ".join(ck.options)


@pytest.mark.nvrtc
@needs_cuobjdump
def test_cluster_gemm_multicasts_b_and_syncs_the_cluster(tmp_path):
    """cluster (2, 1): B chunks arrive by TMA multicast, stages are released on both CTAs
    (remote mbarrier arrive), the cluster meets at start and end; waits and notifies stay.
    The (1, 1) GEMM has none of it. Grid: whole clusters, never more than cluster tiles."""
    ag = lower_gemm(ag_kernel(W=2, comm=AG_SM[0], tile=(128, 256, 64), stages=4, dt=tl.bfloat16, cluster=(2, 1)))
    rs = lower_gemm(rs_kernel(W=2, comm=tl.CommSchedule(tile_m=128, order="ring", mode="push"), Ms=1000,
                              dt=tl.bfloat16, tile=(128, 256, 64), stages=4, cluster=(2, 1), partial_dtype="out"))
    one = lower_gemm(ag_kernel(W=2, comm=AG_SM[0], tile=(128, 256, 64), stages=4, dt=tl.bfloat16))
    assert ag.cluster_dims == (2, 1, 1) and one.cluster_dims == (1, 1, 1)
    assert "kClusterM = 2;" in ag.source and "kClusterM = 1;" in one.source
    gm, gn = ag.grid_tiles
    assert ag.grid(132) == (min(132, 2 * (-(-gm // 2)) * gn), 1, 1) and ag.grid(131)[0] % 2 == 0
    assert rs.grid(7) == (6, 1, 1)
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in (ag, rs, one)],
                       cache=KernelCache(tmp_path), progress=False)
    ka, kr, k1 = (_sass_ok(ck, max_regs=168) for ck in cks)
    for k in (ka, kr):
        assert k.count("UTMALDG.2D.MULTICAST") > 0 and k.count("UTMALDG.2D") > 0      # B multicast, A own
        assert k.count("UCGABAR_ARV") > 0 and k.count("UCGABAR_WAIT") > 0              # cluster barrier
        assert k.count("SYNCS.ARRIVE.TRANS64.RED.A1T0") > 0                           # remote stage release
    assert ka.count("LDG.E.64.STRONG.GPU") + ka.count("LDG.E.64.STRONG.SYS") > 0       # the AG waits survive
    assert kr.count("REDG.E.ADD.64.STRONG.GPU") > 0                                    # the RS notifies survive
    assert k1.count("UTMALDG.2D.MULTICAST") == 0 and k1.count("UCGABAR_ARV") == 0


# =================================================================================================
# NVRTC: compile every variant, check SASS
# =================================================================================================

def _sass_ok(ck, *, max_regs):
    info = ck.ptxas_info()[ck.name]
    assert info["spill_store_bytes"] <= SPILL_BUDGET_BYTES and info["spill_load_bytes"] <= SPILL_BUDGET_BYTES, info
    assert info["stack_bytes"] == 0 and info["registers"] <= max_regs, info
    k = ck.sass()[ck.name]
    s = k.summary()
    assert s["BPT.TRAP"] == 0 and s["LDL/STL"] == 0 and s["local_bytes"] == 0, s
    return k


def _check_comm_sass(k, lc: LoweredComm, *, notify_scopes, wait_scopes, vector=True):
    for scope in notify_scopes:
        assert k.count(f"REDG.E.ADD.64.STRONG.{scope}") > 0, sorted(k.mnemonics)
        assert k.count(f"MEMBAR.ALL.{scope}") > 0, sorted(k.mnemonics)
    for scope in wait_scopes:
        assert k.count(f"LDG.E.64.STRONG.{scope}") > 0, sorted(k.mnemonics)
    assert k.count("BAR.SYNC") > 0
    if vector:   # 16-byte vectors: LDG/STG, or generic LD/ST through pointers read from a peer table
        assert k.count("LDG.E.128") + k.count("LD.E.128") > 0, sorted(k.mnemonics)
        assert k.count("STG.E.128") + k.count("ST.E.128") > 0, sorted(k.mnemonics)
    # data loads are weak, never non-coherent (read-only cache): peers write these buffers while the
    # kernel runs; only the pointer tables (64-bit entries) may be read through the constant path
    nc = [o for o in k.opcodes if o.startswith("LDG") and "CONSTANT" in o and o != "LDG.E.64.CONSTANT"]
    assert not nc, nc
    assert lc.params[-2].name == "rank" and lc.params[-1].name == "launch"


def _variants():
    """(label, kernel, part name, notify scopes, wait scopes) for every communication variant."""
    out = []
    for c in AG_SM:
        k = ag_kernel(W=8, comm=c)
        out.append((f"allgather_gemm/{_name(c)}", k, "gather_a", ["GPU"] if c.mode == "pull" else ["SYS"], []))
    for c in RS_SM:
        k = rs_kernel(W=8, comm=c, Ms=125, partial_dtype="out" if c.mode == "pull" else "f32")
        out.append((f"gemm_reduce_scatter/{_name(c)}", k, "reduce_scatter", ["SYS"], ["GPU", "SYS"]))
    for ms in (125, 128):          # the copy-engine reduce-scatter's SM part: the sum of this rank's rows
        k = rs_kernel(W=8, comm=tl.CommSchedule(engine="copy_engine", mode="push", tile_m=64), Ms=ms,
                      partial_dtype="out")
        out.append((f"gemm_reduce_scatter.sum/copy_engine/Ms{ms}", k, "reduce_scatter_sum", [], ["GPU", "SYS"]))
    for c in (AG_SM[0], AG_SM[3]):
        k = moe_kernel(W=4, comm=c)
        out.append((f"allgather_moe/{_name(c)}", k, "gather_x", ["GPU"] if c.mode == "pull" else ["SYS"], []))
        k = spa_kernel(W=4, comm=c)
        for part in ("gather_k", "gather_v"):
            out.append((f"sp_attention.{part}/{_name(c)}", k, part, ["GPU"] if c.mode == "pull" else ["SYS"], []))
    return out


@pytest.mark.nvrtc
@needs_cuobjdump
def test_every_comm_variant_compiles_with_release_and_acquire_sass(tmp_path):
    variants = _variants()
    lcs = [lower_comm(k, part) for _, k, part, _, _ in variants]
    t0 = time.perf_counter()
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in lcs], cache=KernelCache(tmp_path),
                       progress=False)
    wall = time.perf_counter() - t0
    for (label, k, part, nscopes, wscopes), lc, ck in zip(variants, lcs, cks):
        sass = _sass_ok(ck, max_regs=COMM_MAX_REGISTERS)
        _check_comm_sass(sass, lc, notify_scopes=nscopes, wait_scopes=wscopes)
        print(f"{label}: {ck.compile_seconds:.2f} s, {ck.ptxas_info()[ck.name]['registers']} regs, "
              f"{len(sass.instructions)} instructions")
    print(f"{len(lcs)} communication kernels in {wall:.1f} s")


@pytest.mark.nvrtc
@needs_cuobjdump
def test_the_copy_engines_signal_add_kernel_compiles_to_a_fenced_system_atomic(tmp_path):
    """The one-thread kernel a copy-engine plan's shared-slot notify runs: a system fence, then a
    system-scope 64-bit atomic add."""
    from tldsl.runtime.gpu.signal_add import ENTRY, SOURCE
    ck = tcm.compiler.compile_cuda(SOURCE, ENTRY, cache=KernelCache(tmp_path), progress=False)
    ops = ck.sass()[ENTRY].instructions
    fence = next(i for i, o in enumerate(ops) if o.startswith("MEMBAR") and o.endswith(".SYS"))
    add = next(i for i, o in enumerate(ops) if o.startswith(("ATOMG.E.ADD.64", "REDG.E.ADD.64")) and o.endswith(".SYS"))
    assert fence < add, ops


@pytest.mark.nvrtc
@needs_cuobjdump
def test_comm_kernel_debug_build_with_wait_timeout(tmp_path):
    lc = lower_comm(rs_kernel(W=4, comm=RS_SM[1]), wait_timeout_ns=2 * 10**9)
    ck = lc.compile(cache=KernelCache(tmp_path), progress=False)
    k = ck.sass()[ck.name]
    assert k.count("BPT.TRAP") > 0            # a wait that spins too long traps (prints too while debugging)
    assert ck.ptxas_info()[ck.name]["spill_store_bytes"] == 0


@pytest.mark.nvrtc
@needs_cuobjdump
def test_gemm_rs_epilogue_sass_and_plain_gemm_unchanged(tmp_path):
    from test_codegen_host import trace_plain
    plain = lower_gemm(trace_plain(M=1000, N=776, K=520, tile=(128, 256, 64), stages=4, dt=tl.bfloat16,
                                   odt=tl.bfloat16))
    rs = lower_gemm(rs_kernel(W=4, comm=tl.CommSchedule(tile_m=64, order="ring", mode="push"), Ms=256,
                              dt=tl.bfloat16, tile=(128, 256, 64), stages=4))
    rs64 = lower_gemm(rs_kernel(W=4, comm=tl.CommSchedule(tile_m=128, order="full_mesh", mode="pull"), Ms=256,
                                dt=tl.float16, tile=(64, 128, 64), stages=4, partial_dtype="out"))
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in (plain, rs, rs64)],
                       cache=KernelCache(tmp_path), progress=False)
    kp, kr, kr64 = (_sass_ok(ck, max_regs=168) for ck in cks)
    # plain GEMM: no notify code at all, same size as before the epilogue hook existed
    assert kp.count("REDG") == 0 and kp.count("MEMBAR.ALL.GPU") == 0 and kp.count("FENCE.VIEW.ASYNC.G") == 0
    assert abs(len(kp.instructions) - PLAIN_GEMM_INSTRUCTIONS) <= 0.03 * PLAIN_GEMM_INSTRUCTIONS, len(kp.instructions)
    for k in (kr, kr64):
        s = k.summary()
        assert s["HGMMA"] > 0 and s["UTMALDG"] > 0 and s["UTMASTG"] > 0
        assert k.count("REDG.E.ADD.64.STRONG.GPU") > 0 and k.count("MEMBAR.ALL.GPU") > 0
        assert k.count("FENCE.VIEW.ASYNC.G") > 0           # async-proxy writes ordered before the release
        assert k.count("DEPBAR") > 0                        # cp.async.bulk.wait_group before it
    # the notify costs a little code, not a different kernel
    assert len(kr.instructions) < 1.25 * len(kp.instructions)
    for ck in cks:
        assert "C7510" not in ck.log and "C7515" not in ck.log


# =================================================================================================
# CPU emulation of the generated kernels, against the simulator
# =================================================================================================

def sim_state(kernel_ir, inputs, seed=0):
    """Run one launch in the simulator; return its memory and engine (signal counters)."""
    W = kernel_ir.world_size
    memory = Memory(W, True, True)
    for r in range(W):
        for b in kernel_ir.args:
            data = to_storage(np.array(inputs[r][b.name], copy=True), b.type.dtype).copy()
            memory.add(r, b.name, b.type.dtype, data, True, b.symmetric)
        for b in kernel_ir.workspaces:
            memory.add(r, b.name, b.type.dtype, np.full(b.type.shape, poison_value(b.type.dtype), b.type.dtype.np),
                       False, b.symmetric)
    eng = Engine(kernel_ir, memory, SimOptions(launches=1), np.random.default_rng(seed))
    eng.run_launch()
    return memory, eng


def device_layout(arr, dtype_name):
    """A simulator array in device layout (bf16 as its 16-bit pattern)."""
    if dtype_name == "bf16":
        return (np.ascontiguousarray(arr, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.ascontiguousarray(arr)


_HARNESS = """\
#define TLDSL_HOST_EMULATION 1
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include "tldsl/comm.hpp"

{source}

static void* load_file(const char* path, size_t n) {{
  void* p = std::aligned_alloc(64, (n + 63) / 64 * 64);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(p, 1, n, f) != n) {{ std::fprintf(stderr, "cannot read %s\\n", path); std::exit(2); }}
  std::fclose(f);
  return p;
}}
static void save_file(const char* path, const void* p, size_t n) {{
  FILE* f = std::fopen(path, "wb");
  std::fwrite(p, 1, n, f);
  std::fclose(f);
}}

int main(int argc, char** argv) {{
  const unsigned long long launch = std::strtoull(argv[1], nullptr, 10);
  const int threads = std::atoi(argv[2]);
  const int grid = std::atoi(argv[3]);
{loads}
  std::vector<std::thread> pool;
  std::vector<std::barrier<>*> bars;
  for (int r = 0; r < {W}; ++r)
    for (int b = 0; b < grid; ++b) {{
      auto* bar = new std::barrier<>(threads);
      bars.push_back(bar);
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([=] {{
          tldsl_emu::thread_idx.x = t;
          tldsl_emu::block_idx.x = b;
          tldsl_emu::block_dim.x = threads;
          tldsl_emu::grid_dim.x = grid;
          tldsl_emu::cta_barrier = bar;
          switch (r) {{
{calls}
          }}
        }});
    }}
  for (auto& th : pool) th.join();
{saves}
  return 0;
}}
"""


def emulate(kernel_ir, lc: LoweredComm, memory, signals, tmp_path: Path, *, launch=1, threads=32, grid=None,
            timeout=300):
    """Run ``lc`` on CPU threads for every rank at once. ``memory[r][name]`` / ``signals[r][name]``:
    device-layout numpy arrays, updated in place."""
    W = kernel_ir.world_size
    used_b, used_s = [], []
    for p in lc.params:
        kind, _, name = p.source.partition(":")
        if kind in ("buffer", "peers") and name not in used_b:
            used_b.append(name)
        if kind in ("signal", "peer_signals") and name not in used_s:
            used_s.append(name)
    tmp_path.mkdir(parents=True, exist_ok=True)
    loads, saves, files = [], [], []
    for r in range(W):
        for n in used_b:
            arr = np.ascontiguousarray(memory[r][n])
            f = tmp_path / f"m_{r}_{n}.bin"
            f.write_bytes(arr.tobytes())
            loads.append(f'  void* m_{r}_{n} = load_file("{f.name}", {arr.nbytes});')
            saves.append(f'  save_file("{f.name}", m_{r}_{n}, {arr.nbytes});')
            files.append((f, memory[r], n, arr.dtype, arr.shape))
        for n in used_s:
            arr = np.ascontiguousarray(signals[r][n], dtype=np.uint64)
            f = tmp_path / f"s_{r}_{n}.bin"
            f.write_bytes(arr.tobytes())
            loads.append(f'  void* s_{r}_{n} = load_file("{f.name}", {arr.nbytes});')
            saves.append(f'  save_file("{f.name}", s_{r}_{n}, {arr.nbytes});')
            files.append((f, signals[r], n, np.uint64, arr.shape))
    for n in used_b:
        loads.append(f"  void* t_{n}[{W}] = {{{', '.join(f'm_{r}_{n}' for r in range(W))}}};")
    for n in used_s:
        loads.append(f"  void* ts_{n}[{W}] = {{{', '.join(f's_{r}_{n}' for r in range(W))}}};")
    calls = []
    for r in range(W):
        args = []
        for p in lc.params:
            kind, _, name = p.source.partition(":")
            ct = p.ctype.replace("__restrict__", "").strip()
            args.append({"buffer": f"({ct})m_{r}_{name}", "peers": f"({ct})t_{name}",
                         "signal": f"({ct})s_{r}_{name}", "peer_signals": f"({ct})ts_{name}",
                         "rank": str(r), "launch": "launch"}[kind])
        calls.append(f"            case {r}: {lc.entry}({', '.join(args)}); break;")
    src = _HARNESS.format(source=lc.source, loads="\n".join(loads), saves="\n".join(saves), calls="\n".join(calls),
                          W=W)
    (tmp_path / "harness.cpp").write_text(src)
    exe = host_build.build(src, ["-std=c++20", "-O1", "-pthread", "-ffp-contract=off", "-w", f"-I{INCLUDE}"])
    grid = grid or lc.grid()[0]
    r = subprocess.run([str(exe), str(launch), str(threads), str(grid)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    for f, store, n, dt, shape in files:
        store[n] = np.frombuffer(f.read_bytes(), dtype=dt).reshape(shape).copy()


def _state_from_sim(kernel_ir, mem, eng):
    W = kernel_ir.world_size
    memory = [{b.name: device_layout(mem.ranks[r][b.name].data, b.type.dtype.name) for b in kernel_ir.buffers}
              for r in range(W)]
    signals = [{s.name: eng.signals[r][s.name].values.astype(np.uint64) for s in kernel_ir.signals} for r in range(W)]
    return memory, signals


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f":
        return np.array_equal(a, b, equal_nan=True)
    return np.array_equal(a, b)


AG_EMU = [
    (3, 20, 24, tl.CommSchedule(tile_m=8, mode="pull", order="ring", sms=2), "float16"),
    (4, 13, 12, tl.CommSchedule(tile_m=8, mode="push", order="full_mesh", sms=3), "float16"),     # K*2 = 24 B rows
    (3, 16, 40, tl.CommSchedule(tile_m=16, mode="pull", order="full_mesh", sms=4), "float32"),
    (2, 9, 16, tl.CommSchedule(tile_m=None, mode="push", order="ring", sms=1), "float16"),
]


@needs_gxx
@pytest.mark.parametrize("W,Ms,K,comm,dt", AG_EMU, ids=lambda x: _name(x) if isinstance(x, tl.CommSchedule) else str(x))
def test_emulated_allgather_matches_simulator(tmp_path, W, Ms, K, comm, dt):
    rng = np.random.default_rng(W * 100 + Ms)
    N = 16
    npdt = np.float16 if dt == "float16" else np.float32
    shards = [rng.standard_normal((Ms, K)).astype(npdt) for _ in range(W)]
    b = rng.standard_normal((K, N)).astype(npdt)
    inputs = [{"a": shards[r], "b": b, "c": np.full((W * Ms, N), np.nan, npdt)} for r in range(W)]
    k = allgather_gemm.trace(W, S((Ms, K), getattr(tl, dt)), S((K, N), getattr(tl, dt)), S((W * Ms, N), getattr(tl, dt)),
                             compute=tl.ComputeSchedule(tile=(16, 16, 16)), comm=comm)
    mem, eng = sim_state(k, inputs)
    want_mem, want_sig = _state_from_sim(k, mem, eng)
    # the comm part alone: the gathered buffer starts poisoned, the ready counters at zero
    memory = [{"a": shards[r].copy(), "a_gathered": np.full((W * Ms, K), np.nan, npdt)} for r in range(W)]
    signals = [{"gather_a_ready": np.zeros(k.signals[0].type.slots, np.uint64)} for r in range(W)]
    lc = lower_comm(k, "gather_a")
    emulate(k, lc, memory, signals, tmp_path)
    for r in range(W):
        assert _same(memory[r]["a_gathered"], want_mem[r]["a_gathered"]), r
        assert _same(memory[r]["a_gathered"], np.concatenate(shards))
        assert np.array_equal(signals[r]["gather_a_ready"], want_sig[r]["gather_a_ready"]), r
        assert (signals[r]["gather_a_ready"] == 1).all()
    # a second launch with fresh shards into a re-poisoned buffer: counters count on (epochs),
    # and every row must be copied again (stale launch-1 rows would show)
    shards2 = [rng.standard_normal((Ms, K)).astype(npdt) for _ in range(W)]
    mem2, eng2 = sim_state(k, [{**inputs[r], "a": shards2[r]} for r in range(W)])
    want2, _ = _state_from_sim(k, mem2, eng2)
    for r in range(W):
        memory[r]["a"] = shards2[r].copy()
        memory[r]["a_gathered"][...] = np.nan
    emulate(k, lc, memory, signals, tmp_path / "2", launch=2)
    for r in range(W):
        assert _same(memory[r]["a_gathered"], want2[r]["a_gathered"]), r
        assert np.array_equal(memory[r]["a_gathered"], np.concatenate(shards2)), r
        assert (signals[r]["gather_a_ready"] == 2).all()


RS_EMU = [  # (W, Ms, N, comm, partial dtype)
    (3, 20, 24, tl.CommSchedule(tile_m=8, mode="push", order="ring", sms=2), "f32"),   # short last tile: load_rows
    (4, 16, 24, tl.CommSchedule(tile_m=None, mode="pull", order="ring", sms=1), "out"),
    (3, 16, 20, tl.CommSchedule(tile_m=8, mode="push", order="full_mesh", sms=2), "out"),  # N=20: f16 tails
    (4, 24, 32, tl.CommSchedule(tile_m=16, mode="pull", order="full_mesh", sms=3), "f32"),
    (3, 20, 24, tl.CommSchedule(tile_m=8, mode="pull", order="ring", sms=2), "out"),
]


@needs_gxx
@pytest.mark.parametrize("W,Ms,N,comm,partial_dtype", RS_EMU,
                         ids=lambda x: _name(x) if isinstance(x, tl.CommSchedule) else str(x))
def test_emulated_reduce_scatter_matches_simulator(tmp_path, W, Ms, N, comm, partial_dtype):
    rng = np.random.default_rng(W * 1000 + Ms * 10 + N)
    Kr = 24
    a = [rng.standard_normal((W * Ms, Kr)).astype(np.float16) for _ in range(W)]
    b = [rng.standard_normal((Kr, N)).astype(np.float16) for _ in range(W)]
    inputs = [{"a": a[r], "b": b[r], "out": np.full((Ms, N), np.nan, np.float16)} for r in range(W)]
    k = gemm_reduce_scatter.trace(W, S((W * Ms, Kr), tl.float16), S((Kr, N), tl.float16), S((Ms, N), tl.float16),
                                  compute=tl.ComputeSchedule(tile=(8, 16, 16), order="comm_aligned"), comm=comm,
                                  partial_dtype=partial_dtype)
    mem, eng = sim_state(k, inputs)
    want_mem, want_sig = _state_from_sim(k, mem, eng)
    stage = "reduce_scatter_recv" if comm.mode == "push" else "reduce_scatter_send"
    # the comm part alone: partials as the GEMM left them, `ready` as its notifies left it
    memory = [{"partial": want_mem[r]["partial"].copy(), "out": np.full((Ms, N), np.nan, np.float16),
               stage: np.full(k.buffer(stage).type.shape, np.nan,
                              np.float32 if partial_dtype == "f32" else np.float16)} for r in range(W)]
    signals = [{"reduce_scatter_ready": want_sig[r]["reduce_scatter_ready"].copy(),
                "reduce_scatter_arrived": np.zeros_like(want_sig[r]["reduce_scatter_arrived"])} for r in range(W)]
    lc = lower_comm(k, "reduce_scatter")
    emulate(k, lc, memory, signals, tmp_path)
    for r in range(W):
        assert _same(memory[r]["out"], want_mem[r]["out"]), (r, memory[r]["out"], want_mem[r]["out"])
        assert _same(memory[r][stage], want_mem[r][stage]), r
        assert np.array_equal(signals[r]["reduce_scatter_arrived"], want_sig[r]["reduce_scatter_arrived"]), r
    ref = sum(x.astype(np.float32) @ y.astype(np.float32) for x, y in zip(a, b))
    for r in range(W):
        np.testing.assert_allclose(memory[r]["out"].astype(np.float32), ref[r * Ms:(r + 1) * Ms], rtol=2e-2, atol=5e-2)
    # launch 2: new partials, their producers notify again (the waits need 2x now), the arrivals
    # count on; staging and out re-poisoned, so a skipped transfer or a wait on launch 1's count
    # (reading the stage before the peers wrote it) shows up as NaN or stale data
    a2 = [rng.standard_normal((W * Ms, Kr)).astype(np.float16) for _ in range(W)]
    b2 = [rng.standard_normal((Kr, N)).astype(np.float16) for _ in range(W)]
    mem2, eng2 = sim_state(k, [{"a": a2[r], "b": b2[r], "out": inputs[r]["out"]} for r in range(W)])
    want2_mem, want2_sig = _state_from_sim(k, mem2, eng2)
    for r in range(W):
        assert not _same(want2_mem[r]["partial"], want_mem[r]["partial"])
        memory[r]["partial"] = want2_mem[r]["partial"].copy()
        signals[r]["reduce_scatter_ready"] = want_sig[r]["reduce_scatter_ready"] + want2_sig[r]["reduce_scatter_ready"]
        memory[r]["out"][...] = np.nan
        memory[r][stage][...] = np.nan
    emulate(k, lc, memory, signals, tmp_path / "2", launch=2, threads=64)
    for r in range(W):
        assert _same(memory[r]["out"], want2_mem[r]["out"]), r
        assert _same(memory[r][stage], want2_mem[r][stage]), r
        assert np.array_equal(signals[r]["reduce_scatter_arrived"],
                              want_sig[r]["reduce_scatter_arrived"] + want2_sig[r]["reduce_scatter_arrived"]), r
        assert (want2_sig[r]["reduce_scatter_arrived"] > 0).any()
    ref2 = sum(x.astype(np.float32) @ y.astype(np.float32) for x, y in zip(a2, b2))
    for r in range(W):
        np.testing.assert_allclose(memory[r]["out"].astype(np.float32), ref2[r * Ms:(r + 1) * Ms], rtol=2e-2, atol=5e-2)


@needs_gxx
def test_emulated_sp_attention_gathers_bf16(tmp_path):
    W, Sl, H, D = 3, 10, 2, 8
    comm = tl.CommSchedule(tile_m=4, mode="push", order="full_mesh", sms=2)
    rng = np.random.default_rng(7)
    bf = tl.bfloat16
    qs, ks, vs = ([to_storage(rng.standard_normal((Sl, H * D)).astype(np.float32), bf).copy() for _ in range(W)]
                  for _ in range(3))
    inputs = [{"q": qs[r], "k": ks[r], "v": vs[r], "o": np.zeros((Sl, H * D), np.float32)} for r in range(W)]
    k = sp_attention.trace(W, *(S((Sl, H * D), bf) for _ in range(4)), heads=H,
                           compute=tl.ComputeSchedule(tile=(8, 8, 8)), comm=comm)
    mem, eng = sim_state(k, inputs)
    want_mem, want_sig = _state_from_sim(k, mem, eng)
    for part, src, dst, sig in (("gather_k", "k", "k_gathered", "gather_k_ready"),
                                ("gather_v", "v", "v_gathered", "gather_v_ready")):
        memory = [{src: device_layout(inputs[r][src], "bf16"),
                   dst: np.full((W * Sl, H * D), 0x7fc0, np.uint16)} for r in range(W)]
        signals = [{sig: np.zeros(k.signals[0].type.slots, np.uint64)} for r in range(W)]
        emulate(k, lower_comm(k, part), memory, signals, tmp_path / part)
        for r in range(W):
            assert np.array_equal(memory[r][dst], want_mem[r][dst]), (part, r)
            assert np.array_equal(signals[r][sig], want_sig[r][sig]), (part, r)


@tl.kernel
def comm_mix(x: tl.Symmetric, v, y: tl.Symmetric, x2, z, *, comm: tl.CommSchedule = None):
    """Every streamed construct at once: a lower-rank load of a 3-d tensor, broadcasting, float
    and integer scalars, iota / where, a bf16 push to a peer, a clipped 3-d copy from a peer and
    a 1-d store."""
    W = tl.world_size()
    ready = tl.signal("mix_ready", W * 4, scope="symmetric")

    @tl.comm_part(grid=(W, 4))
    def mix(s, j):
        me = tl.rank()
        peer = (me + s) % W
        t = tl.load(x, (j, 0, 0), (6, 10))                                   # [6, 10] of x[j]
        w = t * 2.5 + tl.load(v, (0,), (10,)).to(tl.float32)[None, :] - j
        w = tl.where(tl.iota(6)[:, None] < 4, w, -w)
        tl.store(y.at(peer), ((me * 4 + j) * 6, 0), w)                       # bf16 on the peer
        tl.tile_pull_data(x.at(peer), (j, 3, 5), (1, 4, 7), x2, (s * 4 + j, 0, 0))   # rows / cols clipped
        tl.store(z, ((s * 4 + j) * 10,), tl.load(v, (0,), (10,)) + 1.0)
        tl.peer_tile_notify(ready, me * 4 + j, peer)


@needs_gxx
def test_emulated_general_statements_match_simulator(tmp_path):
    W = 2
    rng = np.random.default_rng(3)
    f32, f16, bf = tl.float32, tl.float16, tl.bfloat16
    xs = [rng.standard_normal((4, 6, 10)).astype(np.float32) for _ in range(W)]
    vv = [rng.standard_normal(10).astype(np.float16) for _ in range(W)]
    # outputs poisoned on both sides: a clipped copy must leave the rest untouched, not zero it
    inputs = [{"x": xs[r], "v": vv[r], "y": np.full((W * 4 * 6, 10), np.nan, np.float32),
               "x2": np.full((W * 4, 5, 7), np.nan, np.float32), "z": np.full(W * 4 * 10, np.nan, np.float16)}
              for r in range(W)]
    comm = tl.CommSchedule(order="full_mesh", sms=3)
    k = comm_mix.trace(W, S((4, 6, 10), f32), S((10,), f16), S((W * 24, 10), bf), S((W * 4, 5, 7), f32),
                       S((W * 40,), f16), comm=comm)
    mem, eng = sim_state(k, inputs)
    want_mem, want_sig = _state_from_sim(k, mem, eng)
    memory = [{"x": xs[r].copy(), "v": vv[r].copy(), "y": device_layout(inputs[r]["y"], "bf16"),
               "x2": inputs[r]["x2"].copy(), "z": inputs[r]["z"].copy()} for r in range(W)]
    signals = [{"mix_ready": np.zeros(W * 4, np.uint64)} for _ in range(W)]
    lc = lower_comm(k)
    assert lc.transfers == 3 and lc.notifies == 1
    emulate(k, lc, memory, signals, tmp_path, threads=32)
    for r in range(W):
        for n in ("y", "x2", "z"):
            assert _same(memory[r][n], want_mem[r][n]), (r, n)
        assert np.array_equal(signals[r]["mix_ready"], want_sig[r]["mix_ready"])
    for r in range(W):
        # y and z are written whole; x2 only where x[j, 3:, 5:] exists (3 rows x 5 cols), the rest still NaN
        assert not any(np.isnan(np.asarray(mem.ranks[r][n].data, np.float32)).any() for n in ("y", "z"))
        x2 = memory[r]["x2"]
        assert np.isnan(x2[:, 3:, :]).all() and np.isnan(x2[:, :, 5:]).all()
        for s in range(W):
            for j in range(4):
                assert np.array_equal(x2[s * 4 + j, :3, :5], xs[(r + s) % W][j, 3:, 5:]), (r, s, j)


@tl.kernel
def relay(x: tl.Symmetric, y: tl.Symmetric):
    """A push between two other ranks' tensors: rank r copies rank r+1's x into rank r+2's y, by SMs."""
    W = tl.world_size()
    done = tl.signal("relay_done", 1, scope="symmetric")

    @tl.comm_part(grid=(3,))
    def move(i):
        me = tl.rank()
        tl.tile_push_data(y.at((me + 2) % W), (i * 4, 1), x.at((me + 1) % W), (i * 4, 0), (4, 7))
        tl.peer_tile_notify(done, 0, (me + 2) % W)


@needs_gxx
def test_emulated_push_from_a_peers_tensor_matches_simulator(tmp_path):
    """``tile_push_data``'s source may be ``tensor.at(rank)`` too (``rank_copy_data`` and
    ``tile_pull_data``'s destination already could be either): a third rank's rows, clipped at y's edge."""
    W = 3
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((10, 7)).astype(np.float32) for _ in range(W)]
    inputs = [{"x": xs[r], "y": np.full((10, 7), np.nan, np.float32)} for r in range(W)]
    k = relay.trace(W, S((10, 7), tl.float32), S((10, 7), tl.float32))
    mem, eng = sim_state(k, inputs)
    want_mem, want_sig = _state_from_sim(k, mem, eng)
    for r in range(W):            # y's column 0 untouched, columns 1.. from rank r-1's x (rank r-2 pushed it)
        y = want_mem[r]["y"]
        assert np.isnan(y[:, 0]).all() and np.array_equal(y[:, 1:], xs[(r - 1) % W][:, :6]), r
        assert want_sig[r]["relay_done"][0] == 3
    memory = [{"x": xs[r].copy(), "y": inputs[r]["y"].copy()} for r in range(W)]
    signals = [{"relay_done": np.zeros(1, np.uint64)} for _ in range(W)]
    emulate(k, lower_comm(k), memory, signals, tmp_path)
    for r in range(W):
        assert _same(memory[r]["y"], want_mem[r]["y"]), r
        assert np.array_equal(signals[r]["relay_done"], want_sig[r]["relay_done"]), r


# =================================================================================================
# copy-engine plans, executed in numpy
# =================================================================================================

@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("W,Ms,K,dt", [(3, 5, 6, np.float16), (4, 7, 5, np.float32)])
def test_copy_engine_allgather_plan_matches_simulator(mode, W, Ms, K, dt):
    comm = tl.CommSchedule(engine="copy_engine", mode=mode)
    rng = np.random.default_rng(W + Ms)
    tdt = tl.float16 if dt == np.float16 else tl.float32
    shards = [rng.standard_normal((Ms, K)).astype(dt) for _ in range(W)]
    N = 4
    b = rng.standard_normal((K, N)).astype(dt)
    inputs = [{"a": shards[r], "b": b, "c": np.zeros((W * Ms, N), dt)} for r in range(W)]
    k = allgather_gemm.trace(W, S((Ms, K), tdt), S((K, N), tdt), S((W * Ms, N), tdt),
                             compute=tl.ComputeSchedule(tile=(8, 8, 8)), comm=comm)
    plan = lower(k, "gather_a")
    assert isinstance(plan, CopyEnginePlan) and plan.world_size == W
    eb = np.dtype(dt).itemsize
    for r in range(W):
        copies = plan.copies(r)
        assert len(copies) == W                                         # one copy per peer (and self)
        acts = plan.actions[r]
        assert all(isinstance(acts[2 * i], CeCopy) and isinstance(acts[2 * i + 1], CeSignalWrite) for i in range(W))
        peers = []
        for step, c in enumerate(copies):
            assert c.nbytes == Ms * K * eb and c.height == Ms and c.width_bytes == K * eb
            assert c.src_pitch == c.dst_pitch == K * eb
            if mode == "pull":
                peer = (r + step) % W
                assert (c.src, c.src_rank, c.src_byte_offset) == ("a", peer, 0)
                assert (c.dst, c.dst_rank, c.dst_byte_offset) == ("a_gathered", r, peer * Ms * K * eb)
            else:
                peer = (r + W - step) % W
                assert (c.src, c.src_rank, c.src_byte_offset) == ("a", r, 0)
                assert (c.dst, c.dst_rank, c.dst_byte_offset) == ("a_gathered", peer, r * Ms * K * eb)
            peers.append(peer)
            w = acts[2 * step + 1]
            assert w.signal == "gather_a_ready" and w.value(1) == 1 and w.value(3) == 3
            assert (w.rank, w.slot) == ((r, peer) if mode == "pull" else (peer, r))
        assert sorted(peers) == list(range(W))
    mem, eng = sim_state(k, inputs)
    memory = [{"a": shards[r].copy(), "a_gathered": np.full((W * Ms, K), np.nan, dt)} for r in range(W)]
    signals = [{"gather_a_ready": np.zeros(W, np.uint64)} for r in range(W)]
    plan.run_numpy(memory, signals, launch=1)
    for r in range(W):
        assert _same(memory[r]["a_gathered"], mem.ranks[r]["a_gathered"].data)
        assert np.array_equal(signals[r]["gather_a_ready"], eng.signals[r]["gather_a_ready"].values)
    plan.run_numpy(memory, signals, launch=2)
    assert all((s["gather_a_ready"] == 2).all() for s in signals)
    assert "copy a@" in plan.describe()


@tl.kernel
def ce_blocks(x: tl.Symmetric, y: tl.Symmetric, *, comm: tl.CommSchedule = None):
    """A 3-d copy-engine transfer, clipped at the source's edge, then a rank notify."""
    W = tl.world_size()
    got = tl.signal("got", W, scope="symmetric")

    @tl.comm_part(grid=(W,), engine="copy_engine", lanes=1)
    def blocks(s):
        me = tl.rank()
        peer = (me + s) % W
        tl.rank_copy_data(y, (peer * 3, 0, 0), x.at(peer), (1, 2, 1), (3, 4, 5))   # x is [3, 5, 4]
        tl.rank_notify(got, peer)


def test_copy_engine_plan_nd_clipped_copy_matches_simulator():
    W = 3
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((3, 5, 4)).astype(np.float32) for _ in range(W)]
    # y poisoned on both sides: the clipped box must leave the rest of y untouched, not zero it
    inputs = [{"x": xs[r], "y": np.full((W * 3, 4, 5), np.nan, np.float32)} for r in range(W)]
    k = ce_blocks.trace(W, S((3, 5, 4), tl.float32), S((W * 3, 4, 5), tl.float32), comm=tl.CommSchedule(engine="copy_engine"))
    plan = plan_copy_engine(k)
    c = plan.copies(0)
    # source box [1:4, 2:6, 1:6] clipped to [1:3, 2:5, 1:4]: 2 planes of 3 rows x 3 elements
    assert len(c) == 2 * W and c[0].shape == (2, 3, 3) and c[0].height == 3 and c[0].width_bytes == 12
    assert c[0].src_pitch == 16 and c[0].dst_pitch == 20
    assert c[0].src_byte_offset == ((1 * 5 + 2) * 4 + 1) * 4 and c[1].src_byte_offset == ((2 * 5 + 2) * 4 + 1) * 4
    mem, eng = sim_state(k, inputs)
    memory = [{"x": xs[r].copy(), "y": np.full((W * 3, 4, 5), np.nan, np.float32)} for r in range(W)]
    signals = [{"got": np.zeros(W, np.uint64)} for _ in range(W)]
    plan.run_numpy(memory, signals)
    for r in range(W):
        assert _same(memory[r]["y"], mem.ranks[r]["y"].data)
        assert np.array_equal(signals[r]["got"], eng.signals[r]["got"].values)
        for y in (memory[r]["y"], mem.ranks[r]["y"].data):
            # y[p*3 : p*3+2, :3, :3] = x_p[1:3, 2:5, 1:4] for every peer p; the rest still NaN
            written = np.zeros(y.shape, bool)
            for p in range(W):
                assert np.array_equal(y[p * 3:p * 3 + 2, :3, :3], xs[p][1:3, 2:5, 1:4]), (r, p)
                written[p * 3:p * 3 + 2, :3, :3] = True
            assert np.isnan(y[~written]).all(), r


@tl.kernel
def ce_shared_slot(x: tl.Symmetric, y: tl.Symmetric, *, comm: tl.CommSchedule = None):
    W = tl.world_size()
    got = tl.signal("got", 1, scope="symmetric")

    @tl.comm_part(grid=(1,), engine="copy_engine", lanes=1)
    def send(s):
        tl.rank_copy_data(y.at(0), (tl.rank() * 2, 0), x, (0, 0), (2, 4))
        tl.rank_notify(got, 0, 0)                              # every rank adds to rank 0's slot 0

    @tl.comm_part(grid=(1,), engine="copy_engine", lanes=1)
    def wait(s):
        with tl.when(tl.rank() == 0):
            tl.rank_wait(got, 0, count=W)


def test_a_slot_several_ranks_copy_engines_notify_is_added_to():
    """Every rank's copy engine notifies rank 0's slot 0 (a gather counting arrivals): an absolute
    value would lose the others' counts, so each notify adds 1 (a one-thread kernel on the stream);
    the plan run on numpy memory counts every rank's, launch after launch."""
    k = ce_shared_slot.trace(3, S((2, 4), tl.float32), S((6, 4), tl.float32), comm=tl.CommSchedule(engine="copy_engine"))
    plan = plan_copy_engine(k, "send")
    writes = [a for acts in plan.actions for a in acts if isinstance(a, CeSignalWrite)]
    assert len(writes) == 3 and all(w.add and w.rank == 0 and w.slot == 0 for w in writes)
    assert "add got[0]@0 += 1" in plan.describe()
    w = plan_copy_engine(k, "wait")                            # a wait alone is fine: GEQ on the counter
    assert w.actions[0][0].target(3) == 9 and w.actions[1] == ()
    xs = [np.full((2, 4), r + 1, np.float32) for r in range(3)]
    mem = [{"x": xs[r], "y": np.zeros((6, 4), np.float32)} for r in range(3)]
    sig = [{"got": np.zeros(1, np.uint64)} for _ in range(3)]
    for launch in (1, 2):
        plan.run_numpy(mem, sig, launch)
        w.run_numpy(mem, sig, launch)                          # would deadlock short of 3 counts a launch
    assert int(sig[0]["got"][0]) == 6 and np.array_equal(mem[0]["y"], np.repeat(np.arange(1.0, 4.0), 8).reshape(6, 4))
    single = ce_shared_slot.trace(1, S((2, 4), tl.float32), S((2, 4), tl.float32),
                                  comm=tl.CommSchedule(engine="copy_engine"))
    [write] = [a for a in plan_copy_engine(single, "send").actions[0] if isinstance(a, CeSignalWrite)]
    assert not write.add                                       # one writer: the stream writes the value


@tl.kernel
def ce_beside_sm(x: tl.Symmetric, a: tl.Symmetric, c: tl.Symmetric, y, table, *, sm_slot: tl.constexpr = 0,
                 comm: tl.CommSchedule = None):
    """One signal shared by an SM part (slot ``sm_slot``; -1: a slot read from ``table``) and a
    copy-engine part (slot 1), each passing x to the next rank."""
    W = tl.world_size()
    (N,) = x.shape
    s = tl.signal("s", 2, scope="symmetric")

    @tl.comm_part(grid=(1,), engine="sm")
    def sm(i):
        right = (tl.rank() + 1) % W
        tl.tile_push_data(a.at(right), (0,), x, (0,), (N,))
        tl.peer_tile_notify(s, tl.load_scalar(table, 0) if sm_slot < 0 else sm_slot, right)

    @tl.comm_part(grid=(1,), engine="copy_engine")
    def ce(i):
        right = (tl.rank() + 1) % W
        tl.rank_copy_data(c.at(right), (0,), x, (0,), (N,))
        tl.rank_notify(s, 1, right)

    @tl.compute_part(grid=(1,))
    def fin(i):
        if sm_slot == 1:
            tl.rank_wait(s, 1, count=2)                      # both parts' notifies on one slot
        else:
            tl.peer_tile_wait(s, tl.load_scalar(table, 0) if sm_slot < 0 else sm_slot)
            tl.rank_wait(s, 1)
        tl.store(y, (0,), tl.load(a, (0,), (N,)) + tl.load(c, (0,), (N,)))


def _ce_beside_sm(sm_slot, W=3):
    f32 = S((16,), tl.float32)
    return ce_beside_sm.trace(W, f32, f32, f32, f32, S((1,), tl.int32), sm_slot=sm_slot,
                              comm=tl.CommSchedule(engine="copy_engine"))


def test_a_slot_the_copy_engine_shares_with_an_sm_parts_atomic_adds_is_added_to():
    """One signal, slot 0 added to by an SM part's kernel, slot 1 notified by the copy engine:
    where the index code shows no slot notified by both, the copy engine writes its values; where
    one is (slot 1 both), or the SM part's slot is read from memory, the copy engine's notifies of
    that signal add 1 instead (a write would lose the kernel's adds)."""
    from tldsl.runtime.gpu.run_plan import lower_for_run
    for sm_slot, add in ((0, False), (1, True), (-1, True)):
        lowered = lower_for_run(_ce_beside_sm(sm_slot))
        assert isinstance(lowered["ce"], CopyEnginePlan) and isinstance(lowered["sm"], LoweredComm)
        writes = [a for acts in lowered["ce"].actions for a in acts if isinstance(a, CeSignalWrite)]
        assert writes and all(w.add == add for w in writes), sm_slot


def test_copy_engine_plans_of_sp_attention_and_moe():
    for k, parts in ((spa_kernel(W=4, comm=CE[1], Sl=64, H=2, D=16), {"gather_k": "k_gathered",
                                                                       "gather_v": "v_gathered"}),
                     (moe_kernel(W=4, comm=CE[0], Ms=32, K=64), {"gather_x": "x_gathered"})):
        for part, dst in parts.items():
            plan = plan_copy_engine(k, part)
            rows, width = k.buffer(dst).type.shape
            for r in range(4):
                cs = plan.copies(r)
                assert len(cs) == 4 and {c.dst for c in cs} == {dst}
                assert sum(c.nbytes for c in cs) == rows * width * 2          # the whole gathered buffer, bf16


def test_copy_engine_reduce_scatter_keeps_the_gemm_kernel():
    """The GEMM of GEMM+ReduceScatter is the same kernel whichever engine reduces: only the
    communication parts change with the schedule (the copy-engine schedule's GEMM is the one
    measured on GPUs with the SM schedule's chunk counters)."""
    from tldsl.runtime.dist.gemm_rs import DEFAULT_COMPUTE
    W, Ms, K, N = 2, 4091, 1032, 3000
    srcs = []
    for comm in (tl.CommSchedule(engine="sm", mode="push", order="full_mesh", sms=1, tile_m=1024),
                 tl.CommSchedule(engine="copy_engine", mode="push", tile_m=1024)):
        k = gemm_reduce_scatter.trace(W, S((W * Ms, K), tl.bfloat16), S((K, N), tl.bfloat16), S((Ms, N), tl.bfloat16),
                                      compute=DEFAULT_COMPUTE, comm=comm, partial_dtype="out")
        srcs.append(lower_gemm(k).source)
    assert srcs[0] == srcs[1]


@tl.kernel
def comm_element_math(xi: tl.Symmetric, xf: tl.Symmetric, ya, yb, yc, yd):
    """A communication part doing element math on what it moves: an i32 tile times a Python float,
    float floor division and modulo, a float cast to i32."""
    W = tl.world_size()
    n = xi.shape[0]

    @tl.comm_part(grid=(W,))
    def move(s):
        p = (tl.rank() + s) % W
        i, f = tl.load(xi.at(p), (0,), (n,)), tl.load(xf.at(p), (0,), (n,))
        tl.store(ya, (p * n,), i * 0.1)
        tl.store(yb, (p * n,), f // 0.1)
        tl.store(yc, (p * n,), f % 0.1)
        tl.store(yd, (p * n,), tl.cast(f * 1e9, tl.int32))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ missing (CPU emulation of generated kernels)")
def test_a_communication_parts_element_math_is_the_general_lowerings(tmp_path):
    """The SM communication recipe rendered element math its own way: an i32 tile with a float in
    float (16777217 * 0.1 one ulp off numpy's double), float // and % as floorf(a / b) (1.0 // 0.1
    gave 10, numpy 9), a float cast to i32 as a plain conversion (the GPU saturates NaN and inf
    where numpy on x86 gives INT_MIN). It now uses the general lowering's element rules (found by a
    helper); emulated, every bit as the simulator's."""
    from test_codegen_general import emulate_kernel
    W, n = 2, 8
    xi = [np.array([16777217, 123456789, -2**31, 2**31 - 1, 7, 1000000007, 99999999, 3], np.int32) + r
          for r in range(W)]
    xf = [np.array([1.0, -1.0, 3.3333333, 0.7, 0.35, -3.0, np.nan, np.inf], np.float32) * (r + 1) for r in range(W)]
    outs = {"ya": np.float32, "yb": np.float32, "yc": np.float32, "yd": np.int32}
    inputs = [{"xi": xi[r], "xf": xf[r], **{k: np.full(W * n, 7, t) for k, t in outs.items()}} for r in range(W)]
    want = tl.simulate(comm_element_math, W, inputs)
    np.testing.assert_array_equal(want[0]["ya"], np.concatenate([(x * 0.1).astype(np.float32) for x in xi]))
    k = want.kernel
    lc = lower(k, "move")
    assert isinstance(lc, LoweredComm) and "tldsl::gen::f2i(" in lc.source and "floorf" not in lc.source
    assert '#include "tldsl/element_math.hpp"' in lc.source and "tldsl/general.hpp" not in lc.source
    got = emulate_kernel(k, [lc], [dict(x) for x in inputs], tmp_path)
    for r in range(W):
        for name in outs:
            np.testing.assert_array_equal(got[r][name], want[r][name], err_msg=f"rank {r} {name}")
