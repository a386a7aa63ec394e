"""Notebook-native objects: every user-facing type has a plain ``repr`` of one line and at most
200 characters, whatever it holds (a cubin, a CUDA source, W ranks' arrays and event log), and a
``_repr_html_`` that a notebook renders — tested per type, with objects big enough that a
careless repr would show it. The fused GPU ops: tests/test_reprs_dist.py."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen import CompiledKernel, KernelSass, lower_all
from tldsl.codegen.abi import LoweredKernel
from tldsl.codegen.toolchain.sass import SassReport
from tldsl.ir.display import REPR_LIMIT, compact, fit, html_card, one_line
from tldsl.ops.allgather_gemm import allgather_gemm

S = tl.TensorSpec


def assert_notebook_native(obj, *must_contain: str) -> str:
    """One line, short, naming what it is; and an HTML card that is not the plain repr."""
    text = repr(obj)
    assert "\n" not in text and len(text) <= REPR_LIMIT, (len(text), text[:400])
    for word in must_contain:
        assert word in text, (word, text)
    html = obj._repr_html_()
    assert html.startswith("<div>") and html.endswith("</div>") and "<table>" in html
    return html


@pytest.fixture(scope="module")
def sim_result():
    W, Ms, K, N = 4, 64, 64, 48
    rng = np.random.default_rng(0)
    b = rng.integers(-3, 4, (K, N)).astype(np.float16)
    inputs = [{"a": rng.integers(-3, 4, (Ms, K)).astype(np.float16), "b": b,
               "c": np.full((W * Ms, N), np.nan, np.float16)} for _ in range(W)]
    return tl.simulate(allgather_gemm, W, inputs, seed=0, compute=tl.ComputeSchedule(tile=(16, 16, 16)),
                       comm=tl.CommSchedule(tile_m=16))


def test_one_line_cuts_long_text_and_keeps_the_closing_bracket():
    assert one_line("a\n  b") == "a b"
    cut = one_line("<" + "x" * 500 + ">")
    assert len(cut) == REPR_LIMIT and cut.endswith("…>")
    kept = fit("<head ", "m" * 500, " tail>")
    assert len(kept) == REPR_LIMIT and kept.startswith("<head m") and kept.endswith("… tail>")
    assert compact(tl.CommSchedule(engine="copy_engine"), ("engine", "mode")) == \
        "CommSchedule(engine='copy_engine', mode='pull')"
    assert "&lt;b&gt;" in html_card("t", [("k", "<b>")])                  # facts are escaped


def test_kernel_function(sim_result):
    html = assert_notebook_native(allgather_gemm, "tl.kernel", "allgather_gemm")
    assert "a (symmetric)" in html and "compute" in html


def test_traced_ir_kernel(sim_result):
    k = sim_result.kernel
    html = assert_notebook_native(k, "allgather_gemm", "W=4", "gemm(compute")
    assert "<details open>" in html and "program_id" in html                  # the IR, shown
    assert str(k).startswith("kernel @allgather_gemm")                        # print() still gives the IR


def test_sim_result(sim_result):
    html = assert_notebook_native(sim_result, "SimResult", "4 ranks", "steps")
    assert "output c" in html and "NaN on any rank: False" in html and "timeline of launch" in html


def _lowered_kernels() -> dict[str, LoweredKernel]:
    """One lowered kernel of each recipe class: AG+GEMM's GEMM and SM gather, the MoE grouped
    GEMMs and combine, sequence-parallel attention, and a program only the general recipe takes."""
    from test_codegen_attention import trace_sp
    from test_codegen_moe import trace_ag, trace_rs
    ag = allgather_gemm.trace(2, S((256, 256), tl.float16), S((256, 256), tl.float16), S((512, 256), tl.float16),
                              compute=tl.ComputeSchedule(tile=(128, 128, 64)), comm=tl.CommSchedule(tile_m=128))
    from tldsl.bench.general_programs import row_softmax
    softmax = row_softmax.trace(2, S((40, 300), tl.float16), S((40, 300), tl.float16),
                                compute=tl.ComputeSchedule(tile=(16, 128, 16)))
    found: dict[str, LoweredKernel] = {}
    for kernel in (ag, trace_ag(), trace_rs(), trace_sp(), softmax):
        for lowered in lower_all(kernel).values():
            if isinstance(lowered, LoweredKernel):
                found.setdefault(type(lowered).__name__, lowered)
    return found


def test_every_lowered_kernel_class():
    found = _lowered_kernels()
    assert {"LoweredGemm", "LoweredComm", "LoweredGroupedGemm", "LoweredCombine", "LoweredAttention",
            "LoweredGeneral"} <= set(found)
    assert "W=2," in repr(found["LoweredGeneral"])            # its world size comes from its program
    for cls in _subclasses(LoweredKernel):          # a recipe not made here still gets the one tested repr
        assert cls.__name__ in found or cls.__repr__ is LoweredKernel.__repr__, cls
    for lowered in found.values():
        assert len(lowered.source) > 2 * REPR_LIMIT                          # a dataclass repr would be long
        html = assert_notebook_native(lowered, type(lowered).__name__, lowered.entry, "lines of CUDA")
        assert "CUDA source" in html and "extern" in html


def _subclasses(cls) -> set[type]:
    import tldsl.codegen.recipes  # noqa: F401 - every recipe's lowered class
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def test_compiled_kernel_never_shows_the_cubin():
    cubin = bytes(range(256)) * 2300                                           # a cubin's size: 575 KiB
    ck = CompiledKernel("tldsl_gemm", cubin, "ptxas info    : Used 168 registers", ["-arch=sm_90a"], "f" * 64,
                        cached=False, seconds=3.2, compile_seconds=3.1, source="extern \"C\" ...")
    html = assert_notebook_native(ck, "CompiledKernel", "tldsl_gemm", "575.0 KiB", "3.10 s")
    assert "\\x" not in repr(ck) and "\\x" not in html and len(html) < 10_000
    sass = KernelSass("tldsl_gemm", ["HGMMA.64x128x16.F32"] * 5000, registers=168)
    assert len(repr(sass)) <= REPR_LIMIT and "5000 instructions" in repr(sass)
    report = SassReport({"tldsl_gemm": sass}, sass_text="x" * 100_000)
    assert_notebook_native(report, "SassReport", "tldsl_gemm")

    listing = "\n".join(f"        /*{i:04x}*/   HGMMA.64x128x16.F32 ;" for i in range(5000))
    html = SassReport({"tldsl_gemm": sass}, sass_text=listing)._repr_html_()
    assert len(html) < 40_000 and "4600 more lines (the whole listing: .sass_text)" in html   # a card, not the listing


def test_the_event_log_is_a_list_shown_in_one_line(sim_result):
    events = sim_result.events
    assert isinstance(events, list) and len(events) > 100 and events[0] == list(events)[0]
    text = repr(events)
    assert "\n" not in text and len(text) <= REPR_LIMIT and f"{len(events)} events of launch 2" in text   # the last launch's


def test_the_ir_and_codegen_pieces_a_notebook_shows(sim_result):
    """Objects reached from a traced kernel, a lowering or the toolchain: one short line each,
    never a dataclass dump of their fields (a buffer's value, a block's ops, a CUDA source)."""
    from tldsl.codegen import CompileJob, lower, find_toolchain
    from tldsl.ops.registry import OPS
    k = sim_result.kernel
    for obj, words in [(k.buffers[0], ("Buffer(a:", "arg")), (k.signals[0], ("Signal(",)),
                       (k.parts[0].body, ("Block(", "ops")), (tl.SimOptions(), ("SimOptions()",)),
                       (tl.SimOptions(launches=3), ("launches=3",)),
                       (CompileJob("x\n" * 5000, "tldsl_k", ("-DX=1",)), ("tldsl_k", "5001 lines", "-DX=1")),
                       (find_toolchain(), ("NVRTC", "CUTLASS")), (OPS["allgather_gemm"], ("OpSpec(allgather_gemm",))]:
        text = repr(obj)
        assert "\n" not in text and len(text) <= REPR_LIMIT and " at 0x" not in text, text
        for word in words:
            assert word in text, (word, text)
    W = 8
    ce = allgather_gemm.trace(W, S((64, 64), tl.float16), S((64, 48), tl.float16), S((W * 64, 48), tl.float16),
                              compute=tl.ComputeSchedule(tile=(16, 16, 16)),
                              comm=tl.CommSchedule(engine="copy_engine", mode="pull", tile_m=None))
    plan = lower(ce, next(p.name for p in ce.parts if p.role == "comm"))
    html = assert_notebook_native(plan, "CopyEnginePlan", f"W={W}", "copies")
    assert "describe()" in html


def test_mappings_show_what_they_map():
    shown = {}

    @tl.kernel
    def mapped(x, table, y):
        shown["static"] = repr(tl.StaticMapping("rows", x, rows_per_rank=x.shape[0] // tl.world_size(), tile=16))
        shown["dynamic"] = repr(tl.DynamicMapping("route", 4, expert=table))

        @tl.compute_part(grid=(1,))
        def p(i):
            tl.store(y, (0, 0), tl.load(x, (0, 0), (16, 16)))

    mapped.trace(2, S((64, 16), tl.float32), S((4,), tl.int32), S((64, 16), tl.float32))
    assert shown["static"].startswith("<StaticMapping rows: rows of 'x', 2 shards x 32 rows, tile 16 rows -> 4 tiles")
    assert shown["dynamic"].startswith("<DynamicMapping route: dynamic over 4 tiles") and "expert=" in shown["dynamic"]


@tl.kernel
def long_chain(x, y):
    @tl.compute_part(grid=(1,))
    def part(p):
        t = tl.load(x, (0,), (8,))
        for _ in tl.static_range(1500):
            t = t * 1.0001 + 0.5
        tl.store(y, (0,), t)


def test_a_result_card_clips_a_long_ir_and_says_where_the_rest_is():
    """A 3,000-line IR made a 536 KB SimResult card (found by a helper): the card keeps the first
    lines of the IR and the timeline, and names where the whole text is."""
    from tldsl.ir.display import clipped
    r = tl.simulate(long_chain, 1, [{"x": np.ones(8, np.float32), "y": np.full(8, np.nan, np.float32)}])
    assert len(str(r.kernel).splitlines()) > 3000
    html = r._repr_html_()
    assert len(html) < 60_000 and "print(result.kernel)" in html
    assert clipped("a\nb", 5) == "a\nb"


def test_moe_routing_shows_its_sizes_not_its_tables():
    """Found by an explorer's round: MoERouting (what moe_routing and simulate_allgather_moe return)
    had the dataclass repr, every table: 2,737 characters over 72 lines for 512 tokens."""
    from tldsl.ops.moe import moe_routing, random_routing
    ids, _ = random_routing(np.random.default_rng(0), 512, 8, 2)
    rt = moe_routing(ids, 8, 4, 128, 64)
    html = assert_notebook_native(rt, "MoERouting", "512 tokens (4 ranks x 128)", "top-2 of 8 experts",
                                  f"of {rt.num_tiles} tiles of 64 rows", f"{rt.num_rows} rows")
    assert "rows per expert" in html and "sorted_token_ids: [1472] int32" in html and len(html) < 5_000
