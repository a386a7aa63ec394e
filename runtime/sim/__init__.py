"""The multi-rank CPU simulator: runs a kernel's IR for W ranks in numpy, interleaving
every rank's compute and communication tasks under a seeded scheduler, and reports
races (vector clocks), deadlocks, stale signals and reads of uninitialised memory."""
from .options import SimOptions
from .progress import LongSimulationWarning, SimProgress
from .simulate import simulate, SimResult

__all__ = ["simulate", "SimOptions", "SimResult", "SimProgress", "LongSimulationWarning"]
