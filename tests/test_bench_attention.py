"""``python -m tldsl.bench attention`` (the attention kernel beside torch's SDPA): its rows are the
issue's grid, its FLOP count is the attended pairs of the mask SDPA is given (lower-right causal:
the last rank's queries over every key), and its arguments are checked before anything runs."""
from __future__ import annotations

import numpy as np
import pytest

from tldsl.bench import attention as ba


def test_the_default_rows_are_the_issues_grid():
    a = ba.parse_args([])
    rows = ba.rows(a.seqs, a.ranks, a.dtypes, a.masks, a.heads)
    assert len(rows) == 2 * 4 * 2 * 2 * 2 and len(set(rows)) == len(rows)
    assert {r.seq for r in rows} == {4096, 8192, 16384, 32768} and {r.keys // r.seq for r in rows} == {2, 4}
    assert {(r.heads, r.kv_heads) for r in rows} == {(32, 32), (32, 8)} and {r.dtype for r in rows} == {"bfloat16",
                                                                                                        "float16"}


@pytest.mark.parametrize("seq,ranks", [(5, 2), (8, 4), (7, 1)])
def test_pairs_are_those_of_the_lower_right_causal_mask(seq, ranks):
    keys = seq * ranks
    lower_right = np.tril(np.ones((seq, keys), bool), k=keys - seq)      # query i sees keys <= i + keys - seq
    assert ba.Row("bfloat16", seq, ranks, True, 4, 4).pairs() == int(lower_right.sum())
    assert ba.Row("bfloat16", seq, ranks, False, 4, 4).pairs() == seq * keys
    assert ba.Row("bfloat16", seq, ranks, False, 4, 2).flops() == 4 * seq * keys * ba.D * 4


@pytest.mark.parametrize("args,says", [(["--heads", "32/5"], "must divide"), (["--heads", "x"], "Q/KV pairs"),
                                       (["--seqs", "4k"], "integers"), (["--masks", "diag"], "choose from"),
                                       (["--tile", "128,128"], "three integers"),
                                       (["--order", "column_major"], "row_major or swizzled"),
                                       (["--order", "swizzled:0"], "row_major or swizzled"),
                                       (["--order", "row_major:4"], "row_major or swizzled"),
                                       (["--order", "swizzled:\u00b2"], "row_major or swizzled"),
                                       (["--order", "row_major,row_major"], "each tile order once")])
def test_bad_arguments_are_refused_by_the_parser(args, says, capsys):
    with pytest.raises(SystemExit):
        ba.parse_args(args)
    assert says in capsys.readouterr().err


def test_every_rows_kernel_is_compiled_in_one_batch_before_timing(monkeypatch):
    """The rows' kernels go to NVRTC together (one job per distinct row, in row order), each
    lowered as the timed row lowers it; a compile error leaves every row to compile (and report) alone."""
    from tldsl.codegen.toolchain import compiler
    from tldsl.errors import CompilationError
    todo = ba.rows([256], [2], ["bfloat16"], ["full", "causal"], [(4, 4), (4, 2)])
    seen = []

    def fake(jobs, **kw):
        seen.append(jobs)
        return [f"cubin-{j.name}" for j in jobs]
    monkeypatch.setattr(compiler, "compile_many", fake)
    got = ba.compile_rows(todo, (128, 128, 64), 3)
    assert list(got) == todo and len(seen) == 1 and len(seen[0]) == 4
    assert [j.source for j in seen[0]] == [ba._lowered(r, (128, 128, 64), 3)[1].source for r in todo]

    def broken(jobs, **kw):
        raise CompilationError("nvrtc said no")
    monkeypatch.setattr(compiler, "compile_many", broken)
    assert ba.compile_rows(todo, (128, 128, 64), 3) == {}


def test_tile_orders_are_variants_compiled_and_timed_beside_each_other(monkeypatch):
    """``--order`` entries are the compute schedule's tile order (and group size): each a kernel
    of its own, compiled in the same batch, keyed ``(row, (softmax, order))``."""
    from tldsl.codegen.toolchain import compiler
    a = ba.parse_args(["--order", "row_major,swizzled:64"])
    assert a.order == ["row_major", "swizzled:64"]
    assert ba.schedule_order("swizzled:64") == {"order": "swizzled", "group_m": 64}
    assert ba.schedule_order("swizzled") == {"order": "swizzled"} and ba.schedule_order(None) == {}
    row = ba.rows([256], [2], ["bfloat16"], ["full"], [(4, 4)])[0]
    _, lowered = ba._lowered(row, (128, 128, 64), 3, None, "swizzled:64")
    assert (lowered.config.order, lowered.config.group_m) == ("swizzled", 64)
    assert ba._lowered(row, (128, 128, 64), 3)[1].config.order == "row_major"
    monkeypatch.setattr(compiler, "compile_many", lambda jobs, **kw: [j.source for j in jobs])
    variants = [(None, "row_major"), (None, "swizzled:64")]
    got = ba.compile_rows([row], (128, 128, 64), 3, variants)
    assert list(got) == [(row, v) for v in variants] and got[(row, variants[0])] != got[(row, variants[1])]
    assert ba.variant_label((None, "swizzled:64")) == "default, swizzled:64"
