"""The first hour: every public name has its own docstring and shows in ``help(tldsl)``,
docs/api.md is what :mod:`tldsl.apidoc` generates, and the rules it states (from README's
"author-rules" block) are what the library does."""
import pydoc
from pathlib import Path

import numpy as np
import pytest

import tldsl as tl
from tldsl import apidoc
from tldsl.ir.schedule import check_compatible
from tldsl.ir.types import DType

ROOT = Path(__file__).resolve().parent.parent


def test_every_public_name_has_a_docstring_of_its_own():
    bare = [n for n in tl.__all__ if not isinstance(getattr(tl, n), DType) and apidoc.own_docstring(getattr(tl, n)) is None]
    assert not bare, f"public names without a docstring: {bare}"


def test_help_lists_every_public_name():
    text = pydoc.render_doc(tl, renderer=pydoc.plaintext)
    for name in tl.__all__:
        obj = getattr(tl, name)
        shown = (f"class {name}(" if isinstance(obj, type) else f"{name} = " if isinstance(obj, DType)
                 else f"\n    {name}(")
        assert shown in text, f"help(tldsl) does not show {name}"


def test_all_is_the_public_namespace():
    import types
    public = {n for n, v in vars(tl).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert set(tl.__all__) == public and len(tl.__all__) == len(set(tl.__all__))


def test_api_page_is_generated_from_the_docstrings():
    page = (ROOT / "docs" / "api.md").read_text()
    assert page == apidoc.render(), "docs/api.md is stale: python -m tldsl.apidoc > docs/api.md"
    for name in tl.__all__:
        assert f"- `tl.{name}" in page


def test_run_check_error_is_public_and_imports_no_gpu_runtime():
    """Found by a helper's round: ``tl.run`` raises RunCheckError, but ``tl.RunCheckError`` did not
    exist (only ``tldsl.runtime.gpu.run_errors.RunCheckError``). It is one class under both names, a
    SimulationError as ``tl.simulate`` raises for the same program, defined where importing tldsl
    does not import the GPU runtime (test_run_plan checks that)."""
    from tldsl.runtime.gpu.run_errors import RunCheckError
    assert "RunCheckError" in tl.__all__ and tl.RunCheckError is RunCheckError
    assert issubclass(tl.RunCheckError, tl.SimulationError)
    assert "- `tl.RunCheckError` — A check the kernels make on the GPU" in (ROOT / "docs" / "api.md").read_text()


def test_summaries_are_one_sentence():
    assert apidoc.summary("trans") == "The transpose of a 2-d tile (e.g. `tl.dot(q, tl.trans(k))`)."
    assert apidoc.summary("float16") == "element type `f16`: 16-bit float (numpy float16 in the simulator)."


def test_a_name_without_a_docstring_is_refused(monkeypatch):
    monkeypatch.setattr(tl, "undocumented", lambda: None, raising=False)
    with pytest.raises(ValueError, match="tldsl.undocumented has no docstring of its own"):
        apidoc.summary("undocumented")


# -- the rules are stated, and true -------------------------------------------------------------

def test_the_rules_are_stated_where_an_author_looks():
    rules = apidoc.author_rules()
    for phrase in ("powers of two from 8 to 256", "divide one another", "reads zeros", "writes only the part",
                   "cut at the source's edge", "tile_pull_data", "tile_push_data", "rank_copy_data",
                   "numpy's elementwise functions trace as the tile language's"):
        assert phrase in rules
    assert rules in (ROOT / "docs" / "api.md").read_text()


@pytest.mark.parametrize("tile", [(12, 64, 64), (4, 64, 64), (512, 64, 64), (64, 64, 48)])
def test_compute_tiles_are_powers_of_two_from_8_to_256(tile):
    with pytest.raises(tl.ScheduleError, match="powers of two between 8 and 256"):
        tl.ComputeSchedule(tile=tile)
    tl.ComputeSchedule(tile=(8, 256, 16))


def test_tile_m_and_bm_divide_one_another():
    compute = tl.ComputeSchedule(tile=(64, 64, 64))
    check_compatible(compute, tl.CommSchedule(tile_m=16))
    check_compatible(compute, tl.CommSchedule(tile_m=128))
    with pytest.raises(tl.ScheduleError, match="one must divide"):
        check_compatible(compute, tl.CommSchedule(tile_m=48))


@tl.kernel
def pull_past_the_edge(a: tl.Symmetric, out, small):
    """Pull an 8-row box from the next rank's 3-row ``a`` into ``out`` (8 rows)."""
    R, C = a.shape
    done = tl.signal("done", 1)

    @tl.comm_part(grid=(1,), name="pull")
    def pull(i):
        peer = (tl.rank() + 1) % tl.world_size()
        tl.tile_pull_data(a.at(peer), (0, 0), (8, C), out, (0, 0))
        tl.producer_tile_notify(done, 0)

    @tl.compute_part(grid=(1,), name="edge")
    def edge(i):
        tl.consumer_tile_wait(done, 0)
        tile = tl.load(a, (0, 0), (8, C))                 # 5 of its 8 rows lie past a's edge
        tl.store(out, (8, 0), tile)                       # out rows 8..15: a's 3 rows, then zeros
        tl.store(small, (0, 0), tile)                     # small has 4 rows: the other 4 are not stored


def test_copies_are_cut_at_the_source_edge_and_loads_read_zeros():
    W, C, poison = 2, 4, -7.0
    a = [np.arange(3 * C, dtype=np.float32).reshape(3, C) + 100 * r for r in range(W)]
    inputs = [{"a": a[r], "out": np.full((16, C), poison, np.float32), "small": np.full((4, C), poison, np.float32)}
              for r in range(W)]
    res = tl.simulate(pull_past_the_edge, world_size=W, inputs=inputs, seed=0)
    for r in range(W):
        out = res[r]["out"]
        assert (out[:3] == a[(r + 1) % W]).all()          # the part of the box inside the source
        assert (out[3:8] == poison).all()                 # past the source's edge: left as it was, not zeros
        assert (out[8:11] == a[r]).all() and (out[11:16] == 0).all()   # a loaded tile: zeros past the edge
        assert (res[r]["small"][:3] == a[r]).all() and (res[r]["small"][3] == 0).all()
