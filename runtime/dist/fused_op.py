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
* ``signal_tensors()``, ``workspace_tensors()``, ``signal_map()`` — its counters and buffers.
"""
from __future__ import annotations

from .operands import check_open


class FusedOp:
    """The behaviour shared by the fused ops (:class:`~.ag_gemm.AllGatherMatmul`,
    :class:`~.gemm_rs.MatmulReduceScatter`)."""

    _closed = True             # until an op's construction has got far enough to own something

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
