"""tldsl: tile programs that overlap computation with communication across GPUs.

    import tldsl as tl

    @tl.kernel
    def my_kernel(a: tl.Symmetric, b, c, *, compute: tl.ComputeSchedule, comm: tl.CommSchedule):
        ...  # declare signals/workspaces, then @tl.comm_part and @tl.compute_part functions

    result = tl.simulate(my_kernel, world_size=4, inputs=[...], seed=0)
    result = tl.run(my_kernel, world_size=4, inputs=[...])     # the same, every rank on this GPU

Element types: ``float16``, ``bfloat16``, ``float32``, ``int32``, ``bool_`` (:class:`DType`).
Every public name, with its one-line summary and the rules a tile program meets first (tile
sizes, divisibility, what happens at a tensor's edge): docs/api.md, generated from these
docstrings by ``python -m tldsl.apidoc``.
"""
from pathlib import Path as _Path


def _source_tree_fallback():
    """The distribution maps ir/, codegen/ and runtime/ into this namespace (pyproject's
    package-dir). From a checkout that is not installed, find them beside this folder."""
    from importlib import metadata
    try:
        metadata.distribution("tldsl")
        return
    except metadata.PackageNotFoundError:
        pass
    root = _Path(__file__).resolve().parent.parent
    if (root / "ir" / "__init__.py").exists() and str(root) not in __path__:
        __path__.append(str(root))


_source_tree_fallback()

from .errors import (TldslError, CompilationError, VerificationError, ScheduleError, InputError,  # noqa: E402
                     SimulationError, RaceError, DeadlockError, StaleSignalError,
                     UninitializedReadError, OutOfBoundsError, RunCheckError, FallbackWarning, ResidencyWarning)
from .ir.types import float16, bfloat16, float32, int32, bool_  # noqa: E402
from .ir.schedule import ComputeSchedule, CommSchedule  # noqa: E402
from .tracing import cdiv, select  # noqa: E402
from .tiles import minimum, maximum  # noqa: E402
from .language import (constexpr, Symmetric, rank, world_size, range, static_range, when,  # noqa: E402
                       load, load_rows, add_rows, load_scalar, store, full, zeros, fragment, iota, ewise,
                       exp, exp2, log, sqrt, abs, sigmoid, tanh, erf, rsqrt, where, cast, sum, max, min, expand_dims,
                       broadcast_to, trans, dot, symmetric_buffer, local_buffer, signal, static_assert)
from .primitives import (producer_tile_notify, consumer_tile_wait, peer_tile_notify,  # noqa: E402
                         peer_tile_wait, rank_notify, rank_wait, tile_push_data, tile_pull_data,
                         rank_copy_data)
from .kernel import kernel, compute_part, comm_part, TensorSpec, KernelFunction  # noqa: E402
from .mappings import StaticMapping, DynamicMapping  # noqa: E402
from .runtime.sim import simulate, SimOptions, SimResult  # noqa: E402
from .run import run  # noqa: E402  (imports torch and the code generator only when called)

__version__ = "0.1.0"

#: the public API: what ``help(tldsl)`` lists and docs/api.md describes (tests/test_api_docs.py)
__all__ = [
    # writing and running kernels
    "kernel", "compute_part", "comm_part", "TensorSpec", "KernelFunction", "simulate", "SimOptions", "SimResult",
    "run",
    # schedules and mappings
    "ComputeSchedule", "CommSchedule", "StaticMapping", "DynamicMapping",
    # element types
    "float16", "bfloat16", "float32", "int32", "bool_",
    # the tile language
    "constexpr", "Symmetric", "rank", "world_size", "range", "static_range", "when", "static_assert", "cdiv",
    "select", "load", "load_rows", "add_rows", "load_scalar", "store", "full", "zeros", "fragment", "iota", "ewise", "exp",
    "exp2", "log", "sqrt", "abs", "sigmoid", "tanh", "erf", "rsqrt", "where", "minimum", "maximum", "cast", "sum",
    "max", "min", "expand_dims", "broadcast_to", "trans", "dot", "symmetric_buffer", "local_buffer", "signal",
    # tile-centric primitives
    "producer_tile_notify", "consumer_tile_wait", "peer_tile_notify", "peer_tile_wait", "rank_notify", "rank_wait",
    "tile_push_data", "tile_pull_data", "rank_copy_data",
    # errors
    "TldslError", "CompilationError", "VerificationError", "ScheduleError", "InputError", "SimulationError",
    "RaceError", "DeadlockError", "StaleSignalError", "UninitializedReadError", "OutOfBoundsError", "RunCheckError",
    "FallbackWarning", "ResidencyWarning",
]
