"""The code generator's pipeline: one table of recipes tried by priority, each primitive's C++
written in one rule, and errors that reach the user's line."""
from __future__ import annotations

import pathlib
import re

import pytest

import tldsl as tl
from tldsl.codegen import RECIPES, LoweringError, lower, pipeline

from programs import scale_rows

CODEGEN = pathlib.Path(tl.codegen.__file__).resolve().parent
PRIMITIVES = CODEGEN / "rules" / "primitives.py"

#: C++ spellings that only the primitives' rules may write (helpers of signals.hpp / comm.hpp)
PRIMITIVE_CPP = ["wait_at_least", "red_relaxed_add", "fence_acq_rel", "cta_wait", "cta_notify", "cta_notify_peer",
                 "load_chunk", "store_chunk", "load_elem", r"\* \{?launch\}?\b", r"launch\}? - \{?one\}?\)|launch - 1ull"]


def _sources():
    return [p for p in CODEGEN.rglob("*.py") if p != PRIMITIVES]


@pytest.mark.parametrize("spelling", PRIMITIVE_CPP)
def test_each_primitive_is_rendered_by_one_rule(spelling):
    assert re.search(spelling, PRIMITIVES.read_text()), f"rules/primitives.py no longer renders {spelling}"
    elsewhere = [f"{p.relative_to(CODEGEN)}:{i}" for p in _sources()
                 for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(spelling, line)]
    assert not elsewhere, f"{spelling!r} is spelled outside rules/primitives.py: {elsewhere}"


def test_one_table_of_recipes_with_distinct_names_and_priorities():
    names = [r.name for r in RECIPES]
    assert len(set(names)) == len(names)
    for role in ("compute", "comm"):
        prios = [r.priority for r in RECIPES if r.role == role]
        assert len(set(prios)) == len(prios), f"two {role} recipes share a priority: the order would be arbitrary"
    assert {"gemm", "grouped_gemm", "combine", "attention", "sm_comm", "copy_engine"} <= set(names)


def _scale_rows(spec=tl.TensorSpec((64, 64), tl.float16), sched=tl.ComputeSchedule(tile=(64, 64, 32))):
    return scale_rows.trace(1, spec, spec, compute=sched)


def test_the_part_is_matched_once(monkeypatch):
    from test_codegen_host import trace_plain
    k = trace_plain()
    calls = []
    recipes = tuple(r.__class__(**{**r.__dict__, "match": (lambda m, n: lambda *a: (calls.append(n), m(*a))[1])(
        r.match, r.name)}) for r in RECIPES)
    sel = pipeline.match(k, k.parts[0], recipes)
    assert sel.recipe.name == "gemm" and calls == ["gemm"]


@pytest.mark.parametrize("part", [0, None, 1.5, "nope"])
def test_a_part_that_is_not_a_part_is_a_lowering_error(part):
    k = _scale_rows()
    with pytest.raises(LoweringError, match="has no part"):
        lower(k, part)


def test_unknown_options_are_refused_before_matching():
    k = _scale_rows()
    with pytest.raises(LoweringError, match="unknown lowering option"):
        lower(k, "part", clustr=(2, 1))


def test_a_part_no_specialised_recipe_matches_takes_the_general_recipe():
    k = _scale_rows()
    assert pipeline.match(k, k.part("part")).recipe.name == "general"
    assert type(lower(k, "part")).__name__ == "LoweredGeneral"


def test_when_no_recipe_matches_every_relevant_reason_is_given():
    """A compute part pushing a boolean tile to a peer: no compute recipe lowers it, each says why."""
    @tl.kernel
    def push_flags(x: tl.Symmetric, y: tl.Symmetric, *, compute: tl.ComputeSchedule = None):
        M, N = x.shape

        @tl.compute_part(grid=(1,))
        def part(p):
            tl.store(y.at((tl.rank() + 1) % tl.world_size()), (0, 0), tl.load(x, (0, 0), (M, N)))
    spec = tl.TensorSpec((16, 16), tl.bool_)
    k = push_flags.trace(2, spec, spec, compute=tl.ComputeSchedule(tile=(16, 16, 16)))
    with pytest.raises(LoweringError) as e:
        lower(k, "part")
    msg = str(e.value)
    assert "no lowering recognises compute part 'part'" in msg
    for name in ("attention", "general"):
        assert f"  {name}: " in msg


def test_a_part_over_the_general_lowerings_shared_memory_keeps_its_tile_in_global_scratch():
    """A 256 x 256 f32 tile (256 KB) is more than a CTA's shared memory: the general lowering
    keeps it in a global-memory scratch the runtime allocates (``scratch`` parameter)."""
    k = _scale_rows(tl.TensorSpec((512, 512), tl.float32), tl.ComputeSchedule(tile=(256, 256, 32)))
    lk = lower(k, "part")
    assert type(lk).__name__ == "LoweredGeneral" and lk.smem_bytes <= 227 * 1024
    assert lk.scratch_bytes == 256 * 256 * 4 and "scratch" in [p.source for p in lk.params]
    assert [s.split()[0] for s in lk.slots] == ["scratch"], lk.describe()


def test_an_sm_comm_part_the_streamed_kernel_refuses_takes_the_general_recipe():
    """The streamed communication kernel (sm_comm) refuses a dot, at the op; the pipeline then
    lowers the part with the general lowering for communication parts (general_comm)."""
    from tldsl.codegen import lower_comm

    @tl.kernel
    def dot_comm(a: tl.Symmetric, c, *, comm: tl.CommSchedule = None):
        W = tl.world_size()
        Ms, K = a.shape

        @tl.comm_part(grid=(W,), engine="sm")
        def push(p):
            t = tl.load(a, (0, 0), (Ms, K))
            tl.store(c, (p * Ms, 0), tl.dot(t, tl.trans(t)))      # no dot in streamed communication kernels
    spec = tl.TensorSpec((16, 16), tl.float16)
    k = dot_comm.trace(2, spec, tl.TensorSpec((32, 16), tl.float16), comm=tl.CommSchedule())
    with pytest.raises(LoweringError) as e:
        lower_comm(k, "push")
    assert "communication lowering" in str(e.value)
    assert e.value.loc is not None and e.value.loc.lineno != k.part("push").loc.lineno
    sel = pipeline.match(k, k.part("push"))
    assert sel.recipe.name == "general_comm" and [name for name, _ in sel.declined] == ["sm_comm", "copy_engine"]
    # a matcher's refusal of another kind of program is no fallback: nothing to warn about
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", tl.FallbackWarning)
        lk = lower(k, "push")
    assert lk.dots == 1 and lk.declined == ()


@tl.kernel
def _experts_on_a_1d_grid(x, w, tile_expert, y, *, compute: tl.ComputeSchedule = None):
    T, K = x.shape
    E, _, N = w.shape
    BM, BN, BK = compute.tile
    GN = N // BN

    @tl.compute_part(grid=(tile_expert.shape[0] * GN,))
    def gg(t):
        i, pn = t // GN, t % GN
        e = tl.load_scalar(tile_expert, (i,))
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(x, (i * BM, k), (BM, BK)), tl.load(w, (e, k, pn * BN), (BK, BN)))
        tl.store(y, (i * BM, pn * BN), acc)


def test_a_gemm_over_experts_the_grouped_recipe_refuses_at_its_matcher_is_a_fallback():
    """The plain GEMM matcher steps aside for a stack of experts' weights, naming the grouped GEMM
    recipe as the one made for it; that recipe refusing the part (here its 1-d grid) while the
    general lowering takes it is a FallbackWarning with the grouped recipe's reason, as a
    planner's refusal is. A program no recipe was named for (no dot) lowers without one."""
    import warnings
    S, bf = tl.TensorSpec, tl.bfloat16
    k = _experts_on_a_1d_grid.trace(1, S((256, 128), bf), S((2, 128, 256), bf), S((2,), tl.int32), S((256, 256), bf),
                                    compute=tl.ComputeSchedule(tile=(128, 128, 64), stages=2))
    with pytest.warns(tl.FallbackWarning, match="general recipe: the grouped_gemm recipe refused: .*grid must be 2-d"):
        lk = lower(k, "gg")
    assert type(lk).__name__ == "LoweredGeneral" and [n for n, _ in lk.declined] == ["grouped_gemm"]
    plain = _scale_rows()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tl.FallbackWarning)
        lp = lower(plain, "part")
    assert type(lp).__name__ == "LoweredGeneral" and lp.declined == ()


def test_kernel_parameter_sources_are_the_abi_the_launchers_bind():
    from tldsl.codegen.abi import SOURCES, KernelParam
    assert KernelParam("sig_x", "int*", "ptr", "signal:x").origin == ("signal", "x")
    assert KernelParam("launch", "unsigned long long", "u64", "launch").origin == ("launch", None)
    for bad in ("signal", "launch:3", "sgnal:x", ""):
        with pytest.raises(ValueError, match="sources are"):
            KernelParam("p", "int", "i32", bad)
    assert {"tma", "signal", "peer_signals", "peers", "buffer", "data", "scalar", "rank", "launch"} <= set(SOURCES)


#: codegen's stages in pipeline order; the shared modules and the toolchain come before every stage
STAGES = ("match", "plan", "rules", "recipes", "pipeline")
SHARED = ("abi", "dtypes", "errors", "ir_queries", "toolchain")
#: the one import against the order: the copy-engine plan describes its waits with the wait rule's formula
LATER_STAGE_IMPORTS = {("tldsl.codegen.plan.copy_engine", "tldsl.codegen.rules.primitives"),
                       ("tldsl.codegen.plan.copy_engine", "tldsl.codegen.rules")}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["tldsl", "codegen"] or len(parts) < 3:
        return None
    if parts[2] in SHARED:
        return -1
    return STAGES.index(parts[2]) if parts[2] in STAGES else None


def test_stages_import_no_later_stage():
    """Matching asks nothing of planning or rendering, planning nothing of the rules or the
    recipes, the rules nothing of the recipes; the shared modules and the toolchain no stage."""
    from test_import_layering import import_graph
    backwards = []
    for module, targets in import_graph().items():
        mine = _layer(module)
        if mine is None:
            continue
        for target, line in targets.items():
            theirs = _layer(target)
            if theirs is not None and theirs > mine and (module, target) not in LATER_STAGE_IMPORTS:
                backwards.append(f"{module} -> {target} (line {line})")
    assert not backwards, "codegen imports against the pipeline's order:\n" + "\n".join(backwards)


@tl.kernel
def _fixed_tile_gemm(a, b, c, *, compute: tl.ComputeSchedule = None, k_end: int = 0):
    """A GEMM whose tiles (128 x 128 x 64) and K loop are written out, not read from the schedule."""
    M, K = a.shape
    N = b.shape[1]

    @tl.compute_part(grid=(tl.cdiv(M, 128), tl.cdiv(N, 128)))
    def mm(pm, pn):
        acc = tl.fragment((128, 128), tl.float32)
        for k in tl.range(0, k_end or K, 64):
            acc += tl.dot(tl.load(a, (pm * 128, k), (128, 64)), tl.load(b, (k, pn * 128), (64, 128)))
        tl.store(c, (pm * 128, pn * 128), acc)


@pytest.mark.parametrize("tile,k_end,text", [
    ((128, 128, 32), 0, "tile shapes A (128, 64), B (64, 128), acc (128, 128) do not match the compute schedule's "
                        "tile (128, 128, 32)"),
    ((128, 128, 64), 128, "the K loop must be tl.range(0, 256, 64) (K of A/B, step BK), got (0, 128, 64)")])
def test_the_wgmma_planners_check_tiles_and_the_k_loop_at_the_users_line(tile, k_end, text):
    from tldsl.codegen import lower_gemm
    spec = tl.TensorSpec((256, 256), tl.float16)
    k = _fixed_tile_gemm.trace(1, spec, spec, spec, compute=tl.ComputeSchedule(tile=tile), k_end=k_end)
    with pytest.raises(LoweringError) as e:
        lower_gemm(k)
    assert f"GEMM lowering: {text}" in str(e.value) and e.value.loc.filename == __file__


def test_one_stage_over_several_k_steps_is_refused_by_the_wgmma_recipes_and_lowers_generally():
    """The WGMMA mainloops keep one K step's WGMMAs in flight and release its stage only after the
    next step's are issued: with one stage and more than one K step the producer would wait for
    that stage forever (a GPU hang). The GEMM and grouped GEMM planners refuse it at the user's
    line; lower() then takes the general lowering, and one K step (K = BK) stays on the recipe."""
    from test_codegen_host import trace_plain
    from test_codegen_moe import trace_ag
    from tldsl.codegen import lower_gemm, lower_grouped_gemm
    from tldsl.codegen.recipes.gemm import LoweredGemm
    from tldsl.codegen.recipes.general import LoweredGeneral
    k = trace_plain(K=256, stages=1)
    with pytest.raises(LoweringError, match=r"stages=1 with K=256 over BK=64: .* \(use stages >= 2\)"):
        lower_gemm(k)
    assert isinstance(lower(k, k.parts[0].name), LoweredGeneral)
    one_step = trace_plain(K=64, stages=1)
    assert isinstance(lower(one_step, one_step.parts[0].name), LoweredGemm)
    with pytest.raises(LoweringError, match="stages=1 with K=512 over BK=64"):
        lower_grouped_gemm(trace_ag(stages=1))
    assert lower_grouped_gemm(trace_ag(stages=2)).config.stages == 2


def test_an_option_the_chosen_recipe_does_not_take_is_refused_but_lower_all_shares_one_set():
    from test_codegen_host import trace_plain
    from tldsl.codegen import lower_all
    k = trace_plain()
    with pytest.raises(LoweringError, match="gemm recipe lowers part .* takes no option stages"):
        lower(k, k.parts[0].name, stages=2)                  # attention's option: it would change nothing
    assert set(lower_all(k, stages=2, wait_timeout_ns=10**9)) == {p.name for p in k.parts}


@tl.kernel
def _waits_after_its_k_loop(a, b, c, *, compute: tl.ComputeSchedule = None):
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile
    go, done = tl.signal("go", N // BN), tl.signal("done", N // BN)

    @tl.comm_part(grid=(N // BN,), name="feed")
    def feed(i):
        tl.consumer_tile_wait(done, i)
        tl.producer_tile_notify(go, i)

    @tl.compute_part(grid=(M // BM, N // BN))
    def gemm(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        with tl.when(pm >= 1):
            tl.consumer_tile_wait(go, pn)
        with tl.when(pm >= 0):
            tl.store(c, (pm * BM, pn * BN), acc)
        with tl.when(pm == 0):
            tl.producer_tile_notify(done, pn)


def test_a_wait_after_the_k_loop_is_never_dropped():
    """A tile program choosing per tile what to store, with C's store alone and a wait after the K
    loop: the GEMM template runs only notifies there (no generated epilogue), so its planner refuses
    the part rather than drop the wait; the general lowering runs it, wait included."""
    S, bf = tl.TensorSpec, tl.bfloat16
    k = _waits_after_its_k_loop.trace(1, S((256, 128), bf), S((128, 256), bf), S((256, 256), bf),
                                      compute=tl.ComputeSchedule(tile=(128, 128, 64)))
    with pytest.warns(tl.FallbackWarning, match="gemm recipe refused: GEMM lowering: a wait after the K loop"):
        lk = lower(k, "gemm")
    assert type(lk).__name__ == "LoweredGeneral" and re.search(r"cta_wait<[^>]*>\(sig_go", lk.source)
