"""``tl.run``: the twin of ``tl.simulate`` on a GPU — same arguments, same checks and errors,
a result with the same interface — so a notebook switches between them with one word.

    result = tl.simulate(my_kernel, 2, inputs, compute=..., comm=...)
    result = tl.run(my_kernel, 2, inputs, compute=..., comm=...)       # every rank on this GPU

Inputs are checked and the kernel traced exactly as ``tl.simulate`` does (its own functions);
then every part is lowered (``tldsl.codegen.lower_all``), compiled (cached) and launched
(:mod:`tldsl.runtime.gpu.run_program`). This module imports nothing heavy: torch, the code
generator and the CUDA driver are imported by the call.
"""
from __future__ import annotations

import numbers

from .errors import InputError

def run(kernel, world_size: int | None = None, inputs=None, seed: int = 0, options=None, *,
        timeout_s: float | None = 60.0, lowering: dict | None = None, progress=None, **kwargs):
    """Run ``kernel`` for ``world_size`` ranks on the current GPU and return a
    :class:`~tldsl.runtime.gpu.run_result.RunResult` (``tl.simulate`` 's interface: ``result[r]``,
    ``.outputs``, ``.workspaces``, plus ``.launch_ms``, ``.plan`` and ``.tensors``).

    ``kernel``, ``world_size``, ``inputs`` (torch tensors anywhere, or numpy arrays: one dict or
    sequence per rank), ``seed``, ``options`` and the kernel's keyword values (``compute=``,
    ``comm=``, ...) are those of ``tl.simulate``: of ``options`` (a ``tl.SimOptions`` or a dict of
    its fields), ``launches`` and ``static_checks`` apply, the rest are the simulator's detectors.
    ``seed`` picks the order in which the ranks' work is enqueued. Inputs are copied; every rank
    gets its own tensors, workspaces poisoned as the simulator poisons them.

    ``timeout_s``: a launch that does not finish this long after it starts raises
    ``GpuHangError`` (kernels are built so that a wait longer than this traps); None: wait
    forever. ``lowering``: options for ``lower_all`` (``threads``, ``stages``, ...).
    ``progress``: NVRTC's progress reports (``print`` in a notebook).
    """
    ir, per_rank, opts = trace_for_run(kernel, world_size, inputs, seed, options, kwargs)
    if timeout_s is not None and (not isinstance(timeout_s, numbers.Real) or isinstance(timeout_s, bool)
                                  or not timeout_s > 0):
        raise InputError(f"timeout_s must be a positive number of seconds (None: no timeout), got {timeout_s!r}")
    if lowering is not None and not isinstance(lowering, dict):
        raise InputError(f"lowering must be a dict of lower_all options, got {type(lowering).__name__}")
    if lowering and "wait_timeout_ns" in lowering:
        raise InputError("lowering={'wait_timeout_ns': ...}: tl.run sets the kernels' wait timeout from timeout_s "
                         "(seconds); pass timeout_s instead")
    from .runtime.gpu.run_program import run_program        # (torch, codegen and the driver: at the call)
    return run_program(ir, per_rank, launches=opts.launches, seed=seed, timeout_s=timeout_s, lowering=lowering,
                       progress=progress)


def trace_for_run(kernel, world_size, inputs, seed, options, kwargs: dict):
    """``tl.simulate`` 's checks of its arguments and its trace — the simulator's own function, so
    both calls refuse alike: returns (the traced kernel, every rank's arrays in argument order,
    the options)."""
    from .runtime.sim.simulate import checked_call
    return checked_call(kernel, world_size, inputs, seed, options, kwargs, "run",
                        "it picks the order the ranks' work is enqueued")
