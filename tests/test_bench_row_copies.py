"""``python -m tldsl.bench probe moe_row_copies``: the copies it hands ``cuMemcpyBatchAsync`` gather
exactly ``index_select``'s rows (checked on bytes, no GPU needed), its rows' defaults and refusals,
and, on a GPU, one small row end to end."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tldsl.bench import moe_probes, probes
from tldsl.bench.moe_probes import ROW_COPY_VARIANTS, row_copy_lists
from tldsl.runtime.gpu import gpu_available


def _apply(copies, memory: np.ndarray) -> None:
    for dst, src, n in zip(*copies):
        memory[dst:dst + n] = memory[src:src + n]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_row_copies_gather_what_index_select_gathers(data):
    T = data.draw(st.integers(1, 12), label="source rows")
    row_bytes = data.draw(st.sampled_from([2, 6, 16, 64]), label="bytes a row")
    ids = data.draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=30), label="token ids")
    src = np.random.default_rng(T * 131 + len(ids)).integers(0, 256, (T, row_bytes), dtype=np.uint8)
    base = 7                              # both tensors somewhere inside one address space
    memory = np.full(base + src.size + len(ids) * row_bytes, 0xEE, dtype=np.uint8)      # poisoned destination
    memory[base:base + src.size] = src.reshape(-1)
    dst_ptr = base + src.size
    _apply(row_copy_lists(dst_ptr, base, ids, row_bytes), memory)
    got = memory[dst_ptr:].reshape(len(ids), row_bytes)
    np.testing.assert_array_equal(got, src[ids])
    np.testing.assert_array_equal(memory[base:base + src.size].reshape(T, row_bytes), src)   # the source untouched


def test_a_padding_row_id_is_refused_not_copied():
    with pytest.raises(ValueError, match="row id < 0"):
        row_copy_lists(1 << 20, 0, [0, -1, 2], 16)


def _captured(monkeypatch, name):
    got = {}
    monkeypatch.setattr(moe_probes, name, lambda rows, **kw: got.update(rows=rows, **kw))
    return got


def test_the_probe_defaults_to_the_rows_staged_before_their_gemm(monkeypatch):
    got = _captured(monkeypatch, "probe_moe_row_copies")
    assert probes.main(["moe_row_copies"]) == 0
    assert [(r.model, r.tokens, r.routing) for r in got["rows"]] == [("mixtral", 32768, "random"),
                                                                      ("stress", 8192, "random")]
    assert "iters" not in got               # the probe's own default
    probes.main(["moe_row_copies", "--rows", "deepseek:8192:zipf", "--iters", "3"])
    assert [(r.model, r.tokens, r.routing) for r in got["rows"]] == [("deepseek", 8192, "zipf")]
    assert got["iters"] == 3


def test_the_notify_probe_keeps_the_small_expert_rows(monkeypatch):
    got = _captured(monkeypatch, "probe_moe_notifies")
    probes.main(["moe_notifies"])
    assert [r.model for r in got["rows"]] == ["qwen3", "deepseek", "qwen15"]


@pytest.mark.parametrize("probe, runs", [("moe_row_copies", "probe_moe_row_copies"),
                                         ("moe_notifies", "probe_moe_notifies"),
                                         ("moe_schedules", "probe_moe_schedules")])
def test_a_bad_row_is_refused_in_one_line_before_anything_runs(monkeypatch, capsys, probe, runs):
    got = _captured(monkeypatch, runs)
    with pytest.raises(SystemExit):
        probes.main([probe, "--rows", "mixtral:8192:random,mixtral:lots:random"])
    err = capsys.readouterr().err
    assert "a row is MODEL:TOKENS:ROUTING" in err and "'mixtral:lots:random'" in err and "Traceback" not in err
    assert got == {}


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")
def test_the_probe_checks_and_times_one_small_row():
    import io
    from tldsl.bench.baselines import _parse_row
    out = io.StringIO()
    moe_probes.probe_moe_row_copies([_parse_row("mixtral:512:random")], iters=1, out=out)
    header, rule, row = out.getvalue().strip().splitlines()
    assert header.count("|") == rule.count("|") == row.count("|") == len(ROW_COPY_VARIANTS) + 5
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "mixtral 512 random" and int(cells[1]) == 1024
    assert all(float(v) > 0 for v in cells[4:])
