"""How a fused op's launches are made: its **engine**, chosen once when the op is built.

Every engine runs the op's traced tile program. The general one is the fused-op runtime itself,
:class:`~.program_engine.ProgramEngine` (the program run by :class:`~.program_op.FusedProgram`,
as any user's program is). The others are **recipes** (:mod:`.recipes`): launch paths written by
hand for one op's schedule because they were measured faster than the general protocol — the
same generated compute kernel, the communication part's work done with fewer host calls and
handshakes. An op asks :func:`~.recipes.choose` which engine its schedule gets; nothing else of
the op depends on the answer.

:class:`EngineOp` is the fused-op base for ops built that way (:class:`~.ag_gemm.AllGatherMatmul`,
:class:`~.gemm_rs.MatmulReduceScatter`): what :class:`~.fused_op.FusedOp` asks of an op — its
counters, workspaces, signal map, the counters a captured launch resets, what ``close()`` frees
before the lease, the body of ``describe()`` — is answered by its engine, here, once.
"""
from __future__ import annotations

from .fused_op import FusedOp


class Engine:
    """What every engine of an op offers: ``name`` (what ``op.engine`` reports), the op's
    introspection and ``compute_gemm`` (its ``compute_only``). Per op, its engines also share:

    * AllGatherMatmul's — ``__call__(a_shard, b, *, poison_workspace, out, return_gathered)``,
      ``signal`` (the counter the GEMM waits on) and :meth:`compute_only_inputs`;
    * MatmulReduceScatter's — ``__call__(a, b, out)``, ``parts()`` (lowered GEMM, lowered
      reduce-scatter kernel or None, its CTAs) and ``gemm_buffers(a, b, out)`` (the GEMM's tensors
      and counters)."""

    name = "engine"

    @property
    def signals(self) -> dict:
        """This rank's counter tensors (int64 CUDA) by signal name."""
        raise NotImplementedError

    def graph_counters(self) -> list:
        """Every counter a launch waits on or writes (what a captured launch zeroes first)."""
        return list(self.signals.values())

    def workspace_tensors(self) -> dict:
        """The data workspaces a launch overwrites (the distributed checks fill them with noise)."""
        raise NotImplementedError

    def signal_map(self) -> list[tuple[str, int, int, str]]:
        """``(signal, address, slots, note)`` per counter (decodes a device wait's timeout)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The engine and its kernels, as the lines of the op's ``describe()``."""
        raise NotImplementedError

    @property
    def compute_gemm(self):
        """The compute kernel alone, on the SMs it gets in the fused launch (``compute_only``)."""
        return self.gemm

    def compute_only_inputs(self, a_gathered) -> tuple[dict, dict]:
        """(AllGatherMatmul's engines) What the GEMM alone needs besides the op's operands and
        scratch counters for its waits (buffers, signals): scratch for what it stores beside C
        (none here)."""
        return {}, {}

    def close(self) -> None:
        """What the engine frees before the op's lease (spare outputs, its own workspaces)."""


class EngineOp(FusedOp):
    """A fused op whose launches its engine (``self._engine``, an :class:`Engine`) makes."""

    _engine = None

    @property
    def engine(self) -> str:
        """The engine's name: ``sm``, ``copy_engine-plan`` (the fused-op runtime), or a recipe's
        (``copy_engine``, ``copy_engine-push``, ``gemm-push``: :mod:`.recipes`)."""
        return self._engine.name

    def signal_tensors(self) -> dict:
        """This rank's counter tensors (int64 CUDA), by signal name."""
        self._check_open()                              # (its views went with close())
        return dict(self._engine.signals)

    def _graph_counters(self) -> list:
        return self._engine.graph_counters()

    def workspace_tensors(self) -> dict:
        """The data workspaces a launch overwrites (the distributed checks fill them with noise)."""
        self._check_open()
        return self._engine.workspace_tensors()

    def signal_map(self) -> list[tuple[str, int, int, str]]:
        """``(signal, address, slots, note)`` of this rank's counters (decodes a device
        ``wait timed out: slot 0x...`` line, see :func:`~.comm_kernel.explain_address`)."""
        self._check_open()
        return self._engine.signal_map()

    def _describe_head(self) -> str:
        return f"; engine {self.engine}"

    def _describe_body(self) -> list[str]:
        return [self._engine.describe()]

    def _release(self) -> None:
        self._scratch = self._compute_only = None   # (``compute_only``'s prepared launch and scratch counters)
        if self._engine is not None:
            self._engine.close()

    def _hook(self, name, stream) -> None:
        """Run the caller's hook ``name`` (``before_compute`` / ``before_comm``) with this op."""
        h = self.hooks.get(name)
        if h is not None:
            h(self, self.launches, stream)
