"""``python -m tldsl.bench probe moe_schedules``: its schedule syntax, the kernels it lowers for each
schedule (no GPU needed), and that it is gated as a one-GPU probe."""
from __future__ import annotations

import argparse
import re

import pytest

from tldsl.bench import probes
from tldsl.bench.baselines import _parse_row
from tldsl.bench.moe_probes import DEFAULT_SCHEDULES, Schedule, parse_schedules, schedule_kernels
from tldsl.cli import gates


def test_schedules_parse_with_cluster_two_unless_given():
    assert parse_schedules("128x256x64:4,128x128x64:6:1") == [Schedule((128, 256, 64), 4, 2),
                                                              Schedule((128, 128, 64), 6, 1)]
    assert [str(s) for s in parse_schedules(DEFAULT_SCHEDULES)] == DEFAULT_SCHEDULES.split(",")
    assert str(Schedule((128, 128, 64), 6, 1)) == "128x128x64:6:1"


def test_a_schedule_may_give_its_group_m_after_its_cluster():
    got = parse_schedules("128x256x64:4:2:16,128x256x64:4:1:4,128x256x64:4")
    assert got == [Schedule((128, 256, 64), 4, 2, 16), Schedule((128, 256, 64), 4, 1, 4), Schedule((128, 256, 64), 4)]
    assert [str(s) for s in got] == ["128x256x64:4:2:16", "128x256x64:4:1:4", "128x256x64:4"]
    assert parse_schedules(",".join(map(str, got))) == got


@pytest.mark.parametrize("text, names", [
    ("128x256:4", "'128x256:4'"),                       # two dimensions
    ("128x256x64", "'128x256x64'"),                     # no stages
    ("128x256x64:four", "'128x256x64:four'"),
    ("128x256x64:4:3", "a cluster of 1 or 2"),
    ("128x256x64:4:2:0", "a group of 1 to 65536 cluster tiles"),
    ("128x256x64:4:2:99999999999", "a group of 1 to 65536 cluster tiles"),
    ("128x256x64:4:2:8:1", "'128x256x64:4:2:8:1'"),    # a fifth field
    ("128x256x64:4,128x256x64:4", "given twice"),
])
def test_bad_schedules_are_refused_naming_the_item(text, names):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(names)):
        parse_schedules(text)


def test_the_cli_refuses_a_bad_schedule_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        probes.main(["moe_schedules", "--schedules", "128x256x64:4,64x64"])
    assert "--schedules: BMxBNxBK:STAGES[:CLUSTER[:GROUP_M]]" in capsys.readouterr().err


@pytest.mark.parametrize("layer, entry", [("ag", "allgather_moe"), ("rs", "moe_reduce_scatter")])
def test_each_schedule_lowers_its_own_grouped_gemm(layer, entry):
    row = _parse_row("qwen15:2048:random")
    kernels = schedule_kernels(row, parse_schedules("128x256x64:4,128x256x64:3:1,128x128x64:6"), layer)
    assert [str(sc) for sc, *_ in kernels] == ["128x256x64:4", "128x256x64:3:1", "128x128x64:6"]
    got = []
    for sc, ids, rt, lg in kernels:
        assert entry in lg.entry and ids.shape == (2048, 4)
        assert rt.num_rows % sc.tile[0] == 0
        bm, bn, bk = (int(v) for v in re.search(r"int BM = (\d+), BN = (\d+), BK = (\d+);", lg.source).groups())
        stages = int(re.search(r"int kStages = (\d+)", lg.source).group(1))
        got.append(((bm, bn, bk), stages, lg.cluster_dims[0]))
        # ag: the rows gathered inside the grouped GEMM (what the probe measures), never staged first
        assert ("kGather = true" in lg.source) == (layer == "ag")
    assert got == [((128, 256, 64), 4, 2), ((128, 256, 64), 3, 1), ((128, 128, 64), 6, 2)]


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_each_schedules_group_m_reaches_its_kernel(layer):
    """The tile order's group (a group's rows of the swizzled order, in cluster tiles) is the
    schedule's, or the default's 8 where it gives none."""
    row = _parse_row("qwen15:2048:random")
    kernels = schedule_kernels(row, parse_schedules("128x256x64:4:2:16,128x256x64:4:1:2,128x256x64:4"), layer)
    assert [lg.config.group_m for *_, lg in kernels] == [16, 2, 8]
    assert [int(re.search(r"kGroupM = (\d+)", lg.source).group(1)) for *_, lg in kernels] == [16, 2, 8]


@pytest.mark.parametrize("layer", ["ag", "rs"])
@pytest.mark.parametrize("text, why", [
    ("128x256x64:1", "second stage"),           # the grouped GEMM recipe's refusal (the general lowering would take it)
    ("128x192x64:4", "powers of two"),          # the schedule's own check
])
def test_a_schedule_the_recipe_refuses_names_itself(layer, text, why):
    with pytest.raises(ValueError, match=rf"^schedule {re.escape(text)} \({layer}, qwen15:2048:random\): .*{why}"):
        schedule_kernels(_parse_row("qwen15:2048:random"), parse_schedules(text), layer)


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_two_spellings_of_one_kernel_are_refused(layer):
    """The default group (8 cluster tiles) and cluster (2) spelled out: the same kernel as without
    them, which the probe would otherwise time twice under two names."""
    with pytest.raises(ValueError, match=rf"^schedules 128x256x64:4 and 128x256x64:4:2:8 \({layer}, "
                                         r"qwen15:2048:random\) are the same kernel \(group 8, cluster 2\)"):
        schedule_kernels(_parse_row("qwen15:2048:random"), parse_schedules("128x256x64:4,128x256x64:4:2:8"), layer)


def test_a_bad_layer_is_refused():
    with pytest.raises(ValueError, match="layer: 'ag' or 'rs', got 'mlp'"):
        schedule_kernels(_parse_row("qwen15:2048:random"), parse_schedules("128x256x64:4"), "mlp")


def test_the_cli_refuses_a_schedule_the_recipe_refuses_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        probes.main(["moe_schedules", "--rows", "qwen15:2048:random", "--schedules", "128x256x64:4,128x256x64:1"])
    assert "schedule 128x256x64:1 (ag, qwen15:2048:random)" in capsys.readouterr().err


def test_an_empty_schedule_list_is_refused_not_defaulted(capsys):
    with pytest.raises(SystemExit):
        probes.main(["moe_schedules", "--schedules", ""])
    assert "--schedules: BMxBNxBK:STAGES[:CLUSTER[:GROUP_M]]" in capsys.readouterr().err


def test_the_one_gpu_probes_are_exactly_those_gated_as_one():
    """The probes that run without torchrun: the gate's list is the probes' own, one by one."""
    assert gates.ONE_GPU_PROBES == ("copy_engine", "epilogue", "ag_group", "ag_gather", "moe_notifies",
                                    "moe_schedules", "moe_row_copies", "moe_power", "moe_dram")
    assert probes.NAMES[:len(gates.ONE_GPU_PROBES)] == gates.ONE_GPU_PROBES      # the one-GPU ones first
    assert probes.NAMES == gates.ONE_GPU_PROBES + gates.TWO_GPU_PROBES             # and every other one gated too
