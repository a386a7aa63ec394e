"""``python -m tldsl.bench probe moe_power``'s host side: nvidia-smi's samples read and summarised,
its arguments refused before anything runs (the probe itself needs a GPU: tests/test_gpu_bench_moe.py)."""
from __future__ import annotations

import pytest

from tldsl.bench import moe_power, probes

SMI = """1980, 120.51, Not Active
1755, 690.10, Active
1395, 693.44, Active
[N/A], 650.00, Active
1410, 692.00, Active
1350, 691.20, Active
1290, 694.00, Active
1500, 689.00, Active
1980, 300.00, Not Active
garbage line
"""


def test_samples_are_read_and_unreadable_lines_skipped():
    samples = moe_power.parse_samples(SMI)
    assert len(samples) == 8 and samples[0] == moe_power.Sample(1980.0, 120.51, False)
    assert [s.capped for s in samples].count(True) == 6


def test_the_summary_drops_the_ramps_and_takes_medians():
    s = moe_power.summarize(moe_power.parse_samples(SMI))
    # 8 samples less 4 at the start and 2 at the end: 1350, 1290
    assert s == moe_power.PowerSummary(samples=2, sm_mhz_median=1320.0, sm_mhz_min=1290.0, watts_median=692.6,
                                       capped=2)
    assert s.cells() == ["1320 (1290)", "693", "2 / 2"]
    assert moe_power.summarize(moe_power.parse_samples(SMI)[:6]) is None


@pytest.mark.parametrize("argv, says", [(["moe_power", "--seconds", "0"], "--seconds must be positive"),
                                        (["moe_power", "--rows", "mixtral:32768:randm"], "randm")])
def test_bad_arguments_are_refused_before_anything_runs(argv, says, capsys):
    with pytest.raises(SystemExit):
        probes.main(argv)
    assert says in capsys.readouterr().err
