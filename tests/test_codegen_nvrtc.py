"""Generated Hopper GEMMs compiled with NVRTC for sm_90a (no GPU needed), checked on their SASS.

Skipped — with the reason — only where the CUDA wheels are missing (see
``tldsl.codegen.toolchain.REQUIREMENTS``); CI installs them.

SASS expectations for every generated GEMM: WGMMA ran as tensor-core code (``HGMMA``), TMA
loads and stores (``UTMALDG``, ``UTMASTG``), mbarriers (``SYNCS``), no trap (``BPT.TRAP``), and
the spill budget below. A GEMM whose tile program waits also has the acquire loads of its
signals (``LDG.E.64.STRONG.SYS`` / ``.GPU``) and the async-proxy fence (``FENCE.VIEW.ASYNC.G``).
"""
import re
import time
from pathlib import Path

import pytest

import tldsl as tl
from tldsl.codegen import toolchain as tcm
from tldsl.codegen.toolchain.cache import KernelCache
from tldsl.codegen.toolchain.compiler import CompileJob, CudaCompileError, compile_cuda, compile_many
from tldsl.codegen import lower_gemm

from test_codegen_host import trace_ag, trace_plain
from tldsl.ops.allgather_gemm import allgather_gemm

S = tl.TensorSpec

_OK, _WHY = tcm.toolchain_available()
pytestmark = [pytest.mark.nvrtc,
              pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")]

#: Spill budget: no bytes of spill stores/loads, no local-memory instructions, no stack.
SPILL_BUDGET_BYTES = 0
#: The launch bound of a 384-thread CTA caps ptxas at 168 registers (consumers raise theirs with setmaxnreg).
MAX_REGISTERS = 168

needs_cuobjdump = pytest.mark.skipif(_OK and tcm.find_toolchain().cuobjdump is None,
                                     reason="cuobjdump missing: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


@pytest.fixture
def cache(tmp_path):
    return KernelCache(tmp_path / "cache")


def test_toolchain_found_with_pinned_versions():
    tc = tcm.find_toolchain()
    assert tc.nvrtc_version.startswith("13.0")
    assert tc.cccl_version in tcm.CCCL_TESTED
    assert (tc.cutlass_include / "cute" / "arch" / "mma_sm90_gmma.hpp").exists()
    assert (tc.cuda_include / "crt" / "mma.h").exists()
    _, major, minor = tc.nvrtc().nvrtcVersion()
    assert (major, minor) == (13, 0)
    assert "NVRTC 13.0" in str(tc)


def check_sass(ck, *, waits_scope=None):
    info = ck.ptxas_info()[ck.name]
    assert info["spill_store_bytes"] <= SPILL_BUDGET_BYTES and info["spill_load_bytes"] <= SPILL_BUDGET_BYTES, info
    assert info["stack_bytes"] == 0 and info["registers"] <= MAX_REGISTERS, info
    for warning in ("C7510", "C7514", "C7515"):       # serialised WGMMA pipelines
        assert warning not in ck.log, ck.log
    if tcm.find_toolchain().cuobjdump is None:
        return None
    k = ck.sass()[ck.name]
    s = k.summary()
    assert s["HGMMA"] > 0 and s["UTMALDG"] > 0 and s["UTMASTG"] > 0 and s["SYNCS"] > 0, s
    assert s["BPT.TRAP"] == 0 and s["LDL/STL"] == 0 and s["local_bytes"] == 0, s
    assert k.count("USETMAXREG") in (0, 2)
    acquires = k.count("LDG.E.64.STRONG.SYS") + k.count("LDG.E.64.STRONG.GPU")
    if waits_scope is None:
        assert acquires == 0 and k.count("FENCE.VIEW.ASYNC.G") == 0
    else:
        assert k.count(f"LDG.E.64.STRONG.{waits_scope}") > 0, sorted(k.mnemonics)
        assert k.count("FENCE.VIEW.ASYNC.G") > 0
    return k


SCHEDULES = [
    dict(tile=(128, 128, 64), stages=4, order="row_major", dt=tl.float16, odt=tl.float16),
    dict(tile=(128, 256, 64), stages=4, order="swizzled", dt=tl.bfloat16, odt=tl.bfloat16),
    dict(tile=(64, 128, 32), stages=6, order="comm_aligned", dt=tl.float16, odt=tl.float32),
]


@needs_cuobjdump
def test_generated_gemms_compile_for_sm90a(cache):
    lgs = [lower_gemm(trace_plain(M=1000, N=776, K=520, **s)) for s in SCHEDULES]
    events = []
    t0 = time.perf_counter()
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in lgs], cache=cache,
                       progress=events.append)
    wall = time.perf_counter() - t0
    for lg, ck in zip(lgs, cks):
        assert not ck.cached and ck.cubin[:4] == b"\x7fELF"
        k = check_sass(ck)
        assert k.count(f"HGMMA.64x{lg.config.BN}x16.F32") > 0     # the tile's N reached the instruction
        print(f"{lg.config.BM}x{lg.config.BN}x{lg.config.BK}: {ck.compile_seconds:.1f} s {ck.timings} "
              f"{k.summary()}")
    print(f"{len(lgs)} kernels in {wall:.1f} s")
    stages = {e.stage for e in events}
    assert {"cache-miss", "queued", "done"} <= stages
    assert all(e.elapsed >= 0 and e.kernel for e in events)


@needs_cuobjdump
@pytest.mark.parametrize("comm,scope", [
    (tl.CommSchedule(tile_m=64, mode="push", order="full_mesh"), "SYS"),     # peer_tile_wait
    (tl.CommSchedule(tile_m=128, mode="pull"), "GPU"),                       # consumer_tile_wait
])
def test_gemm_with_waits_compiles(cache, comm, scope):
    lg = lower_gemm(trace_ag(W=4, comm=comm, tile=(128, 128, 64), stages=4, order="comm_aligned"))
    ck = lg.compile(cache=cache, progress=False)
    check_sass(ck, waits_scope=scope)


@needs_cuobjdump
def test_gemm_staging_its_own_rows_compiles(cache):
    """own_rows (AG+GEMM pulling with CommSchedule(own_rows='compute'), the runtime's
    staging='gemm'): the schedule fuses the staging part into the GEMM, which then has the same
    SASS checks, more TMA stores (the staged A stages, to the slot and to A_gathered), the
    arrivals published with system-scope stores after a fence; with a debug timeout the slot
    wait can trap. Rows that are not whole tiles, or clusters, are refused when traced (the
    simulator refuses them too), and a cluster forced at lowering is refused there."""
    from tldsl.codegen import LoweringError
    comm = tl.CommSchedule(engine="copy_engine", mode="pull", order="ring")
    sched = dict(tile=(128, 256, 64), stages=4, order="comm_aligned", group_m=8)
    plain = lower_gemm(trace_ag(W=2, comm=comm, **sched), "gemm")
    ir = trace_ag(W=2, comm=comm.with_(own_rows="compute"), **sched)
    lg = lower_gemm(ir, "gemm")
    assert lg.own_rows and [t.buffer for t in lg.tma[3:]] == ["a", "a_slot"]
    assert lg.row_signals == ("own_staged", "gather_a_arrive", "gather_a_arrive_peers")
    assert [t.global_dims for t in lg.tma[3:]] == [(512, 1024)] * 2 and lg.tma[3].box_dims == lg.tma[0].box_dims
    k0 = plain.compile(cache=cache, progress=False).sass()[plain.entry]
    k = check_sass(lg.compile(cache=cache, progress=False), waits_scope="SYS")    # flags the copy engine writes
    assert k.count("UTMASTG") > k0.count("UTMASTG") and k.count("ATOMG") >= 1 and k.count("STG.E.64.STRONG.SYS") >= 1
    dbg = lower_gemm(ir, "gemm", wait_timeout_ns=10 ** 9).compile(cache=cache, progress=False)
    assert dbg.sass()[lg.entry].count("BPT.TRAP") >= 1
    with pytest.raises(tl.ScheduleError, match="whole tiles"):
        allgather_gemm.trace(2, S((1000, 512), tl.float16), S((512, 768), tl.float16), S((2000, 768), tl.float16),
                             compute=tl.ComputeSchedule(tile=(128, 256, 64)), comm=comm.with_(own_rows="compute"))
    with pytest.raises(tl.ScheduleError, match="without thread-block clusters"):
        trace_ag(W=2, comm=comm.with_(own_rows="compute"), cluster=(2, 1), **sched)
    with pytest.raises(LoweringError, match="without thread-block clusters"):
        lower_gemm(ir, "gemm", cluster=(2, 1))


@needs_cuobjdump
def test_gemm_gathering_pushed_rows_compiles(cache):
    """gather_rows (AG+GEMM with the copy engines pushing, own_rows='compute'): this rank's rows
    from its shard, the peers' from A (the landing buffer) behind system-scope waits on the flags
    the peers' copy engines write, every A stage stored into the gathered output: more TMA
    stores than the plain GEMM, no atomics or remote stores (nothing is published). Column
    slices keep the same kernel with sliced waits."""
    comm = tl.CommSchedule(engine="copy_engine", mode="push", order="ring")
    sched = dict(tile=(128, 256, 64), stages=4, order="comm_aligned", group_m=8)
    plain = lower_gemm(trace_ag(W=2, comm=comm, **sched), "gemm")
    lg = lower_gemm(trace_ag(W=2, comm=comm.with_(own_rows="compute"), **sched), "gemm")
    assert lg.gather_rows and not lg.own_rows and not lg.push_rows
    assert [t.buffer for t in lg.tma[3:]] == ["a", "a_gathered_out"] and lg.row_signals == ()
    assert [t.global_dims for t in lg.tma[3:]] == [(512, 1024), (512, 2048)]
    k0 = plain.compile(cache=cache, progress=False).sass()[plain.entry]
    k = check_sass(lg.compile(cache=cache, progress=False), waits_scope="SYS")
    assert k.count("UTMASTG") > k0.count("UTMASTG") and k.count("ATOMG") == 0 and k.count("STG.E.64.STRONG.SYS") == 0
    sliced = lower_gemm(trace_ag(W=2, comm=comm.with_(own_rows="compute", col_tile=128), **sched), "gemm")
    assert sliced.gather_rows and "kStaged = true" in sliced.source and "kStaged = false" in lg.source


@needs_cuobjdump
def test_gemm_waiting_per_column_slice_compiles(cache):
    """A column-sliced copy-engine all-gather (col_tile): the tile program's waits sit in its K
    loop, so the producer runs them per stage (TileWaits::stage, system-scope acquires at the
    slices' first steps: target per_launch * (launch - 1) + slice + 1) and nothing before the
    tile; the gathering GEMM keeps its stores. Without col_tile the same program compiles to the
    whole-shard waits before the tile, and no stage waits."""
    sliced = tl.CommSchedule(engine="copy_engine", mode="push", order="ring", col_tile=128, own_rows="compute")
    whole = tl.CommSchedule(engine="copy_engine", mode="push", order="ring", own_rows="compute")
    lg = lower_gemm(trace_ag(W=2, comm=sliced, tile=(128, 256, 64), stages=4, order="comm_aligned", group_m=8),
                    "gemm")
    assert "kStaged = true" in lg.source and "kEnabled = false" in lg.source
    assert "4ull * (launch - 1ull) + (unsigned long long)(" in lg.source      # 512 columns: 4 slices
    assert "tldsl::floormod(k0, 128)" in lg.source and lg.waits == 1
    plain = lower_gemm(trace_ag(W=2, comm=whole, tile=(128, 256, 64), stages=4, order="comm_aligned", group_m=8),
                       "gemm")
    assert "kStaged = false" in plain.source and "kEnabled = true" in plain.source
    assert "per_launch" not in plain.source and "(launch - 1ull)" not in plain.source
    k = check_sass(lg.compile(cache=cache, progress=False), waits_scope="SYS")
    k0 = check_sass(plain.compile(cache=cache, progress=False), waits_scope="SYS")
    assert k.count("UTMASTG") >= 2 and k0.count("UTMASTG") >= 2          # the gathered copy's stores, both ways
    dbg = lower_gemm(trace_ag(W=2, comm=sliced, tile=(128, 256, 64), stages=4, order="comm_aligned", group_m=8),
                     "gemm", wait_timeout_ns=10 ** 9).compile(cache=cache, progress=False)
    assert dbg.sass()[lg.entry].count("BPT.TRAP") >= 1


@needs_cuobjdump
@pytest.mark.parametrize("W", [2, 4])
def test_gemm_pushing_its_rows_compiles(cache, W):
    """push_rows (AG+GEMM with the GEMM pushing this rank's rows, no copy engine): the stages of
    this rank's rows also stored into each peer's landing buffer (one descriptor per peer, both
    slots), the storing tiles counted and the launch's last one publishing the flag on every
    peer (a system-scope fence, an atomic add, remote stores). The descriptors and parameters
    follow the world size (the schedule: engine='compute', own_rows='compute')."""
    from tldsl.codegen import LoweringError, lower
    comm = tl.CommSchedule(engine="copy_engine", mode="push", order="ring", own_rows="compute")
    pushing = comm.with_(engine="compute")
    gather = lower_gemm(trace_ag(W=W, comm=comm, tile=(128, 256, 64), stages=4, order="comm_aligned", group_m=8),
                        "gemm")
    ir = trace_ag(W=W, comm=pushing, tile=(128, 256, 64), stages=4, order="comm_aligned", group_m=8)
    lg = lower_gemm(ir, "gemm")
    assert lg.push_rows and "(push_rows)" in lg.describe()
    pushes = [t for t in lg.tma if t.param.startswith("tma_push_")]
    assert [t.buffer for t in pushes] == [f"push_landing_{q}" for q in range(W - 1)]
    assert all(t.global_dims == (512, 2 * W * 1024) for t in pushes)      # both slots of [W * 1024, 512]
    assert [p.source for p in lg.params[-2:]] == ["signal:push_count", "signal:gather_a_ready_peers"]
    assert "GatherRows<Cfg::kWorldSize, true, true>" in lg.source and "int(launch & 1ull) * M" in lg.source
    k0 = check_sass(gather.compile(cache=cache, progress=False), waits_scope="SYS")
    k = check_sass(lg.compile(cache=cache, progress=False), waits_scope="SYS")
    assert k.count("UTMASTG") > k0.count("UTMASTG")
    assert k.count("MEMBAR") > k0.count("MEMBAR") and k.count("ATOMG") >= 1 and k0.count("ATOMG") == 0
    assert k.count("STG.E.64.STRONG.SYS") >= 1 and k0.count("STG.E.64.STRONG.SYS") == 0
    with pytest.raises(LoweringError, match="fused into compute part 'gemm'"):
        lower(ir, "gather_a")
    for order, group_m in (("swizzled", 8), ("comm_aligned", 3)):        # 8 tile rows per rank: not 3's multiple
        bad = trace_ag(W=W, comm=pushing, tile=(128, 256, 64), stages=4, order=order, group_m=group_m)
        with pytest.raises(LoweringError, match="push its tiles of this rank's rows before"):
            lower_gemm(bad, "gemm")


def test_cache_hit_is_fast_and_keyed_on_options(cache):
    lg = lower_gemm(trace_plain(tile=(128, 64, 64), stages=3))
    first = lg.compile(cache=cache, progress=False)
    assert not first.cached
    t0 = time.process_time()          # CPU (a hit compiles nothing); wall time under a loaded machine waits its turn
    hit = lg.compile(cache=cache, progress=False)
    elapsed = time.process_time() - t0
    assert hit.cached and hit.cubin == first.cubin and hit.key == first.key
    assert elapsed < 0.05, f"cache hit took {elapsed * 1000:.1f} ms"
    assert hit.compile_seconds == pytest.approx(first.compile_seconds)
    other = lg.compile(cache=cache, progress=False, options=["-DTLDSL_UNUSED_FLAG=1"])
    assert not other.cached and other.key != first.key
    assert other.options != first.options


def test_compile_error_points_at_generated_line_and_dsl_line(cache):
    lg = lower_gemm(trace_ag(comm=tl.CommSchedule(tile_m=64, mode="pull")))
    needle = "tldsl::wait_at_least<tldsl::kScopeGpu>(sig_gather_a_ready"
    assert needle in lg.source
    bad = lg.source.replace(needle, "tldsl::wait_at_least<tldsl::kScopeGpu>(sig_not_declared")
    line = next(i for i, l in enumerate(bad.splitlines(), 1) if "sig_not_declared" in l)
    with pytest.raises(CudaCompileError) as ei:
        compile_cuda(bad, lg.entry, cache=cache, progress=False)
    e = ei.value
    assert isinstance(e, tl.CompilationError)
    assert line in e.sites
    assert e.loc is not None and e.loc.filename.endswith("allgather_gemm.py")
    assert "wait_rows" in e.loc.source                           # the tile program's line
    msg = str(e)
    assert 'identifier "sig_not_declared" is undefined' in msg and f">{line} |" in msg.replace("  >", ">")


def test_template_error_reports_instantiation_site(cache):
    lg = lower_gemm(trace_plain())
    bad = lg.source.replace(f"Tr::kSmemBytes == {lg.smem_bytes}", f"Tr::kSmemBytes == {lg.smem_bytes + 1}")
    with pytest.raises(CudaCompileError) as ei:
        compile_cuda(bad, lg.entry, cache=cache, progress=False)
    assert "host/device shared-memory size mismatch" in str(ei.value)


def test_progress_reports_every_stage(cache):
    events = []
    src = 'extern "C" __global__ void tldsl_tiny(float* x) { x[threadIdx.x] *= 2.f; }\n'
    ck = compile_cuda(src, "tldsl_tiny", cache=cache, progress=events.append)
    assert [e.stage for e in events][:2] == ["cache-miss", "queued"] and events[-1].stage == "done"
    assert any(e.stage == "nvrtc-phase" for e in events)
    assert "front_end" in ck.timings and "ptxas" in ck.timings
    assert str(events[-1]).startswith("[tldsl] tldsl_tiny: compiled in")
    events.clear()
    assert compile_cuda(src, "tldsl_tiny", cache=cache, progress=events.append).cached and events == []


def test_compile_benchmark_reports_a_cold_compile_and_a_cache_hit(tmp_path, capsys, monkeypatch):
    """`python -m tldsl.bench compile`: a cold NVRTC compile, then a second process served by the
    cache (the issue's compile figures come from this command)."""
    from tldsl.bench import main
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(tmp_path / "unused"))
    cache = tmp_path / "cache"
    cache.mkdir()
    assert main(["compile", "--shape", "1024x1024x512", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out.splitlines()
    cold = next(line for line in out if line.startswith("cold:"))
    hit = next(line for line in out if line.startswith("cache "))
    assert hit.startswith("cache hit:"), out                            # the second process found the cubin
    compile_s = float(cold.split("compile ")[1].split(" s")[0])
    lookup_ms = float(hit.split("lookup ")[1].split(" ms")[0])
    assert compile_s > 0.2 and lookup_ms < 1e3 * compile_s / 5       # NVRTC ran once; the hit compiled nothing
    assert any(p.is_file() for p in cache.rglob("*"))                 # the cubin went into the given cache
    (cache / "extra").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        main(["compile", "--cache-dir", str(cache)])


@needs_cuobjdump
def test_allgather_staging_kernel_moves_16_byte_vectors(cache):
    """AG+GEMM's staging kernel (one pass: the shard into its symmetric slot and its rows of
    A_gathered, and the flag) compiles to 128-bit loads and stores, no local memory."""
    from tldsl.runtime.dist import staging
    ck = compile_cuda(staging.SOURCE, staging.ENTRY, cache=cache)
    k = ck.sass()[ck.name]
    assert k.count("LDG.E.128") >= 4 and k.count("STG.E.128") >= 8, sorted(k.mnemonics)
    assert k.local_bytes == 0 and k.count("BPT.TRAP") == 0


def test_names_equal_only_as_c_identifiers_get_parameters_of_their_own(cache):
    """Workspaces "x-y" and "x_y", signals "s-1" and "s_1", a symmetric workspace "g_peers" beside
    g's table of peers' pointers: the simulator runs them, so every part's kernel must compile —
    it declared two parameters buf_x_y (NVRTC: duplicate parameter name). The tensors keep their
    IR names (the runtime binds by them); only the C names differ."""
    from programs import c_name_clashes
    from tldsl.codegen import lower_all
    k = c_name_clashes.trace(2, S((8,), tl.float32), S((16,), tl.float32))
    assert [b.name for b in k.workspaces] == ["x-y", "x_y", "g", "g_peers"]
    lowered = lower_all(k)
    for part, lk in lowered.items():
        names = [p.name for p in lk.params]
        assert len(names) == len(set(names)), (part, names)
        lk.compile(cache=cache, progress=False)
    by_source = {p.source: p.name for p in lowered["consume"].params}
    assert by_source["buffer:x-y"] == "buf_x_y" and by_source["buffer:x_y"] == "buf_x_y_1"
    assert by_source["signal:s-1"] == "sig_s_1" and by_source["signal:s_1"] == "sig_s_1_1"
    assert by_source["buffer:g_peers"] == "buf_g_peers_1"


def test_an_epilogue_storing_into_a_tensor_called_a_gets_a_descriptor_of_its_own(cache):
    """GEMM+ReduceScatter summing in the epilogue, its output called ``a``: the epilogue's store
    descriptor was tma_a, the name of operand A's (two parameters tma_a, and two descriptors
    the runtime binds by that name)."""
    from tldsl.codegen import lower
    from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter

    @tl.kernel
    def out_called_a(x, b, a, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
        gemm_reduce_scatter.fn(x, b, a, compute=compute, comm=comm)

    k = out_called_a.trace(2, S((512, 256), tl.bfloat16), S((256, 512), tl.bfloat16), S((256, 512), tl.bfloat16),
                           compute=tl.ComputeSchedule(tile=(128, 128, 64)),
                           comm=tl.CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue"))
    lg = lower(k, "gemm")
    names = [p.name for p in lg.params]
    assert len(names) == len(set(names)) and "tma_a_tensor" in names, names
    assert [t.buffer for t in lg.tma if t.param in ("tma_a", "tma_a_tensor")] == ["x", "a"]
    lg.compile(cache=cache, progress=False)


@needs_cuobjdump
def test_allgather_publishing_staging_kernel(cache):
    """handshake='device': the staging kernel that is also the launch's handshake keeps the
    plain kernel's 128-bit copy loop, counts its blocks with one atomic each, publishes with a
    system-scope fence; with a debug timeout its wait can trap, without one it cannot."""
    from tldsl.runtime.dist import staging
    ck = compile_cuda(staging.PUBLISH_SOURCE, staging.PUBLISH_ENTRY, cache=cache)
    k = ck.sass()[ck.name]
    assert k.count("LDG.E.128") >= 4 and k.count("STG.E.128") >= 8, sorted(k.mnemonics)
    assert k.count("ATOMG") == 1 and k.count("MEMBAR") >= 2 and k.count("NANOSLEEP") >= 1
    assert k.local_bytes == 0 and k.count("BPT.TRAP") == 0
    dbg = compile_cuda(staging.PUBLISH_SOURCE, staging.PUBLISH_ENTRY, options=("-DTLDSL_WAIT_TIMEOUT_NS=1000000ull",),
                       cache=cache)
    assert dbg.sass()[dbg.name].count("BPT.TRAP") == 1


@needs_cuobjdump
def test_a_timed_out_wait_prints_its_slot_only_in_debug_builds(cache, monkeypatch):
    """A wait timeout alone compiles a trap and nothing else (no printf: its call slows a whole
    kernel, 18 % on a folded grouped GEMM); while TLDSL_WAIT_TIMEOUT_NS is set (debugging) the
    wait prints its slot before it traps, in the line dist_check parses."""
    from tldsl.codegen.abi import wait_timeout_options
    from tldsl.runtime.dist import staging
    monkeypatch.delenv("TLDSL_WAIT_TIMEOUT_NS", raising=False)
    assert wait_timeout_options(10 ** 6) == ("-DTLDSL_WAIT_TIMEOUT_NS=1000000ull",)
    quiet = compile_cuda(staging.PUBLISH_SOURCE, staging.PUBLISH_ENTRY, options=wait_timeout_options(10 ** 6),
                         cache=cache)
    monkeypatch.setenv("TLDSL_WAIT_TIMEOUT_NS", "5000000000")
    assert wait_timeout_options(10 ** 6) == ("-DTLDSL_WAIT_TIMEOUT_NS=1000000ull", "-DTLDSL_WAIT_TIMEOUT_REPORT")
    loud = compile_cuda(staging.PUBLISH_SOURCE, staging.PUBLISH_ENTRY, options=wait_timeout_options(10 ** 6),
                        cache=cache)
    for ck, prints in ((quiet, False), (loud, True)):
        sass = ck.sass()
        assert sum(k.count("BPT.TRAP") for k in sass.kernels.values()) == 1
        # printf is the one absolute call (vprintf) and the kernel's one stack frame (its arguments)
        assert ("CALL.ABS" in sass.sass_text) == prints, ck.options
        assert (ck.ptxas_info()[staging.PUBLISH_ENTRY]["stack_bytes"] > 0) == prints, ck.ptxas_info()
    # the printed line is the one dist_check reads back
    from tldsl.checks.dist_check import _TIMEOUT_RE
    header = (Path(__file__).parents[1] / "codegen/include/tldsl/signals.hpp").read_text()
    fmt = re.search(r'printf\("(tldsl: wait timed out[^"]*?)\\n"', header).group(1)
    values = iter(["0x1008", "0", "2", "7", "0"])
    assert _TIMEOUT_RE.search(re.sub(r"%(?:p|llu|d)", lambda _: next(values), fmt)), fmt
