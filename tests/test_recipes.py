"""The fused ops on one runtime (runtime/dist/engine.py, recipes.py): which engine a schedule gets,
and that what every op shares is written once."""
import inspect

import pytest

import tldsl as tl
from tldsl.runtime import dist
from tldsl.runtime.dist import engine as eng
from tldsl.runtime.dist import recipes
from tldsl.runtime.dist.fused_op import FusedOp

PUSH = tl.CommSchedule(engine="copy_engine", mode="push")
PULL = tl.CommSchedule(engine="copy_engine", mode="pull")
SM = tl.CommSchedule(engine="sm", mode="pull", tile_m=128, sms=8)


@pytest.mark.parametrize("op, comm, ce_executor, engine", [
    ("AllGatherMatmul", PUSH, "direct", "PushAllGather"),
    ("AllGatherMatmul", PUSH.with_(col_tile=1024), "direct", "PushAllGather"),
    ("AllGatherMatmul", PULL, "direct", "PullAllGather"),
    ("AllGatherMatmul", PUSH, "plan", None),            # the codegen plan: the tile program on the runtime
    ("AllGatherMatmul", PULL, "plan", None),
    ("AllGatherMatmul", SM, "direct", None),
    ("AllGatherMatmul", SM.with_(mode="push"), "direct", None),
    ("MatmulReduceScatter", PUSH, None, "CopyEngineReduceScatter"),
    ("MatmulReduceScatter", PUSH.with_(reduce_in="epilogue"), None, "CopyEngineReduceScatter"),
    ("MatmulReduceScatter", tl.CommSchedule(engine="sm", mode="push", tile_m=128, sms=8), None, None),
    ("AllGatherMoE", PUSH, None, None),                 # no recipe: every schedule on the runtime
])
def test_each_schedule_gets_one_engine(op, comm, ce_executor, engine):
    recipe = recipes.choose(op, comm, ce_executor)
    assert (recipe.engine_class().__name__ if recipe else None) == engine


def test_every_recipe_names_an_engine_and_why():
    """A recipe is a row: its engine class is an Engine, and it says what measurement chose it."""
    assert len({(r.op, r.schedule) for r in recipes.RECIPES}) == len(recipes.RECIPES)
    for r in recipes.RECIPES:
        cls = r.engine_class()
        assert issubclass(cls, eng.Engine) and cls.name == r.name, r
        assert r.measured and r.schedule and hasattr(dist, r.op)
    from tldsl.runtime.dist.program_engine import ProgramEngine
    assert issubclass(ProgramEngine, eng.Engine)


SHARED = ("close", "describe", "__repr__", "_repr_html_", "signal_counters", "signal_tensors", "signal_map",
          "workspace_tensors", "_graph_counters", "_release", "_describe_body", "_next_launch")


def test_what_every_fused_op_shares_is_written_once():
    """close / describe / __repr__ / signal_counters come from FusedOp alone; an op's counters,
    workspaces and engine description from its runtime — EngineOp's delegation to the engine, or
    FusedProgram's own — never from an op class."""
    ops = [dist.AllGatherMatmul, dist.MatmulReduceScatter, dist.AllGatherMoE, dist.MoEReduceScatter,
           dist.SequenceParallelAttention]
    runtimes = {FusedOp, eng.EngineOp, dist.FusedProgram}
    for op in ops:
        assert issubclass(op, FusedOp)
        for name in SHARED:
            owners = [k for k in inspect.getmro(op) if name in vars(k) and k is not object]
            assert owners and set(owners) <= runtimes, (op.__name__, name, owners)
    for op in (dist.AllGatherMatmul, dist.MatmulReduceScatter):       # hooks: FusedProgram runs its own
        assert [k for k in inspect.getmro(op) if "_hook" in vars(k)] == [eng.EngineOp]
    for name in ("close", "describe", "__repr__", "signal_counters"):
        assert [k for k in (FusedOp, eng.EngineOp, dist.FusedProgram) if name in vars(k)] == [FusedOp], name
