"""Code generator pieces that need no CUDA wheels: the cache, SASS/log parsing, compile-error
mapping, the GEMM lowering's recognition and host-side numbers, and the C++ tile order
(checked against the simulator's order with the host C++ compiler)."""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen.toolchain import cache as kc
from tldsl.codegen.toolchain.compiler import CudaCompileError, dsl_location, parse_diagnostics, source_excerpt
from tldsl.codegen import LoweringError, lower_gemm
from tldsl.codegen.toolchain.sass import parse_ptxas_log, parse_resource_usage, parse_sass, parse_sass_lines, KernelSass
from tldsl.kernel import TensorSpec as S
from tldsl.ops.allgather_gemm import allgather_gemm

INCLUDE = Path(__file__).resolve().parent.parent / "codegen" / "include"


@tl.kernel
def plain_gemm(a, b, c, *, compute: tl.ComputeSchedule = None, accumulate: str = "+="):
    """``accumulate``: how the K loop is written — ``+=``, ``dot(acc=)`` or ``read + dot``."""
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def mm(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            x, y = tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN))
            if accumulate == "+=":
                acc += tl.dot(x, y)
            elif accumulate == "dot(acc=)":
                acc.write(tl.dot(x, y, acc.read()))
            else:
                acc.write(acc.read() + tl.dot(x, y))
        tl.store(c, (pm * BM, pn * BN), acc)


def trace_plain(M=512, N=384, K=256, tile=(128, 128, 64), dt=tl.float16, odt=tl.float16, **sched):
    return plain_gemm.trace(1, S((M, K), dt), S((K, N), dt), S((M, N), odt),
                            compute=tl.ComputeSchedule(tile=tile, **sched))


def trace_ag(W=4, comm=None, tile=(128, 128, 64), dt=tl.float16, **sched):
    comm = comm or tl.CommSchedule(tile_m=64, mode="push", order="full_mesh")
    return allgather_gemm.trace(W, S((1024, 512), dt), S((512, 768), dt), S((W * 1024, 768), dt),
                                compute=tl.ComputeSchedule(tile=tile, **sched), comm=comm)


# -- cache ----------------------------------------------------------------------------------------

KEYARGS = dict(nvrtc_version="13.0.88", arch="sm_90a", cutlass_version="4.2.0.0", cccl_version="13.0.85",
               codegen_hash="x")


def test_cache_key_covers_every_input():
    base = kc.cache_key("src", ["-DA"], **KEYARGS)
    assert base == kc.cache_key("src", ["-DA"], **KEYARGS)
    assert base != kc.cache_key("src2", ["-DA"], **KEYARGS)
    assert base != kc.cache_key("src", ["-DB"], **KEYARGS)
    for field, other in (("nvrtc_version", "13.0.48"), ("arch", "sm_90"), ("cutlass_version", "4.1.0"),
                         ("cccl_version", "13.1.115"), ("codegen_hash", "y")):
        assert base != kc.cache_key("src", ["-DA"], **dict(KEYARGS, **{field: other})), field
    # include paths are machine-specific, DSL markers name the checkout: neither changes the key
    assert base == kc.cache_key("src", ["-DA", "-I/some/where"], **KEYARGS)
    assert kc.cache_key("int x;  // tldsl: /a/b.py:3\n", [], **KEYARGS) == \
        kc.cache_key("int x;  // tldsl: /c/d.py:9\n", [], **KEYARGS)


def test_codegen_hash_covers_templates():
    h = kc.codegen_source_hash()
    assert len(h) == 64
    files = {p.name for p in (INCLUDE / "tldsl").iterdir()}
    assert {"sm90_gemm.hpp", "signals.hpp", "tile_order.hpp"} <= files


def test_cache_roundtrip_atomic_and_fast(tmp_path):
    c = kc.KernelCache(tmp_path)
    key = kc.cache_key("s", [], **KEYARGS)
    assert c.get(key) is None
    cubin = os.urandom(300_000)
    c.put(key, cubin, {"options": ["-DA"], "log": "ptxas info"})
    t0 = time.process_time()          # CPU: under three other workers on two cores, wall time waits its turn
    e = c.get(key)
    assert (time.process_time() - t0) < 0.05
    assert e.cubin == cubin and e.options == ["-DA"] and e.log == "ptxas info"
    files = sorted(p.name for p in (tmp_path / key[:2]).iterdir())
    assert files == [f"{key}.cubin", f"{key}.json"]          # no temporary files left behind
    # a damaged cubin is a miss, and the next put repairs it
    (tmp_path / key[:2] / f"{key}.cubin").write_bytes(b"junk")
    assert c.get(key) is None
    c.put(key, cubin, {})
    assert c.get(key).cubin == cubin
    assert json.loads((tmp_path / key[:2] / f"{key}.json").read_text())["key"] == key
    assert c.clear() == 2 and c.get(key) is None


def test_cache_dir_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert kc.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TLDSL_CACHE_DIR")
    assert kc.cache_dir() == tmp_path / "x" / "tldsl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kc.cache_dir() == Path.home() / ".cache" / "tldsl"


# -- SASS and logs ----------------------------------------------------------------------------------

SASS = """
	code for sm_90a
		Function : tldsl_k
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                   /* 0x00000a00ff017b82 */
        /*0010*/                   SYNCS.EXCH.64 URZ, [UR17], UR4 ;                        /* 0x00000004113f75b2 */
        /*0020*/              @!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R2 ;    /* 0x000000ff030075a7 */
        /*0030*/                   UTMALDG.2D [UR8], [UR16], desc[UR22] ;                  /* 0x00000016080075b4 */
        /*0040*/                   HGMMA.64x128x16.F32 R24, gdesc[UR16].tnspB, R24, gsb0 ;  /* 0x41e00000101879f0 */
        /*0050*/                   STL.128 [R1], RZ ;                                       /* 0x000000ff01007387 */
        /*0060*/                   BPT.TRAP 0x1 ;                                           /* 0x000000040000795c */
        /*0070*/                   EXIT ;                                                   /* 0x000000000000794d */
"""
RES = """
 Resource usage:
 Common:
  GLOBAL:8276 CONSTANT[4]:27048 CONSTANT[3]:4
 Function tldsl_k:
  REG:154 STACK:16 SHARED:1024 LOCAL:16 CONSTANT[0]:852 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_parse_sass_and_resources():
    ins = parse_sass(SASS)["tldsl_k"]
    k = KernelSass("tldsl_k", ins)
    assert ins[2] == "SYNCS.PHASECHK.TRANS64.TRYWAIT"          # predicate guard dropped
    assert k.count("HGMMA") == 1 and k.count("UTMALDG") == 1 and k.count("SYNCS") == 2
    assert k.count("BPT.TRAP") == 1 and k.spill_instructions == 1
    assert k.mnemonics["SYNCS.PHASECHK"] == 1 and k.opcodes["HGMMA.64x128x16.F32"] == 1
    lines = parse_sass_lines(SASS)["tldsl_k"]                 # whole instructions, guard and operands kept
    assert len(lines) == len(ins)
    assert lines[2] == "@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R2"
    assert lines[4] == "HGMMA.64x128x16.F32 R24, gdesc[UR16].tnspB, R24, gsb0"
    r = parse_resource_usage(RES)["tldsl_k"]
    assert r == {"REG": 154, "STACK": 16, "SHARED": 1024, "LOCAL": 16, "CONSTANT[0]": 852}


def test_parse_ptxas_log():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\nptxas info    : Function properties for k\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 16 barriers\n")
    assert parse_ptxas_log(log) == {"k": {"stack_bytes": 8, "spill_store_bytes": 4, "spill_load_bytes": 4,
                                          "registers": 168}}


# -- compile-error mapping (from a canned NVRTC log) --------------------------------------------------

def test_compile_error_points_at_generated_and_dsl_line(tmp_path):
    user = tmp_path / "prog.py"
    user.write_text("import tldsl as tl\n\n    tl.consumer_tile_wait(ready, t)\n")
    src = "\n".join(["#include <x>", "", "void f() {", "  int a = 1;",
                     f"  wait(sig_nope + a);  // tldsl: {user}:3", "}", ""])
    log = ('k.cu(5): error: identifier "sig_nope" is undefined\n  wait(sig_nope + a);\n       ^\n\n'
           '1 error detected in the compilation of "k.cu".\n')
    d = parse_diagnostics(log)
    assert [(x.line, x.severity) for x in d] == [(5, "error")]
    err = CudaCompileError("k", src, log, [], "k.cu")
    assert isinstance(err, tl.CompilationError)
    assert err.loc is not None and err.loc.lineno == 3 and str(user) in str(err.loc)
    msg = str(err)
    assert 'identifier "sig_nope" is undefined' in msg
    assert ">5 |   wait(sig_nope + a);" in msg.replace("  >", ">")
    assert "tl.consumer_tile_wait(ready, t)" in msg            # the DSL line, from the marker
    assert dsl_location(src, 4) is None                        # no marker on or above it in its group
    assert source_excerpt(src, 1, 1).splitlines()[0].lstrip().startswith(">1 |")


def test_compile_error_in_header_names_instantiation_site():
    src = "\n".join(["#include <t.hpp>", "void g() {", "  h<3>();  // tldsl: /x/prog.py:7", "}"])
    log = ('/inc/t.hpp(10): error: static assertion failed with "bad"\n'
           '          detected during instantiation of "void h<N>() [with N=3]" at line 3 of k.cu\n')
    err = CudaCompileError("k", src, log, [], "k.cu")
    assert err.sites == [3] and err.loc.lineno == 7
    assert "static assertion failed" in str(err)


# -- lowering: recognition and host-side numbers ----------------------------------------------------

def test_lower_plain_gemm_host_description():
    lg = lower_gemm(trace_plain())
    c = lg.config
    assert (c.BM, c.BN, c.BK, c.stages, c.consumer_wgs, c.threads) == (128, 128, 64, 3, 2, 384)
    assert (lg.M, lg.N, lg.K, lg.grid_tiles, lg.num_tiles) == (512, 384, 256, (4, 3), 12)
    assert lg.waits == 0 and lg.signals == ()
    assert "tldsl::sm90::NoWaits{}" in lg.source and "TileWaits" not in lg.source
    assert [p.name for p in lg.params] == ["tma_a", "tma_b", "tma_c", "M", "N", "K", "rank", "launch"]
    assert [p.value for p in lg.params if p.kind == "i32"][:3] == [512, 384, 256]
    a, b, cc = lg.tma
    assert (a.global_dims, a.global_strides, a.box_dims, a.swizzle) == \
        ((256, 512), (512,), (64, 128), "CU_TENSOR_MAP_SWIZZLE_128B")
    assert (b.global_dims, b.global_strides, b.box_dims) == ((384, 256), (768,), (64, 64))
    assert (cc.global_dims, cc.box_dims, cc.data_type) == ((384, 512), (64, 64), "CU_TENSOR_MAP_DATA_TYPE_FLOAT16")
    assert a.oob_fill == "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"     # out-of-bounds reads are zeros
    # stages * (A + B) + 2 warpgroups * 2 epilogue buffers * 8 KiB + barriers + alignment slack
    assert lg.smem_bytes == 3 * (128 * 64 + 64 * 128) * 2 + 2 * 2 * 8192 + 2 * 3 * 8 + 1024
    assert f"Tr::kSmemBytes == {lg.smem_bytes}" in lg.source
    assert lg.grid(132) == (12, 1, 1) and lg.block == (384, 1, 1)
    assert 'extern "C" __global__ void __launch_bounds__(384, 1)' in lg.source
    assert "C[512x384]" in lg.describe()


@pytest.mark.parametrize("tile,dt,odt,sa,sb,sc", [
    ((64, 32, 16), tl.float16, tl.float16, 32, 64, 64),
    ((128, 64, 32), tl.bfloat16, tl.float32, 64, 128, 128),
    ((128, 256, 128), tl.bfloat16, tl.bfloat16, 128, 128, 128),
])
def test_swizzle_widths_follow_the_tile(tile, dt, odt, sa, sb, sc):
    lg = lower_gemm(trace_plain(tile=tile, dt=dt, odt=odt, stages=2))
    c = lg.config
    assert (c.SA, c.SB, c.SC) == (sa, sb, sc)
    a, b, cc = lg.tma
    assert a.box_dims == (sa // 2, tile[0]) and b.box_dims == (sb // 2, tile[2])
    assert cc.box_dims == (sc // (4 if odt == tl.float32 else 2), 64)
    assert a.swizzle.endswith(f"_{sa}B") and b.swizzle.endswith(f"_{sb}B") and cc.swizzle.endswith(f"_{sc}B")


@pytest.mark.parametrize("comm,wait,scope,nsig", [
    (tl.CommSchedule(tile_m=64, mode="push", order="full_mesh"), "peer_tile_wait", "kScopeSys", 64),
    (tl.CommSchedule(tile_m=64, mode="pull"), "consumer_tile_wait", "kScopeGpu", 64),
    (tl.CommSchedule(engine="copy_engine"), "rank_wait", "kScopeSys", 4),
])
def test_lower_allgather_gemm_waits(comm, wait, scope, nsig):
    k = trace_ag(comm=comm)
    lg = lower_gemm(k)
    assert lg.waits == 1 and lg.signals == ("gather_a_ready",)
    assert lg.params[-1].name == "sig_gather_a_ready" and lg.params[-1].source == "signal:gather_a_ready"
    assert f"tldsl::wait_at_least<tldsl::{scope}>(sig_gather_a_ready + " in lg.source
    assert f"// {wait}" in lg.source and "* launch" in lg.source          # epoch counting
    assert "kWorldSize = 4" in lg.source
    # every generated prologue line carries the tile program's line
    prologue = lg.source.split("void operator()")[1].split("};")[0].split("__device__")[0]
    code = [l for l in prologue.splitlines()[2:] if l.strip() not in ("}", "")]
    assert code and all("// tldsl: " in l and "allgather_gemm.py:" in l for l in code)
    assert k.signals[0].type.slots == nsig


def test_lower_schedule_order_reaches_the_kernel():
    for order, code in (("row_major", 0), ("swizzled", 1), ("comm_aligned", 2)):
        lg = lower_gemm(trace_ag(order=order, group_m=4))
        assert f"kOrder = {code}, kGroupM = 4" in lg.source


def _raises_at(fn, text):
    with pytest.raises(LoweringError) as ei:
        fn()
    assert text in str(ei.value), str(ei.value)
    return ei.value


def test_lowering_rejects_with_reasons():
    _raises_at(lambda: lower_gemm(trace_plain(tile=(32, 64, 32))), "BM=32")
    _raises_at(lambda: lower_gemm(trace_plain(tile=(128, 64, 8))), "BK=8")
    _raises_at(lambda: lower_gemm(trace_plain(tile=(256, 256, 64))), "accumulators per consumer thread")
    _raises_at(lambda: lower_gemm(trace_plain(tile=(128, 256, 128), stages=4)), "shared memory")
    _raises_at(lambda: lower_gemm(trace_plain(K=260)), "16-byte aligned rows")
    _raises_at(lambda: lower_gemm(trace_plain(dt=tl.float32, odt=tl.float32)), "f16 or both bf16")
    _raises_at(lambda: lower_gemm(trace_plain(), cluster=(4, 1)), "cluster (4, 1)")


@tl.kernel
def scaled_gemm(a, b, c, *, compute: tl.ComputeSchedule = None):
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def mm(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        tl.store(c, (pm * BM, pn * BN), tl.exp(acc))


@tl.kernel
def shifted_gemm(a, b, c, *, compute: tl.ComputeSchedule = None):
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def mm(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN + 8), (BK, BN)))
        tl.store(c, (pm * BM, pn * BN), acc)


def test_lowering_errors_point_at_the_user_line():
    specs = (S((256, 128), tl.float16), S((128, 256), tl.float16), S((256, 256), tl.float16))
    sched = tl.ComputeSchedule(tile=(128, 128, 64))
    e = _raises_at(lambda: lower_gemm(scaled_gemm.trace(1, *specs, compute=sched)), "after the K loop")
    assert e.loc is not None and e.loc.filename == __file__
    e = _raises_at(lambda: lower_gemm(shifted_gemm.trace(1, *specs, compute=sched)), "B tile offsets must be")
    assert e.loc.filename == __file__ and "pn * BN + 8" in e.loc.source


# -- the C++ tile order == the simulator's order ----------------------------------------------------

TILE_ORDER_MAIN = r"""
#include "tldsl/tile_order.hpp"
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  int kind = atoi(argv[1]), gm = atoi(argv[2]), gn = atoi(argv[3]), g = atoi(argv[4]);
  int rank = atoi(argv[5]), W = atoi(argv[6]), shift = atoi(argv[7]), cm = atoi(argv[8]);
  // as sm90_gemm.hpp walks it: cluster tiles of cm rows, the cluster's CTAs take its rows in turn
  int gmc = (gm + cm - 1) / cm;
  int start = tldsl::comm_aligned_start(gmc, rank, W, shift);
  for (int t = 0; t < gmc * gn; ++t) {
    tldsl::TileCoord c = tldsl::tile_at(kind, t, gmc, gn, g, start);
    for (int i = 0; i < cm; ++i)
      if (c.m * cm + i < gm) printf("%d %d\n", c.m * cm + i, c.n);
  }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")
def test_cpp_tile_order_matches_schedule(tmp_path):
    src = tmp_path / "order.cpp"
    src.write_text(TILE_ORDER_MAIN)
    exe = tmp_path / "order"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{INCLUDE}", str(src), "-o", str(exe)], check=True)
    cases = [("row_major", 5, 3, 8, 0, 1, 0), ("swizzled", 7, 4, 3, 0, 1, 0), ("swizzled", 16, 2, 8, 0, 1, 0),
             ("comm_aligned", 9, 3, 8, 2, 4, 0), ("comm_aligned", 8, 5, 8, 3, 4, 1), ("comm_aligned", 3, 2, 8, 1, 2, 0),
             # a negative shift (Python's % is never negative; C++'s was), a group past int's products
             ("comm_aligned", 9, 3, 2, 0, 4, -1), ("comm_aligned", 8, 5, 1, 1, 3, -8),
             ("comm_aligned", 8, 2, 2**31 - 1, 2, 3, -7), ("swizzled", 7, 4, 2**31 - 1, 0, 1, 0)]
    cases = [c + (1,) for c in cases] + [c + (2,) for c in cases]        # clusters (1, 1) and (2, 1)
    for order, gm, gn, g, rank, W, shift, cm in cases:
        kind = {"row_major": 0, "swizzled": 1, "comm_aligned": 2}[order]
        out = subprocess.run([str(exe), *map(str, (kind, gm, gn, g, rank, W, shift, cm))], check=True,
                             capture_output=True, text=True).stdout
        got = [tuple(map(int, l.split())) for l in out.splitlines()]
        want = tl.ComputeSchedule(order=order, group_m=g, cluster=(cm, 1)).tile_order((gm, gn), rank, W, shift)
        assert got == want, (order, gm, gn, g, rank, W, shift, cm)
        assert sorted(got) == [(m, n) for m in range(gm) for n in range(gn)]     # every tile once



@tl.kernel
def shifted_rows_gemm(a, b, c, *, shift=0, compute: tl.ComputeSchedule = None):
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)), align_shift=shift)
    def mm(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        tl.store(c, (pm * BM, pn * BN), acc)


@pytest.mark.parametrize("shift,group_m", [(-1, 2**31 - 1), (10**12, 2**40), (-(10**12), 1), (2, 8)])
def test_the_gemm_template_reads_the_order_numbers_as_ints(shift, group_m):
    """A part's align_shift and the schedule's group_m are any Python ints; the template's Cfg takes
    C++ int literals. Rendered as given, 10**12 and 2**40 were narrowed to other ints (2**40 to 0).
    The host renders the shift modulo the world size (the rank the simulator's order starts on is
    (rank + shift) % W) and the group at most INT_MAX (tile_at bounds it by its rows)."""
    W = 3
    k = shifted_rows_gemm.trace(W, S((384, 128), tl.float16), S((128, 256), tl.float16), S((384, 256), tl.float16),
                                shift=shift, compute=tl.ComputeSchedule(tile=(128, 128, 64), order="comm_aligned",
                                                                        group_m=group_m, stages=2))
    lg = lower_gemm(k, "mm")
    assert f"kGroupM = {min(group_m, 2**31 - 1)}, kWorldSize = {W}, kAlignShift = {shift % W};" in lg.source


GROUPED_WALK_MAIN = r"""
#include "tldsl/grouped_tiles.hpp"
#include <cstdio>
#include <cstdlib>
struct Cfg {
  static constexpr int kGridM = GM, kGridN = GN, kClusterM = 1, kOrder = ORDER, kGroupM = GROUP_M;
  static constexpr int kWorldSize = 1, kAlignShift = 0;
  static constexpr bool kPairRows = PAIR;
};
struct Prog {               // a tile's guard, expert and valid rows from argv: expert valid, per tile row
  int expert[GM], valid[GM];
  bool active(int m, int) const { return expert[m] >= 0; }
  int batch(int m, int) const { return expert[m]; }
  int valid_rows(int m, int) const { return valid[m]; }
};
int main(int argc, char** argv) {
  Prog prog;
  const int ctas = atoi(argv[1]);
  for (int m = 0; m < GM; ++m) { prog.expert[m] = atoi(argv[2 + 2 * m]); prog.valid[m] = atoi(argv[3 + 2 * m]); }
  for (int b = 0; b < ctas; ++b) {            // as grouped_gemm_kernel's roles walk it, CTA by CTA
    const tldsl::grouped::TileWalk<Cfg> walk(b, ctas, 0);
    for (int u = walk.first; u < walk.end; u = walk.next(u)) {
      const tldsl::grouped::PairTile p = tldsl::grouped::pair_tile<Cfg, false>(prog, walk.tile(u), 0);
      printf("%d %d %d %d %d %d\n", b, p.m, p.n, int(p.valid), int(p.active), int(p.two));
    }
  }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("order", ["row_major", "swizzled"])
def test_cpp_grouped_walk_computes_every_active_tile_once(tmp_path, order):
    """The grouped GEMM's walk (grouped_tiles.hpp), compiled for the host: every active tile computed
    exactly once over all CTAs — alone, or (64-row tiles paired) with its partner, a leader always
    an even tile of one expert with its successor, itself full, the follower never alone; a slot's
    two tiles on one CTA, one after the other; unpaired, the schedule's own order."""
    rng = np.random.default_rng(0)
    kind = {"row_major": 0, "swizzled": 1}[order]
    for pair in (False, True):
        for gm, gn, group_m, ctas in ((13, 3, 4, 5), (16, 2, 8, 7), (9, 1, 2, 4), (1, 4, 8, 3)):
            # runs of experts of random lengths, each run's last tile partial, unused tiles at the end
            expert, valid, e = [], [], 0
            while len(expert) < gm - 2:
                n = int(rng.integers(1, 5))
                expert += [e] * n
                valid += [64] * (n - 1) + [int(rng.integers(1, 65))]
                e += 1
            expert, valid = (expert + [-1] * gm)[:gm], (valid + [0] * gm)[:gm]
            exe = tmp_path / f"walk_{pair}_{gm}_{gn}_{group_m}_{order}"
            src = tmp_path / "walk.cpp"
            src.write_text(GROUPED_WALK_MAIN)
            subprocess.run(["g++", "-std=c++17", "-O1", f"-I{INCLUDE}", f"-DGM={gm}", f"-DGN={gn}",
                            f"-DORDER={kind}", f"-DGROUP_M={group_m}", f"-DPAIR={'true' if pair else 'false'}",
                            str(src), "-o", str(exe)], check=True)
            args = [str(ctas)] + [str(v) for ev in zip(expert, valid) for v in ev]
            out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True).stdout
            rows = [tuple(map(int, line.split())) for line in out.splitlines()]
            computed = []
            for b, m, n, ok, active, two in rows:
                if ok and active:
                    computed += [(m, n)] + ([(m + 1, n)] if two else [])
                    if two:
                        assert m % 2 == 0 and expert[m] == expert[m + 1] >= 0 and valid[m] == 64, (m, expert, valid)
            want = [(m, n) for m in range(gm) for n in range(gn) if expert[m] >= 0]
            assert sorted(computed) == want, (pair, gm, gn, order)
            leaders = {(m, n) for _, m, n, ok, active, two in rows if ok and active and two}
            for _, m, n, ok, _, _ in rows:           # a leader's follower is never run on its own
                assert not (ok and m % 2 == 1 and (m - 1, n) in leaders)
            if pair:                                 # a slot's two tiles: one CTA, one after the other
                for b in range(ctas):
                    mine = [(m, n) for c, m, n, *_ in rows if c == b]
                    assert all(mine[i][0] // 2 == mine[i + 1][0] // 2 and mine[i][1] == mine[i + 1][1]
                               for i in range(0, len(mine), 2)), mine
            else:
                seq = tl.ComputeSchedule(order=order, group_m=group_m).tile_order((gm, gn), 0, 1)
                for b in range(ctas):
                    assert [(m, n) for c, m, n, *_ in rows if c == b] == seq[b::ctas]


def test_cluster_schedule_validation_and_order():
    with pytest.raises(tl.ScheduleError, match="cluster"):
        tl.ComputeSchedule(cluster=(1, 2))
    c = tl.ComputeSchedule(order="row_major", cluster=[2, 1])
    assert c.cluster == (2, 1) and hash(c) == hash(tl.ComputeSchedule(order="row_major", cluster=(2, 1)))
    # cluster tiles (2 rows each) row-major; the last cluster tile has one row (gm = 5)
    assert c.tile_order((5, 2), 0, 1) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1),
                                          (4, 0), (4, 1)]


def test_pushing_gemm_orders_each_ctas_own_tiles_first():
    """The GEMM that pushes this rank's rows (push_rows) publishes them as a CTA leaves them, and
    every rank waits for the others: no CTA may reach a peer's tile before its last tile of this
    rank's rows. The order lower_gemm accepts for it (comm_aligned, this rank's tile rows whole
    groups) guarantees that on every rank for any number of CTAs; a group straddling this rank's
    rows, which it refuses, does not."""
    from hypothesis import given, settings, strategies as st

    def first_peer_before_own(sched, gm, gn, W, rank, ctas):
        rows = gm // W
        own = range(rank * rows, (rank + 1) * rows)
        seq = sched.tile_order((gm, gn), rank, W)
        for b in range(ctas):
            mine = [seq[t][0] in own for t in range(b, len(seq), ctas)]
            if True in mine and False in mine[:len(mine) - mine[::-1].index(True)]:
                return True
        return False

    def lower_pushing(W, rows, group):
        """AllGather+GEMM with the GEMM pushing this rank's ``rows`` tile rows (BM = 128), lowered."""
        comm = tl.CommSchedule(engine="compute", mode="push", order="ring", own_rows="compute")
        k = allgather_gemm.trace(W, S((rows * 128, 64), tl.float16), S((64, 256), tl.float16),
                                 S((W * rows * 128, 256), tl.float16), comm=comm,
                                 compute=tl.ComputeSchedule(tile=(128, 256, 64), order="comm_aligned", group_m=group))
        return lower_gemm(k, "gemm")

    @settings(max_examples=200, deadline=None)
    @given(W=st.sampled_from([2, 4, 8]), group=st.integers(1, 8), gn=st.integers(1, 20), ctas=st.integers(1, 160),
           data=st.data())
    def check(W, group, gn, ctas, data):
        # this rank's tile rows whole groups (up to 12 rows), the orders lower_gemm accepts: every
        # example checks the order
        rows = group * data.draw(st.integers(1, max(1, 12 // group)), label="groups per rank")
        rank = data.draw(st.integers(0, W - 1), label="rank")
        sched = tl.ComputeSchedule(tile=(128, 256, 64), order="comm_aligned", group_m=group)
        assert not first_peer_before_own(sched, rows * W, gn, W, rank, ctas)
        assert lower_pushing(W, rows, group).push_rows
        if group > 1:   # a group straddling this rank's rows (a few rows more): refused
            straddling = rows + data.draw(st.integers(1, group - 1), label="extra rows")
            with pytest.raises(LoweringError, match="push its tiles of this rank's rows before"):
                lower_pushing(W, straddling, group)
    check()
    # a group straddling this rank's rows: some CTA meets a peer's tile first
    straddling = tl.ComputeSchedule(tile=(128, 256, 64), order="comm_aligned", group_m=8)
    assert first_peer_before_own(straddling, 12 * 2, 16, 2, 0, 20)      # 12 tile rows per rank, 20 CTAs


def test_every_way_of_accumulating_lowers_to_the_same_gemm():
    """`acc += tl.dot(x, y)`, `acc.write(tl.dot(x, y, acc.read()))` and `acc.write(acc.read() +
    tl.dot(x, y))` trace to the same ops in different orders: all three are the GEMM kernel, with
    the same source (but for the lines its comments point at) — not the grouped-GEMM fallback."""
    import re
    from tldsl.codegen import lower
    from tldsl.codegen import LoweredGemm
    lowered = [lower(plain_gemm.trace(1, S((256, 128), tl.bfloat16), S((128, 256), tl.bfloat16),
                                      S((256, 256), tl.bfloat16), compute=tl.ComputeSchedule(tile=(128, 256, 64)),
                                      accumulate=form), "mm")
               for form in ("+=", "dot(acc=)", "read + dot")]
    assert all(isinstance(lg, LoweredGemm) for lg in lowered)
    plain = [re.sub(r"//[^\n]*", "", lg.source) for lg in lowered]
    assert plain[0] == plain[1] == plain[2]


def test_toolchain_wheels_are_found_on_sys_path_too(tmp_path, monkeypatch):
    """Wheels installed with ``pip install --target DIR`` and reached through ``PYTHONPATH``
    (not a site directory) are found like installed ones."""
    import sys
    from tldsl.codegen.toolchain import locate
    inc = tmp_path / "cutlass_library" / "source" / "include" / "cute"
    inc.mkdir(parents=True)
    (inc / "tensor.hpp").write_text("// stand-in")
    import site
    import sysconfig
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {})            # no site directory holds them
    monkeypatch.setattr(site, "getsitepackages", lambda: [])
    monkeypatch.setattr(site, "getusersitepackages", lambda: "")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])
    assert locate._find_under_site("cutlass_library/source/include", "cute/tensor.hpp") is None
    monkeypatch.setattr(sys, "path", sys.path + [str(tmp_path)])
    assert locate._find_under_site("cutlass_library/source/include", "cute/tensor.hpp") == inc.parent
