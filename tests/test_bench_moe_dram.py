"""``python -m tldsl.bench probe moe_dram``: the pair's bytes split into reads and writes, the passes'
times scaled to them and tabled (no GPU needed), its rows' defaults and refusals, and, on a GPU,
one small row end to end."""
from __future__ import annotations

import io

import pytest

from tldsl.bench import moe, moe_dram, probes
from tldsl.runtime.gpu import gpu_available


def _deepseek_bufs():
    import torch
    meta = dict(device="meta", dtype=torch.bfloat16)
    return {"w2": torch.empty(64, 704, 2048, **meta), "h": torch.empty(51136, 704, **meta),
            "y_sorted": torch.empty(51136, 2048, **meta), "partial": torch.empty(8192, 2048, **meta)}


def test_the_pairs_bytes_split_into_what_it_reads_and_what_it_writes():
    """DeepSeek-MoE's layer 1 at 8192 tokens (49,152 routed rows in a layout of 51,136): read, the
    weights, ``h``'s routed rows and ``y_sorted``'s read back; written, those rows and the partial."""
    bufs, routed = _deepseek_bufs(), 8192 * 6
    reads, writes = moe.pair_dram_split(bufs, routed)
    assert reads == 2 * (64 * 704 * 2048 + routed * 704 + routed * 2048)
    assert writes == 2 * (routed * 2048 + 8192 * 2048)
    assert reads + writes == moe.pair_dram_bytes(bufs, routed)
    assert (round(reads / 1e6), round(writes / 1e6)) == (455, 235)
    assert moe_dram.mixed_fold(reads, writes) == 2
    assert moe.pair_dram_split(bufs, routed, experts_used=2) == (reads - 2 * 62 * 704 * 2048, writes)


@pytest.mark.parametrize("reads, writes, fold", [(520, 302, 2), (839, 201, 4), (562, 50, 11), (10, 300, 1)])
def test_the_mixed_pass_reads_the_pairs_rows_a_row_written_rounded(reads, writes, fold):
    assert moe_dram.mixed_fold(reads, writes) == fold


@pytest.mark.parametrize("reads, writes", [(0, 10), (10, 0), (-1, 5)])
def test_a_pair_that_moves_nothing_one_way_is_refused(reads, writes):
    with pytest.raises(ValueError, match="must read and write bytes"):
        moe_dram.mixed_fold(reads, writes)


def test_the_passes_are_scaled_to_the_pairs_bytes_and_tabled():
    """600 MB read, 200 MB written: the mixed pass reads 3 rows a row written (800 MB in all, the
    pair's bytes, so unscaled); the read and write passes add; ratios are the pass over the pair,
    the pass over ``_grouped_mm``."""
    reads, writes = 600_000_000, 200_000_000
    t = dict(pair=0.4, gmm=0.3, copy=0.3, read=0.2, write=0.08, mixed=0.26)
    bound = moe_dram.pass_times(t, reads, writes)
    assert bound == pytest.approx({"copy": 0.3, "read, then write": 0.28, "mixed": 0.26})
    row = moe_dram.table_row("qwen3 8192 random", reads, writes, t)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert row.count("|") == moe_dram.HEADER.count("|") == moe_dram.RULE.count("|")
    assert cells == ["qwen3 8192 random", "600", "200", "3", "0.400", "0.300", "0.300", "0.200", "0.080", "0.260",
                     "2.67, 3.00, 2.50, 3.08", "0.75, 0.70, 0.65", "1.00, 0.93, 0.87"]


def test_a_mixed_pass_moving_other_bytes_than_the_pair_is_scaled_to_them():
    """520 MB read, 302 MB written (Qwen3-30B): the mixed pass reads 2 rows a row written, 906 MB in
    all, so its time counts for 822 / 906 of the pair's."""
    reads, writes = 520_000_000, 302_000_000
    bound = moe_dram.pass_times(dict(copy=1.0, read=1.0, write=1.0, mixed=0.906), reads, writes)
    assert bound["mixed"] == pytest.approx(0.822)


def test_the_probe_defaults_to_the_small_expert_rows(monkeypatch):
    got = {}
    monkeypatch.setattr(moe_dram, "probe_moe_dram", lambda rows, **kw: got.update(rows=rows, **kw))
    assert probes.main(["moe_dram"]) == 0
    assert [r.model for r in got["rows"]] == ["qwen3", "deepseek", "qwen15"] and "iters" not in got
    probes.main(["moe_dram", "--rows", "mixtral:2048:zipf", "--iters", "4"])
    assert [(r.model, r.tokens, r.routing) for r in got["rows"]] == [("mixtral", 2048, "zipf")] and got["iters"] == 4


def test_a_bad_row_is_refused_in_one_line_before_anything_runs(monkeypatch, capsys):
    got = {}
    monkeypatch.setattr(moe_dram, "probe_moe_dram", lambda rows, **kw: got.update(rows=rows))
    with pytest.raises(SystemExit):
        probes.main(["moe_dram", "--rows", "qwen3:8192:random,qwen3:8192:skewed"])
    err = capsys.readouterr().err
    assert "'qwen3:8192:skewed'" in err and "Traceback" not in err
    assert got == {}


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")
def test_the_probe_checks_and_times_one_small_row():
    from tldsl.bench.baselines import _parse_row
    out = io.StringIO()
    moe_dram.probe_moe_dram([_parse_row("mixtral:2048:random")], iters=2, out=out)
    header, rule, row = out.getvalue().strip().splitlines()
    assert header == moe_dram.HEADER and rule == moe_dram.RULE and row.count("|") == header.count("|")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "mixtral 2048 random" and cells[3] == "11"        # 562 MB read, 50 MB written
    assert all(float(v) > 0 for v in cells[4:10])
    copy, read, write, mixed = (float(v) for v in cells[10].split(","))
    # TB/s: an H100's or H200's DRAM for the passes of 560-610 MB; the write pass's 50 MB may sit in L2
    assert all(0.5 < r < 6 for r in (copy, read, mixed)) and write > 0.5, cells[10]
