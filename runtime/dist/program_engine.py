"""The general engine of a library op (:mod:`.engine`): the op's tile program run by the one
fused-op runtime (:class:`~.program_op.FusedProgram`).

:class:`~.ag_gemm.AllGatherMatmul` and :class:`~.gemm_rs.MatmulReduceScatter` get a hand-built
engine only for the schedules a recipe covers (:mod:`.recipes`: the copy engines' direct pull and
push, the GEMM pushing, the copy-engine reduce-scatter — measured fastest). Every other schedule
— the generated SM communication kernels, the codegen copy-engine plan, the NVSHMEM transport —
is the op's tile program traced for the op's problem and schedules and run by FusedProgram, as
any user's program is: the same lowering, agreement check, symmetric allocation, handshakes,
epochs and CUDA-graph reset. The op keeps its call's interface (its arguments, outputs, hooks and
timeline); the program holds the buffers, counters, streams and the launch protocol.
"""
from __future__ import annotations

from ... import env
from .engine import Engine
from .program_op import FusedProgram


def wait_timeout_s() -> float | None:
    """``TLDSL_WAIT_TIMEOUT_NS`` (debugging: a wait that spins longer traps, and the host's
    ``synchronize`` / ``close`` give up after as long) in seconds, or None."""
    ns = env.wait_timeout_ns()          # (an InputError naming it when malformed)
    return ns / 1e9 if ns is not None else None


class ProgramEngine(Engine):
    """``op``'s traced program ``kernel_fn`` with ``specs`` (argument shapes and dtypes) and
    keyword values (``compute=``, ``comm=``, ...) as a FusedProgram of ``op``'s group. Building
    it is collective, like the op's."""

    def __init__(self, op, kernel_fn, specs: dict, *, name: str, progress=None, **kwargs):
        self.name = name
        self.program = FusedProgram(kernel_fn, op.ctx.group, specs, timeout_s=wait_timeout_s(), progress=progress,
                                    **kwargs)
        self.ir = self.program.kernel

    def __call__(self, op, **tensors) -> dict:
        """One launch of the program on the caller's stream, with the op's hooks and timeline;
        the op's launch count and CUDA-graph mode follow the program's."""
        program = self.program
        program.hooks, program.timeline, program.hook_owner = op.hooks, op.timeline, op
        try:
            out = program(**tensors)
        finally:
            program.hook_owner = None       # (no reference from the program back to the op between calls)
        op.launches, op._graph, op._capture = program.launches, program._graph, program._capture
        return out

    def lowered(self, part: str):
        """The lowered kernel (or copy-engine plan) of ``part``."""
        return self.program.lowered[part]

    def reserved_sms(self, part: str) -> int:
        """SMs of this rank's GPU that ``part``'s kernel does not run on (the other parts' CTAs
        and what is left to same-GPU copies): a stand-alone launch of it (``compute_only``) gets
        the SMs it gets in the fused launch."""
        plan = self.program.plan
        ctas = sum(k.ctas for k in plan.kernels if k.part == part)
        return max(0, plan.sm_count - ctas)

    @property
    def signals(self) -> dict:
        return self.program.signal_tensors()

    def graph_counters(self) -> list:
        return self.program._graph_counters()

    def workspace_tensors(self) -> dict:
        return self.program.workspace_tensors()

    def signal_map(self) -> list:
        return self.program.signal_map()

    def describe(self) -> str:
        return "\n".join([f"  {self.name}: the tile program on the fused-op runtime"] + self.program._describe_body())

    def close(self) -> None:
        self.program.close()
