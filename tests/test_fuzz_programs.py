"""The differential fuzzer's program generator and its command (issue 18, item 4): what the
generated programs cover, that the simulator accepts every one, that the source shown to a user
is the program, and that the command reports what it did."""
from __future__ import annotations

import copy
import io
import importlib.util
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import tldsl as tl
from tldsl.errors import SimulationError
from tldsl.ir.opdefs import WAIT_OPS
from tldsl.ir.part_graph import waited_signals
from tldsl.testing import strategies as tst
from tldsl.testing.fuzz import main as fuzz_main
from tldsl.testing.program_case import FuzzCase, features
from tldsl.testing.program_families import generate_distinct
from tldsl.testing.program_inputs import POISON, make_inputs, specs


@pytest.fixture(scope="module")
def five_hundred():
    """The first 500 programs of seed 0, with how many attempts it took to find them distinct."""
    programs = generate_distinct(500, seed=0)
    return programs, [FuzzCase(p, f"seed 0 program {i}") for i, p in programs]


def test_distribution_over_500_programs(five_hundred):
    _, cases = five_hundred
    feats = [features(c.trace()) for c in cases]

    def share(pred):
        return sum(map(pred, feats)) / len(feats)
    assert share(lambda f: f.dot) >= 0.30
    assert share(lambda f: f.range_loop) >= 0.30
    assert share(lambda f: f.linked_parts) >= 0.20
    assert share(lambda f: f.communicates) >= 0.20
    assert share(lambda f: f.ragged) >= 0.80                       # shapes not multiples of the tile
    assert share(lambda f: f.ordered_waits) >= 0.03                # the tile order a lowering must walk
    assert share(lambda f: f.waits_back) >= 0.015                  # parts waiting on each other: one slot each
    # a consumer of a row block's first columns waiting for fewer notifies than the block gets (the
    # producer notifying column by column, in order): the wait orders it after those notifies only
    rising = [c for c in cases if "count=tl.cdiv(tl.minimum(pn" in c.program.source()]
    assert len(rising) >= 2
    for dtype in ("f16", "bf16", "f32", "i32"):
        assert share(lambda f: dtype in f.dtypes) >= 0.10, dtype
    assert all(f.communicates <= (c.world_size >= 2) for f, c in zip(feats, cases))


def test_bf16_arguments_are_float32_arrays_of_bf16_values_and_run_as_bf16(five_hundred):
    """numpy has no bf16: a bf16 argument's input is float32 holding bf16 values (no torch needed),
    and the case runs the program traced from its arguments' description — bf16, not the
    arrays' float32 — in the simulator (as on the GPU: ``tl.run(case.trace(), ...)``)."""
    _, cases = five_hundred
    with_bf16 = [c for c in cases if any(a.dtype == "bf16" for a in c.program.args)]
    assert len(with_bf16) >= 100, len(with_bf16)
    for c in with_bf16[:6]:
        assert [b.type.dtype.name for b in c.trace().args] == [a.dtype for a in c.program.args]
        for r in range(c.world_size):
            for a in (a for a in c.program.args if a.dtype == "bf16"):
                x = c.inputs[r][a.name]
                assert type(x) is np.ndarray and x.dtype == np.float32
                assert np.array_equal(x.view(np.uint32) & np.uint32(0xFFFF), np.zeros(x.shape, np.uint32))
        assert [b.type.dtype.name for b in c.simulate().kernel.args] == [a.dtype for a in c.program.args]


def test_programs_are_distinct_and_rarely_repeat(five_hundred):
    programs, cases = five_hundred
    assert len({c.program.source() for c in cases}) == 500
    assert len({_strip_locations(c.trace()) for c in cases}) == 500      # distinct as traced, too
    assert programs[-1][0] < 525            # the generator itself seldom repeats a program


def test_a_sample_simulates_and_writes_every_output():
    for attempt, program in generate_distinct(30, seed=1):
        case = FuzzCase(program, f"seed 1 program {attempt}")
        result = case.simulate(seed=attempt)
        for r in range(case.world_size):
            for name in case.outputs:
                out = result[r][name]
                unwritten = out == POISON["i32"] if out.dtype == np.int32 else ~np.isfinite(out)
                assert not unwritten.any(), f"{case.label}: rank {r} '{name}' not all written\n{case.source}"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tst.tile_programs())
def test_the_strategy_gives_programs_the_simulator_accepts(case):
    case.simulate()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tst.tile_programs(families=["single"]))
def test_the_strategy_draws_from_the_families_asked_for(case):
    assert len(case.trace().parts) == 1 and not features(case.trace()).linked_parts


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tst.tile_programs(families=["grouped_gemm"]))
def test_the_strategy_draws_grouped_gemms_the_simulator_accepts(case):
    assert "tl.dot(" in case.program.source() and "tl.when(e >= 0)" in case.program.source()
    case.simulate()


def _family_lowered(family: str, n: int, part_of_interest, lowered_as: str | None = None,
                    else_because: str | None = None) -> list[tuple[FuzzCase, list]]:
    """``n`` programs of ``family`` (seed 7), each simulated, with its parts that
    ``part_of_interest(part)`` picks lowered as the pipeline chooses (fallback warnings silenced);
    with ``lowered_as`` (a lowered kernel's class name), each such part is that, or (with
    ``else_because``) was refused for that reason."""
    import warnings
    from tldsl.codegen import lower
    from tldsl.errors import FallbackWarning
    out = []
    for i, p in generate_distinct(n, 7, families=[family]):
        c = FuzzCase(p, f"{family} {i}")
        c.simulate()
        k = c.trace()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            lowered = [lower(k, q.name) for q in k.parts if part_of_interest(q)]
        for lk in lowered if lowered_as else ():
            assert type(lk).__name__ == lowered_as or (else_because is not None and else_because in str(lk.declined)), \
                (lk.declined, p.source())
        out.append((c, lowered))
    return out


def _recipe_dtypes(got, lowered_as: str) -> set[str]:
    """The dtypes of what the parts lowered as ``lowered_as`` compute on: a dot's operands, or
    (no dot) the rows a gather reads."""
    out = set()
    for c, lks in got:
        for lk in (lk for lk in lks if type(lk).__name__ == lowered_as):
            ops = list(c.trace().part(lk.part).walk())
            dots = [op for op in ops if op.name == "dot"]
            src = dots[0].operands[0] if dots else next(op for op in ops if op.name == "load_rows").operands[0]
            out.add(src.type.dtype.name)
    return out


def test_the_combine_family_gives_row_gather_combines_the_combine_recipe_lowers():
    """``--family combine``: row-gather combines (the MoE top-k combine's shape), alone or gathering
    a producer's workspace once it has notified, simulate, and every one lowers by the combine
    recipe — columns no multiple of 4 too, 1 or 2 a thread. (Compiled: the fresh programs' test
    below.)"""
    got = _family_lowered("combine", 24, lambda q: q.role == "compute" and any(op.name == "load_rows"
                                                                                for op in q.walk()),
                          "LoweredCombine")
    kinds = [type(lk).__name__ for _, lks in got for lk in lks]
    assert len(kinds) == 24 and kinds.count("LoweredCombine") == 24, kinds
    widths = {lk.vec for _, lks in got for lk in lks}
    assert {1, 4} <= widths or {2, 4} <= widths, widths
    cases = [c for c, _ in got]
    assert sum(len(c.trace().parts) > 1 for c in cases) >= 6          # some gather a producer's rows
    assert any("consumer_tile_wait" in c.program.source() and "tl.bfloat16" in c.program.source() for c in cases)
    assert {"f16", "bf16", "f32"} <= _recipe_dtypes(got, "LoweredCombine")


def test_the_scatter_family_adds_rows_by_the_general_lowering_and_the_grouped_gemm_recipe():
    """``--family scatter``: rows added into rows chosen at run time (``tl.add_rows``) simulate; the
    plain ones lower by the general recipe (atomic adds), the expert GEMMs adding their rows by the
    grouped GEMM recipe (held tiles added by vector reductions), never falling back."""
    got = _family_lowered("scatter", 20, lambda q: q.role == "compute")
    kinds = {}
    for c, lks in got:
        src = c.program.source()
        assert "tl.add_rows(" in src
        want = "LoweredGroupedGemm" if "tl.dot" in src else "LoweredGeneral"
        assert [type(lk).__name__ for lk in lks] == [want], (lks, src)
        kinds[want] = kinds.get(want, 0) + 1
        adds = ("kAddRows = true",) if "tl.dot" in src else ("tldsl::gen::add_to(", "tldsl::gen::add_pair(")
        assert any(a in lks[0].source for a in adds), src
    assert kinds.get("LoweredGroupedGemm", 0) >= 4 and kinds.get("LoweredGeneral", 0) >= 4, kinds


def test_the_grouped_gemm_family_gives_expert_gemms_the_grouped_gemm_recipe_lowers():
    """``--family grouped_gemm``: expert GEMMs over run-time tile tables (dense or gathered A,
    unused tiles, valid-row masks, the store inside or after the guard), alone or waiting for a
    producer's rows, simulate; most lower by the grouped GEMM recipe, the others (rows no multiple
    of 16 bytes) by the general one, with that reason."""
    got = _family_lowered("grouped_gemm", 24, lambda q: any(op.name == "load" and len(op.operands[0].type.shape) == 3
                                                            for op in q.walk()),
                          "LoweredGroupedGemm", "16-byte aligned rows")
    kinds = [type(lk).__name__ for _, lks in got for lk in lks]
    assert len(kinds) == 24 and kinds.count("LoweredGroupedGemm") >= 14, kinds
    cases = [c for c, _ in got]
    sources = [c.program.source() for c in cases]
    waiting = [c for c in cases if "consumer_tile_wait" in c.program.source()]
    assert len(waiting) >= 4                                              # waiting for a producer's rows
    assert any(c.trace().parts[-1].grid[0] > 1 for c in waiting)          # ... in several row tiles
    assert any("tl.load_rows" in s for s in sources) and any("tl.iota(" in s and "< n)" in s for s in sources)
    assert {"f16", "bf16"} <= _recipe_dtypes(got, "LoweredGroupedGemm")                  # operands of both types


def test_the_attention_family_gives_flash_attention_the_attention_recipe_lowers():
    """``--family attention``: flash-attention parts written as a user writes them (causal or not,
    key blocks skipped or masked, scaled or not, grouped-query heads, ragged queries and keys,
    keys and values from inputs or from a producer's workspaces, each key block waiting) simulate;
    the attention recipe lowers all but those whose drawn schedule asks for clusters (which it
    refuses, and the general recipe takes)."""
    got = _family_lowered("attention", 16, lambda q: any(op.name == "dot" for op in q.walk()))
    kv_heads, staged = [], 0
    for c, [lk] in got:
        clustered = "cluster=(2, 1)" in c.program.source()
        assert (type(lk).__name__ == "LoweredAttention") != clustered, c.program.source()
        attention = c.trace().parts[-1]
        staged += len(c.trace().parts) == 2 and not clustered                  # its key blocks waiting
        group = re.search(r"kc0 = h // (\d+) \*", c.program.source())
        kv_heads.append(attention.grid[0] // int(group.group(1)) if group else attention.grid[0])
    assert staged >= 3, staged
    sources = [c.program.source() for c, _ in got]
    assert any("q_pos" in s for s in sources) and any("q_pos" not in s for s in sources)
    assert any(n > 1 and "kc0 = h //" in s for n, s in zip(kv_heads, sources)), kv_heads   # GQA, several KV heads
    assert sum(type(lk).__name__ == "LoweredAttention" for _, [lk] in got) >= 10
    assert {"f16", "bf16"} <= _recipe_dtypes(got, "LoweredAttention")


def test_an_unknown_family_is_refused_with_the_choices():
    from tldsl.testing.program_families import generate
    from tldsl.testing.program_gen import RandomChooser
    from tldsl.testing.program_families import FAMILIES, FOCUSED
    with pytest.raises(ValueError, match=re.escape(f"no program family 'combines': choose among "
                                                   f"{sorted({**FAMILIES, **FOCUSED})}")):
        generate(RandomChooser("1:1"), ["combines"])


def test_the_default_mix_draws_a_combine_now_and_then(five_hundred):
    """About one program in fifty of the usual mix is a row-gather combine (the gather stage's
    other half), so every fuzzer run also compares a few on the GPU."""
    _, cases = five_hundred
    combines = [c for c in cases if re.search(r"acc\d* \+= .*tl\.load_rows", c.program.source())]
    assert 4 <= len(combines) <= 25, len(combines)


def _strip_locations(kernel) -> str:
    return re.sub(r"  // .*$", "", str(kernel), flags=re.M)


def test_inputs_are_multiples_of_1_64_or_any_value_and_the_fuzzer_alternates():
    """Exact inputs (multiples of 1/64: every product and short sum exact, so rounding once or
    twice agrees) for even-numbered programs, any value in [-1, 1] for odd ones, on which a kernel
    that rounds otherwise than the simulator (an FMA) shows — as the combine's did."""
    from tldsl.testing import fuzz
    from tldsl.testing.program_tree import Arg
    args = [Arg("x", (64, 64), dt, False, "input", -1.0, 1.0) for dt in ("f32", "f16", "bf16")]
    for exact in (True, False):
        for a, x in zip(args, make_inputs(args, 1, seed=3, exact=exact)[0].values()):
            v = np.asarray(x, np.float64)
            assert np.abs(v).max() <= 1.0 and (v * 64 == np.round(v * 64)).all() == exact, (a.dtype, exact)
    reports = fuzz.run(4, seed=5, compile_kernels=False, out=io.StringIO())
    assert [r.case.exact_inputs for r in reports] == [True, False, True, False]


def test_the_printed_source_is_the_program(tmp_path):
    """A failing case is shown as ``case.source``: written to a file and imported, it traces to
    the same IR and makes the same inputs (so it can become a regression test as it is)."""
    for attempt, program in generate_distinct(8, seed=2):
        exact = attempt % 2 == 0
        case = FuzzCase(program, f"seed 2 program {attempt}", input_seed=attempt, exact_inputs=exact)
        assert case.source.count(program.inputs_call(attempt, exact)) == 2          # the header and __main__
        path = tmp_path / f"program_{attempt}.py"
        path.write_text(case.source)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        inputs = make_inputs(module.ARGS, module.WORLD_SIZE, seed=attempt, exact=exact)
        traced = module.tile_program.trace(module.WORLD_SIZE, *specs(module.ARGS))
        assert _strip_locations(traced) == _strip_locations(case.trace())
        for mine, theirs in zip(inputs, case.inputs):
            assert mine.keys() == theirs.keys()
            assert all(np.array_equal(mine[k], theirs[k], equal_nan=True) for k in mine)


def test_the_signals_of_linked_programs_are_needed():
    """Delete every wait of a program whose parts are linked by signals: the simulator must then
    report the unordered accesses (the links are not decoration)."""
    linked = [FuzzCase(p, f"seed 3 program {i}") for i, p in generate_distinct(40, seed=3)]
    linked = [c for c in linked if features(c.trace()).linked_parts][:6]
    assert len(linked) == 6
    for case in linked:
        kernel = copy.deepcopy(case.trace())
        for part in kernel.parts:
            _drop_waits(part.body)
        with pytest.raises(SimulationError):
            tl.simulate(kernel, case.world_size, case.inputs, options={"static_checks": False})


def test_the_rising_counts_of_generated_waits_are_needed():
    """A consumer waiting for the producer's column tiles up to its own last column: one fewer
    (at least one) leaves a consumer of a later column tile reading what it did not wait for."""
    rising = [(i, p) for i, p in generate_distinct(500, seed=0)           # (a producer of 2+ column tiles)
              if "count=tl.cdiv(tl.minimum(pn" in p.source() and re.search(r"per_launch=([2-9]|\d\d)", p.source())]
    assert len(rising) >= 2
    for i, program in rising:
        text = re.sub(r"count=(tl\.cdiv\(tl\.minimum\(pn[^)]*\), \d+\))", r"count=tl.maximum(\1 - 1, 1)",
                      program.source())
        assert text != program.source()
        space: dict = {}
        exec(compile(text, f"<seed 0 program {i}, one fewer>", "exec"), space)     # noqa: S102 - our own source
        ws = space["WORLD_SIZE"]
        with pytest.raises(tl.RaceError):
            tl.simulate(space["tile_program"].trace(ws, *specs(space["ARGS"])), ws, make_inputs(space["ARGS"], ws),
                        seed=i)


def test_parts_generated_to_wait_on_each_other_run_on_one_slot_each():
    """A pipeline whose producer also waits for the consumer's tasks before its own row block: the
    simulator checks its compute parts on one slot (a communication part on its lanes), tiles in
    order (as a GPU giving each fewer CTAs than tiles runs them), and they finish with the results
    of every tile resident. Waiting instead for every consumer task — the last of which needs
    the producer's last row block — deadlocks there, and runs only with every tile resident:
    the case a GPU run on fewer CTAs hangs in."""
    from tldsl.ir.part_graph import parts_waiting_through_others
    checked = 0
    for i, program in generate_distinct(500, seed=0):
        case = FuzzCase(program, f"seed 0 program {i}")
        kernel = case.trace()
        looping = parts_waiting_through_others(kernel)
        if not looping:
            continue
        assert looping == [p.name for p in kernel.parts if p.role == "compute"], (looping, case.source)
        producer = next(p for p in kernel.parts if any(s.name.startswith("consumed") for s in waited_signals(p)))
        default = case.simulate(seed=i)                    # (checked on one slot, then run resident)
        one = case.simulate(seed=i, options=tl.SimOptions(compute_slots=1))
        for r in range(case.world_size):
            for name in case.outputs:
                np.testing.assert_array_equal(one[r][name], default[r][name])
        if producer.grid[0] < 2 or producer.role != "compute":    # (a comm part's lanes walk in order anyway)
            continue
        source = program.source()
        text = re.sub(r"tl\.minimum\(pm \* \d+ // \d+ \* \d+, 1\)", "1", source)
        text = re.sub(r"count=pm \* \d+ // \d+ \* \d+, per_launch=(\d+)", r"count=\1, per_launch=\1", text)
        assert text.count("count=") == source.count("count=") and text != source
        space: dict = {}
        exec(compile(text, f"<seed 0 program {i}, every consumer task>", "exec"), space)  # noqa: S102 - our source
        ws, inputs = space["WORLD_SIZE"], make_inputs(space["ARGS"], space["WORLD_SIZE"])
        traced = space["tile_program"].trace(ws, *specs(space["ARGS"]))
        with pytest.raises(tl.DeadlockError, match="ran on 1 slot"):
            tl.simulate(traced, ws, inputs, seed=i)
        tl.simulate(traced, ws, inputs, seed=i, options=tl.SimOptions(compute_slots=10**6))
        checked += 1
    assert checked >= 4


def _drop_waits(block):
    block.ops[:] = [op for op in block.ops if op.name not in WAIT_OPS]
    for op in block.ops:
        for region in op.regions:
            _drop_waits(region)


def test_an_fp32_dot_is_compared_as_tf32():
    """Generated programs with an fp32 dot: the GPU's TF32 products (modelled, with other
    summation orders) are accepted. (The generator's inputs have few bits, often exact in TF32:
    test_tolerances checks the TF32 term itself.)"""
    from tldsl.testing.program_tolerance import simulate_like_gpu
    checked = 0
    for attempt, program in generate_distinct(60, seed=4):
        case = FuzzCase(program, f"seed 4 program {attempt}")
        if not any(op.name == "dot" and op.operands[0].type.dtype == tl.float32 for _, op in case.trace().walk()):
            continue
        ref = case.reference()[0]
        got = simulate_like_gpu(case.trace(), case.world_size, case.inputs)
        assert not case.mismatches(ref.outputs, got.outputs), case.source
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_the_command_reports_every_program_and_a_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(tmp_path))
    status = fuzz_main(["--programs", "3", "--seed", "7"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "seed 7"
    rows = [ln for ln in lines if re.match(r"#\d{4} W=\d parts=\d+ \[", ln)]
    assert len(rows) == 3 and all("simulated ok" in r and "gpu: not asked" in r for r in rows), out
    assert re.search(r"^3 programs: 3 simulated ok, 0 failed in the simulator; \d+ parts: \d+ lowered", out, re.M)
    assert re.search(r"^distribution: \d+% a dot, \d+% a tl\.range loop, \d+% parts linked by signals", out, re.M)
    assert re.search(r"^general lowering paths: \d+ programs with tiles in registers, \d+ programs fetching", out, re.M)
    failed = any(w in out for w in ("FAILED", "CRASHED", "MISMATCH"))
    assert status == (1 if failed else 0), out


def test_the_command_through_the_cli(capsys):
    from tldsl.cli.main import main
    status = main(["fuzz", "--programs", "1", "--seed", "7", "--only", "2", "--no-compile", "--show-source"])
    out = capsys.readouterr().out
    assert "#0002 " in out and "@tl.kernel" in out and "not compiled (--no-compile)" in out
    assert status == (1 if "CRASHED" in out else 0), out


@pytest.mark.parametrize("which", ["200:1217", "100:144"])
def test_programs_that_once_broke_the_generator(which):
    """Both stored a float alternative (under tl.when) into an i32 output."""
    from tldsl.testing.program_families import generate
    from tldsl.testing.program_gen import RandomChooser
    FuzzCase(generate(RandomChooser(which)), f"program {which}").simulate()


def test_the_gpu_comparison_finds_a_wrong_result(monkeypatch, capsys):
    """The --gpu path with a stand-in for tl.run (none exists here): the simulator's own outputs
    agree; outputs off by one are mismatches, and the exit status says so."""
    import tldsl.testing.fuzz as fuzz
    monkeypatch.setattr(fuzz, "gpu_unavailable", lambda: None)

    def run_with(shift):
        def fake_run(kernel, world_size, inputs, timeout_s=None, sms=None):
            result = tl.simulate(kernel, world_size, inputs)
            for outputs in result.outputs:
                for name in outputs:
                    if name.startswith("y"):
                        outputs[name] = outputs[name] + shift
            return result
        monkeypatch.setattr(tl, "run", fake_run, raising=False)
        status = fuzz.main(["--programs", "2", "--seed", "5", "--gpu", "--no-compile"])
        return status, capsys.readouterr().out

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    status, out = run_with(0)
    assert out.count("gpu: agrees") == 2 and "2 compared on the GPU, 0 mismatches" in out
    import os
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"     # every rank's streams get their own queue
    assert status == (1 if "CRASHED" in out else 0), out
    status, out = run_with(1)
    assert out.count("gpu: MISMATCH") == 2 and "2 mismatches" in out and status == 1
    # each failing program says how to run it again alone, and that command gives the same program
    replays = re.findall(r"^replay: python -m tldsl\.testing\.fuzz (.*)$", out, flags=re.M)
    assert len(replays) == 2 and all(r.startswith("--seed 5 --only ") and r.endswith(" --gpu") for r in replays)
    first = int(replays[0].split()[3])
    fuzz.main(replays[0].split() + ["--no-compile"])             # (tl.run's stand-in still off by one)
    again = capsys.readouterr().out
    assert again.count("gpu: MISMATCH") == 1 and f"#{first:04d} " in again
    assert fuzz.replay_command(7, 3, ["grouped_gemm"], gpu=True, sms=2, sass=True) == \
        "python -m tldsl.testing.fuzz --seed 7 --family grouped_gemm --only 3 --gpu --sms 2 --sass"


def test_a_programs_line_names_the_sms_it_ran_on(monkeypatch, capsys):
    """``--sms N``: each compared program's line says it ran on N SMs (a stand-in for tl.run that
    returns no launch plan, so no CTA is known to walk several tiles)."""
    import tldsl.testing.fuzz as fuzz
    monkeypatch.setattr(fuzz, "gpu_unavailable", lambda: None)
    asked = []

    def fake_run(kernel, world_size, inputs, timeout_s=None, sms=None):
        asked.append(sms)
        return tl.simulate(kernel, world_size, inputs)
    monkeypatch.setattr(tl, "run", fake_run, raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    fuzz.main(["--programs", "2", "--seed", "5", "--gpu", "--no-compile", "--sms", "2"])
    out = capsys.readouterr().out
    assert asked == [2, 2] and out.count("gpu on 2 SMs: agrees") == 2, out
    assert "CTAs walking several tiles" not in out.split("programs:")[0], out


def test_a_gpu_fault_stops_the_comparisons_instead_of_failing_every_later_program(monkeypatch, capsys):
    """A kernel that faults leaves the process's CUDA context unusable (sticky errors): the
    programs after it are reported as not compared, with the program that lost the context,
    rather than as mismatches of their own."""
    import tldsl.testing.fuzz as fuzz
    from tldsl.runtime.gpu.run_errors import GpuRunError
    monkeypatch.setattr(fuzz, "gpu_unavailable", lambda: None)

    def faulting_run(kernel, world_size, inputs, timeout_s=None, sms=None):
        raise GpuRunError("launch 1 failed on the GPU (CUDA_ERROR_ILLEGAL_ADDRESS)")
    monkeypatch.setattr(tl, "run", faulting_run, raising=False)
    status = fuzz.main(["--programs", "3", "--seed", "5", "--gpu", "--no-compile"])
    out = capsys.readouterr().out
    assert status == 1 and out.count("gpu: MISMATCH: tl.run raised GpuRunError") == 1
    assert out.count("not compared: the CUDA context was lost at program #0000") == 2
    assert "GPU comparisons stopped at program #0000" in out and "2 later program(s) were not compared" in out


def test_fifty_fresh_programs_simulate_lower_and_compile(tmp_path, monkeypatch, capsys):
    """Issue 18's CI check: 50 programs the fuzzer has not shown before — a new seed every day
    (``TLDSL_FUZZ_SEED`` replays one) — simulate, lower every part (no "no lowering recognises")
    and compile with NVRTC, with nothing crashing; every kernel with a dot shows each dot on the
    tensor cores in its SASS and no trap (``--sass``). The seed is in the report of a failure."""
    import datetime
    import os
    from tldsl.codegen import toolchain as tcm
    ok, why = tcm.toolchain_available()
    if not ok:
        pytest.skip(f"CUDA wheels missing (NVRTC compile tests): {why}")
    seed = int(os.environ.get("TLDSL_FUZZ_SEED") or datetime.date.today().strftime("%Y%m%d"))
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(tmp_path))
    sass = tcm.find_toolchain().cuobjdump is not None      # (the [cpu] extra installs it)
    status = fuzz_main(["--programs", "50", "--seed", str(seed)] + (["--sass"] if sass else []))
    out = capsys.readouterr().out
    summary = next(ln for ln in out.splitlines() if ln.startswith("50 programs:"))
    assert status == 0 and "0 failed in the simulator" in summary and ", 0 not lowered yet" in summary, \
        f"seed {seed} (TLDSL_FUZZ_SEED={seed} replays it):\n{out[-6000:]}"
    assert re.search(r"(\d+)/\1 kernels compiled", summary), summary
    assert "0 general-lowering kernel(s) spilling registers" in summary, summary    # item 3: no spills
    # issue 18 item 3, on each fresh program: every dot on the tensor cores, no trap
    checked = re.search(r"(\d+) with dots checked in SASS, 0 wrong", summary)
    assert not sass or (checked and int(checked.group(1)) > 0), summary


@pytest.mark.parametrize("family", ["combine", "grouped_gemm", "attention"])
def test_fresh_programs_of_each_recipe_family_simulate_lower_and_compile(family, tmp_path, monkeypatch, capsys):
    """The same check on 8 fresh programs of each recipe's family a day (``TLDSL_FUZZ_SEED``
    replays a seed): the default mix draws a combine about twice in a hundred programs and never
    a grouped GEMM or an attention part."""
    import datetime
    import os
    from tldsl.codegen import toolchain as tcm
    ok, why = tcm.toolchain_available()
    if not ok:
        pytest.skip(f"CUDA wheels missing (NVRTC compile tests): {why}")
    seed = int(os.environ.get("TLDSL_FUZZ_SEED") or datetime.date.today().strftime("%Y%m%d"))
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(tmp_path))
    status = fuzz_main(["--programs", "8", "--seed", str(seed), "--family", family])
    out = capsys.readouterr().out
    summary = next(ln for ln in out.splitlines() if ln.startswith("8 programs:"))
    assert status == 0 and "0 failed in the simulator" in summary and ", 0 not lowered yet" in summary, \
        f"seed {seed} --family {family} (TLDSL_FUZZ_SEED={seed} replays it):\n{out[-6000:]}"
    assert re.search(r"(\d+)/\1 kernels compiled", summary), summary
    assert re.search(rf"parts lowered by recipe: .*{family} [1-9]", out), out


def test_the_sass_check_names_a_dot_off_the_tensor_cores_and_a_trap():
    """``--sass``'s check on a kernel whose listing has a scalar loop where its two dots should be
    (one on WGMMA, one on mma.sync) and a trap; a trap is allowed where the waits time out."""
    from types import SimpleNamespace
    from tldsl.codegen.toolchain.sass import KernelSass
    from tldsl.testing.fuzz import check_sass
    listing = KernelSass("k", ["FFMA", "FFMA", "BPT.TRAP", "EXIT"])
    compiled = SimpleNamespace(name="k", sass=lambda: {"k": listing})
    lowered = SimpleNamespace(dots=2, wgmma_dots=1)
    problems = check_sass(lowered, compiled)
    assert problems == ["k: 0 HGMMA instruction(s) for 1 dot(s) lowered onto them",
                        "k: 0 HMMA instruction(s) for 1 dot(s) lowered onto them", "1 BPT.TRAP"]
    assert check_sass(lowered, compiled, traps_allowed=True) == problems[:2]
    good = KernelSass("k", ["HGMMA.64x64x16.F32", "HMMA.16816.F32", "EXIT"])
    assert check_sass(lowered, SimpleNamespace(name="k", sass=lambda: {"k": good})) == []


def test_a_general_kernel_that_spills_is_reported():
    """Issue 18 item 3: a general-lowering kernel spilling registers fails the program (ptxas's
    report); other recipes' kernels, and general ones that spill nothing, pass."""
    from types import SimpleNamespace
    from tldsl.codegen import lower
    from tldsl.testing.fuzz import general_spills
    from programs import scale_rows
    lk = lower(scale_rows.trace(1, tl.TensorSpec((64, 64), tl.float32), tl.TensorSpec((64, 64), tl.float32),
                                compute=tl.ComputeSchedule(tile=(16, 64, 16))), "part")

    def compiled(stores, loads):
        return SimpleNamespace(name="k", ptxas_info=lambda: {"k": {"spill_store_bytes": stores,
                                                                 "spill_load_bytes": loads}})
    assert general_spills(lk, compiled(208, 196)) == "208 B spill stores, 196 B spill loads"
    assert general_spills(lk, compiled(0, 0)) is None
    assert general_spills(SimpleNamespace(), compiled(208, 196)) is None


def test_sass_without_cuobjdump_is_refused_in_one_line(monkeypatch, capsys):
    from types import SimpleNamespace
    from tldsl.codegen import toolchain
    monkeypatch.setattr(toolchain, "find_toolchain", lambda: SimpleNamespace(cuobjdump=None))
    with pytest.raises(SystemExit):
        fuzz_main(["--programs", "1", "--seed", "1", "--sass"])
    assert "--sass needs cuobjdump: pip install nvidia-cuda-cuobjdump" in capsys.readouterr().err


def test_the_programs_reach_the_general_lowerings_paths(five_hundred):
    """Of the 500 programs, a share lowers to kernels that hold tiles in registers, that fetch
    the next task's tiles early, that run a pipelined dot loop and that run several tasks a CTA
    — so a GPU run of the fuzzer checks those paths against the simulator (the summary's last
    line counts them)."""
    from tldsl.codegen import LoweringError, lower
    from tldsl.testing.fuzz import LOWERING_PATHS
    _, cases = five_hundred
    counts = dict.fromkeys([what for what, _ in LOWERING_PATHS], 0)
    for c in cases:
        k = c.trace()
        lks = []
        for p in k.parts:
            try:
                lks.append(lower(k, p.name))
            except LoweringError:
                pass
        for what, how in LOWERING_PATHS:
            counts[what] += any(how(lk) for lk in lks)
    assert counts["with tiles in registers"] >= 100, counts
    assert counts["fetching the next task's tiles early"] >= 15, counts
    assert counts["with a pipelined dot loop"] >= 10, counts
    assert counts["with task groups"] >= 50, counts


def test_a_kernel_whose_log_has_no_ptxas_report_is_counted_unchecked_not_a_crash(monkeypatch, capsys):
    """Spills are read from ptxas -v in the NVRTC log: a log without the kernel's report (an NVRTC
    that left them out) raises NoPtxasReport, and the fuzzer counts the kernel as not checked
    rather than ending the run with a KeyError or calling it clean."""
    from types import SimpleNamespace
    import tldsl.testing.fuzz as fuzz
    from tldsl.codegen import lower
    lk = next(lk for _, p in generate_distinct(10, seed=11) for case in [FuzzCase(p, "seed 11")]
              for part in case.trace().parts for lk in [lower(case.trace(), part.name)]
              if type(lk).__name__ == "LoweredGeneral")
    compiled = SimpleNamespace(name=lk.entry, log="ptxas info    : 0 bytes gmem\n", ptxas_info=lambda: {})
    with pytest.raises(fuzz.NoPtxasReport, match=f"ptxas -v reported nothing for {lk.entry}"):
        fuzz.general_spills(lk, compiled)
    real = fuzz.general_spills
    monkeypatch.setattr(fuzz, "general_spills", lambda lk, c: real(lk, SimpleNamespace(
        name=c.name, log="", ptxas_info=lambda: {})))
    assert fuzz.main(["--programs", "2", "--seed", "11"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"0 general-lowering kernel\(s\) spilling registers \([1-9]\d* not checked: no ptxas report "
                     r"in their NVRTC log\)", out), out
    assert "spills not checked (no ptxas report): stage0" in out, out


def test_asking_for_the_gpu_comparison_without_a_gpu_fails_in_one_line(monkeypatch, capsys):
    """``--gpu`` where nothing can be compared is exit status 2 before any program runs — not a
    green run with every program 'not compared'."""
    import tldsl.testing.fuzz as fuzz
    monkeypatch.setattr(fuzz, "gpu_unavailable", lambda: "no CUDA device")
    with pytest.raises(SystemExit) as done:
        fuzz.main(["--programs", "2", "--seed", "5", "--gpu", "--no-compile"])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().endswith("--gpu compares on a GPU, but no CUDA device here (drop --gpu to "
                                              "simulate, lower and compile only)")
