"""What ``tl.run`` returns: :class:`~tldsl.runtime.sim.simulate.SimResult`'s interface (every
rank's arguments and workspaces as numpy arrays, in the simulator's storage types), so a
notebook switches between ``tl.simulate`` and ``tl.run`` with one word — plus what only a GPU
run has: the device, the launch plan, each launch's GPU time and the device tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import InputError
from ...ir.display import clipped, html_card, one_line
from ..sim.simulate import SimResult

_NO_EVENTS = "a GPU run records no event log: run the same call with tl.simulate to see the timeline"


@dataclass(repr=False)
class RunResult(SimResult):
    """A GPU run's result; ``events`` is empty and ``steps`` 0 (nothing is scheduled on the host)."""
    device: str = ""
    plan: object = None                                   # the RunPlan that was launched
    launch_ms: list[float] = field(default_factory=list)  # GPU time of each launch (all ranks)
    #: every rank's tensors after the run, by IR name; its signal counters as "signal:<name>"
    tensors: list[dict] = field(default_factory=list, repr=False)

    def timeline(self, width: int = 64) -> str:
        return f"({_NO_EVENTS})"

    def plot_timeline(self, tile=None, save=None, figsize=None):
        raise InputError(_NO_EVENTS)

    def __repr__(self) -> str:
        k = self.kernel
        times = ", ".join(f"{t:.3f}" for t in self.launch_ms)
        return one_line(f"<RunResult {k.name}: {k.world_size} ranks on {self.device or 'a GPU'}, {self.launches} "
                        f"launch(es) [{times}] ms; outputs {', '.join(self.outputs[0]) if self.outputs else '-'}>")

    def _repr_html_(self) -> str:
        k = self.kernel
        facts = [("device", self.device), ("ranks", k.world_size), ("launches", self.launches),
                 ("GPU time per launch (ms)", ", ".join(f"{t:.3f}" for t in self.launch_ms))]
        shown = next((outs for outs in self.outputs if outs), {})     # (across GPUs: this rank's own)
        for name, arr in shown.items():
            facts.append((f"output {name}", f"{arr.shape} {arr.dtype}"))
        plan = self.plan.describe() if self.plan is not None else "-"
        return html_card(f"RunResult of {k.name}", facts,
                         [("launch plan", clipped(plan, where="result.plan.describe()")),
                          ("IR", clipped(str(k), where="print(result.kernel)"))])
