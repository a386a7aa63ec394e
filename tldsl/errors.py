"""Every error tldsl raises, in one hierarchy, each pointing at the user's line where it can."""
from __future__ import annotations


class TldslError(Exception):
    """Base class of every tldsl error."""


class CompilationError(TldslError):
    """A tile program is wrong: raised while tracing or verifying, before anything runs.

    The message shows ``file:line``, the user's source line and a caret under it.
    """

    def __init__(self, message: str, loc=None):
        self.raw_message = message
        self.loc = loc
        super().__init__(self._format())

    def _format(self) -> str:
        if self.loc is None:
            return self.raw_message
        excerpt = self.loc.excerpt()
        return f"{self.loc}: {self.raw_message}" + (f"\n{excerpt}" if excerpt else "")


class VerificationError(CompilationError):
    """The IR breaks a rule of the language (types, scopes, a wait nothing can satisfy...)."""


class ScheduleError(CompilationError):
    """A compute or communication schedule is invalid, alone or combined with the program.

    Raised before anything runs; points at the user's line that built or used the schedule
    (its raisers pass that line: this module imports nothing, so that every other can import it)."""


class InputError(TldslError):
    """The arguments given to a kernel (shapes, dtypes, world size, buffers) do not fit it."""


class SimulationError(TldslError):
    """Base class of what the simulator finds while running a kernel.

    ``at``: the tile program's lines involved (the ops' locations); the message ends with each
    one's path and source line under a caret, as a compilation error's does — a notebook cell's
    file name alone does not say which line of which cell."""

    def __init__(self, message: str, *, at=(), **details):
        self.details = details
        self.locs = tuple(dict.fromkeys(loc for loc in at if loc is not None))[:3]
        excerpts = [f"  {loc}:\n{loc.excerpt()}" if loc.excerpt() else f"  {loc}" for loc in self.locs]
        super().__init__("\n".join([message, *excerpts]))


class RaceError(SimulationError):
    """Two accesses to one region, at least one a write, not ordered by a notify -> wait chain."""


class DeadlockError(SimulationError):
    """Every unfinished task is blocked on a wait that nothing left can satisfy."""


class StaleSignalError(SimulationError):
    """A wait was satisfied by notifies of an earlier launch of the kernel."""


class UninitializedReadError(SimulationError):
    """A kernel read workspace memory that nothing has written."""


class OutOfBoundsError(SimulationError):
    """An access outside a buffer (tables, explicit ranks, channels)."""


class RunCheckError(SimulationError):
    """A check the kernels make on the GPU of what the simulator refuses while it runs (a wait's
    count computed at run time that is not positive, or past its slot's notifies per launch)
    failed; a subclass of :class:`~tldsl.errors.SimulationError`, which ``tl.simulate`` raises for
    the same program. The launch finished (the wait did not wait) and the GPU is fine; its
    outputs are not to be trusted (:mod:`runtime.gpu.run_checks`).

    Defined here, not beside ``tl.run``'s other errors, so that ``tl.RunCheckError`` is public
    without ``import tldsl`` importing the GPU runtime."""


class FallbackWarning(UserWarning):
    """A part went to the general lowering because the recipe made for it refused it — its plan (a
    schedule its template cannot run, say) or its program: the kernel computes the same, without
    that template's speed. The warning points at the part's line and gives the refusal."""


class ResidencyWarning(UserWarning):
    """``tl.simulate`` ran a compute part whose tasks wait for later tasks of their own with every
    task at once, as its default does; a GPU runs it only with as many CTAs resident as it has tasks,
    so ``tl.run`` refuses it on a GPU with fewer SMs (``ResidencyError``, before anything launches)."""

