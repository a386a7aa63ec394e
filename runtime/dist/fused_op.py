"""What every fused GPU op is besides its own launch path: one base class.

A fused op owns symmetric memory through a :class:`~.symmetric.Lease` (freed only by the
collective ``close()``), a rank of a process group, counters (int64 signal tensors) and a
description of the kernels it runs. Closing, the closed check, the counters' values, the
one-line ``repr``, the notebook card and ``describe()`` are the same for every op and written
here once; an op supplies what is specific to it:

* ``_problem()`` — the problem in a few words (``A shard [M, K] @ B [K, N] bf16``);
* ``_facts()`` — (name, value) rows of its notebook card;
* ``_describe_body()`` — the lines after the head of ``describe()`` (its engines and kernels);
* ``_release()`` — what it frees before its lease (engines, workspaces, spare outputs);
* ``signal_tensors()``, ``workspace_tensors()``, ``signal_map()`` — its counters and buffers;
* ``_graph_counters()`` — every counter a launch waits on or writes, where more than its signals.

CUDA graphs (``torch.cuda.graph``). Every op's protocol numbers its launches — a counter holding
``L`` says launch ``L`` got this far, and double-buffered slots are chosen by ``L % 2`` — and the
launch number reaches the device in three ways: a kernel argument, the constant of a stream
memory operation (``cuStreamWriteValue64`` / ``cuStreamWaitValue64``), and the address of a copy
(the slot). A captured graph bakes all three: every replay would be the captured launch again, its
waits satisfied by the previous replay's flags, its copies landing in the slot the previous replay's
readers may still read. A device-side launch counter read by the kernels cannot fix that alone:
a memop writes and compares host constants (it cannot add one) and a copy's address is fixed. So a
captured call is made *launch 1 of fresh counters*, and every replay makes it so again on the device
(:meth:`FusedOp._next_launch`): its first work on the compute stream is

1. a barrier of the group (the torch symmetric-memory barrier kernel, which resets its own signal
   pads: replayable) — every rank's previous launch is complete on every stream (each rank's
   previous launch was joined into its compute stream before this point), so nothing still reads
   or writes the op's buffers or counters;
2. every counter of the op zeroed on this rank (``cuMemsetD8Async``: a memset node in the graph);
3. a second barrier — every rank's counters are zero before any rank's launch writes into them.

Then the launch runs its ordinary protocol with ``L = 1`` (its waits, flags and slot are those of a
first launch, which is what the counters say). The epoch thus advances on the device at a fixed
point of every replay — it is reset to a known state there — and nothing is passed from the host per
replay. Once an op has been captured it stays in this mode: its later eager calls do the same (the
counters no longer count its launches), at the price of the two barriers; an op never captured runs
exactly as before (one extra host check per call: is the stream capturing). While capturing, the
call also allocates its outputs afresh (no spare outputs: :mod:`.spare_outputs`), records no stream
use of them (every side stream is joined back before the call returns), does not order itself after
the previous eager call's stream (an event recorded outside a capture cannot be waited on inside it)
and never synchronises (``TLDSL_DEBUG``'s per-launch report is skipped). A replay is ordered by
the stream it is launched on, like any graph: eager calls of the same op on another stream must be
ordered after it by the caller (the op's call order, :mod:`.call_order`, sees calls, not replays).
Ops whose symmetric memory is NVSHMEM's have no torch barrier to reset behind: their capture is
refused with an error (:meth:`~.symmetric.Lease.barrier`).
"""
from __future__ import annotations

from . import call_order
from .operands import check_open


class FusedOp:
    """The behaviour shared by the fused ops: the one runtime for any traced kernel
    (:class:`~.program_op.FusedProgram`, and the ops built on it: AllGatherMoE, MoEReduceScatter,
    SequenceParallelAttention) and the fused GEMM ops (:class:`~.ag_gemm.AllGatherMatmul`,
    :class:`~.gemm_rs.MatmulReduceScatter`: :class:`~.engine.EngineOp` s, whose launches a
    FusedProgram makes too, or — for the schedules :mod:`.recipes` lists — a hand-built engine)."""

    _closed = True             # until an op's construction has got far enough to own something
    _graph = False             # captured once: every launch starts from fresh counters (module docstring)
    _capture = False           # the current call is being captured
    _epoch_order = None        # the reset's own call order (a CallOrder, made on first use)

    # -- launch numbers -----------------------------------------------------------------------------
    def _next_launch(self) -> int:
        """The number of the launch this call makes. Eager (never captured): the host's count, as
        always. Capturing, and every call once captured: 1, after the device-side reset of the
        module docstring, enqueued here on the current stream."""
        self.launches += 1
        self._capture = call_order.capturing()
        if not self._graph:
            if not self._capture:
                return self.launches
            self._graph = True
        self._fresh_epoch()
        return 1

    def _fresh_epoch(self) -> None:
        """Barrier, every counter zeroed, barrier — on the current stream (module docstring)."""
        import torch
        from ..gpu import plan_exec
        stream = torch.cuda.current_stream(self.ctx.device)
        if self._epoch_order is None:
            self._epoch_order = call_order.CallOrder()
        self._epoch_order.follow(stream.cuda_stream)   # after the previous call, whatever its stream
        cu = plan_exec.load_driver()
        if self.ctx.world_size > 1:
            self._lease.barrier(stream)
        seen = set()
        for t in self._graph_counters():
            p = t.data_ptr()
            if p in seen:
                continue
            seen.add(p)
            if not t.is_contiguous():
                raise RuntimeError(f"{type(self).__name__}: a counter to reset is not contiguous")
            plan_exec.checked(cu, cu.cuMemsetD8Async(p, 0, t.numel() * t.element_size(), stream.cuda_stream),
                              "cuMemsetD8Async(reset a counter)")
        if self.ctx.world_size > 1:
            self._lease.barrier(stream)

    def _graph_counters(self) -> list:
        """Every counter tensor a launch waits on or writes (by default: its signals)."""
        return list(self.signal_tensors().values())

    # -- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the op's symmetric memory — the only point it is freed (collective: every rank
        of the group calls it at the same point; it synchronises this GPU and waits for the
        peers to do the same, so no kernel anywhere still touches it). An op dropped without
        ``close()`` keeps its memory, with a warning, until
        :func:`~.symmetric.release_unclosed`. Calls after it raise; a second close does nothing."""
        self._closed = True
        self._release()
        self._lease.forget(self, self._engine)
        self._lease.release()

    def _release(self) -> None:
        """What the op frees before its lease (nothing by default)."""

    def _check_open(self) -> None:
        check_open(type(self).__name__, self._closed)

    # -- counters ---------------------------------------------------------------------------------------
    def signal_tensors(self) -> dict:
        raise NotImplementedError

    def signal_counters(self) -> dict[str, list[int]]:
        """Every counter's slots, by signal name (the values the device left)."""
        return {nm: t.tolist() for nm, t in self.signal_tensors().items()}

    # -- description ----------------------------------------------------------------------------------
    def _problem(self) -> str:
        raise NotImplementedError

    def _facts(self) -> list[tuple[str, object]]:
        raise NotImplementedError

    def _describe_body(self) -> list[str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        """One line for notebooks: what it computes and how (``describe()``: the generated code too)."""
        from ...ir.display import fit, schedules
        name = type(self).__name__
        try:
            return fit(f"<{name} rank {self.ctx.rank}/{self.ctx.world_size}: {self._problem()}, ",
                       schedules(self.compute, self.comm),
                       f", {self.launches} launches{', closed' if self._closed else ''}>")
        except AttributeError:      # a construction that failed part-way
            return f"<{name} (not built)>"

    def _repr_html_(self) -> str:
        """A notebook's view: the problem and the schedules, ``describe()`` folded away."""
        from ...ir.display import html_card
        if not hasattr(self, "ctx") or not hasattr(self, "launches"):
            return html_card(repr(self), [])
        facts = [("rank", f"{self.ctx.rank} of {self.ctx.world_size}")] + self._facts() + \
            [("compute", self.compute), ("comm", self.comm), ("launches", self.launches), ("closed", self._closed)]
        return html_card(type(self).__name__, facts, [("describe()", self.describe())])

    def describe(self) -> str:
        """The op, its engines and the generated kernels, as text."""
        head = repr(self)[1:-1] + self._describe_head()
        if self._closed:
            return head + ": its symmetric memory is freed"
        return "\n".join([head] + self._describe_body())

    def _describe_head(self) -> str:
        """What follows the one-line summary at the head of ``describe()``."""
        return ""
