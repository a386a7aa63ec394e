"""``tl.run``: the twin of ``tl.simulate`` on a GPU — same arguments, same checks and errors,
a result with the same interface — so a notebook switches between them with one word.

    result = tl.simulate(my_kernel, 2, inputs, compute=..., comm=...)
    result = tl.run(my_kernel, 2, inputs, compute=..., comm=...)       # every rank on this GPU
    result = tl.run(my_kernel, inputs=mine, group=group, compute=...)   # one rank per GPU (torchrun)

Inputs are checked and the kernel traced exactly as ``tl.simulate`` does (its own functions);
then every part is lowered (``tldsl.codegen.lower_all``), compiled (cached) and launched
(:mod:`tldsl.runtime.gpu.run_program`). This module imports nothing heavy: torch, the code
generator and the CUDA driver are imported by the call.
"""
from __future__ import annotations

import math
import numbers

from .errors import InputError

#: how ``tl.run(..., group=...)`` runs a program across a process group's GPUs: set by
#: :func:`register_group_runner` (``tldsl.runtime.dist`` does, when imported). The distributed
#: runtime builds on tldsl (its fused ops trace library kernels), so tldsl does not import it.
_ACROSS_GROUP = None


def register_group_runner(runner) -> None:
    """Make ``runner(kernel, world_size, inputs, seed, options, kwargs, *, group, timeout_s,
    lowering, progress)`` what ``tl.run(..., group=...)`` calls."""
    global _ACROSS_GROUP
    _ACROSS_GROUP = runner


#: the kernels' wait timeout is an unsigned 64-bit count of nanoseconds (-DTLDSL_WAIT_TIMEOUT_NS=...ull)
MAX_WAIT_TIMEOUT_NS = 2 ** 64


def check_run_options(timeout_s, lowering, who: str) -> None:
    """``timeout_s`` and ``lowering`` as tl.run and the fused-op runtime take them (checked before
    anything is traced, compiled or launched)."""
    if timeout_s is not None and (not isinstance(timeout_s, numbers.Real) or isinstance(timeout_s, bool)
                                  or not timeout_s > 0 or not math.isfinite(timeout_s)):
        raise InputError(f"timeout_s must be a finite positive number of seconds (None: no timeout, wait forever), "
                         f"got {timeout_s!r}")
    if timeout_s is not None and not 1 <= int(timeout_s * 1e9) < MAX_WAIT_TIMEOUT_NS:
        raise InputError(f"timeout_s={timeout_s!r}: the kernels count a wait's timeout in whole nanoseconds, in a 64-bit "
                         f"counter, so timeout_s is from 1e-9 s up to below {MAX_WAIT_TIMEOUT_NS / 1e9:.1f} s (2**64 ns, "
                         "about 584 years); pass timeout_s=None to wait forever")
    if lowering is not None and not isinstance(lowering, dict):
        raise InputError(f"lowering must be a dict of lower_all options, got {type(lowering).__name__}")
    if lowering and "wait_timeout_ns" in lowering:
        raise InputError(f"lowering={{'wait_timeout_ns': ...}}: {who} sets the kernels' wait timeout from timeout_s "
                         "(seconds); pass timeout_s instead")


def check_sms(sms, group) -> None:
    """``tl.run`` 's ``sms``: None or a positive int, and only for a run on this GPU."""
    if sms is None:
        return
    if not isinstance(sms, numbers.Integral) or isinstance(sms, bool) or sms < 1:
        raise InputError(f"sms must be None (every SM of the GPU) or a positive int, got {sms!r}")
    if group is not None:
        raise InputError("sms=: a run across a process group plans each rank's GPU whole; sms applies to a run "
                         "of every rank on this GPU (group=None)")


def run(kernel, world_size: int | None = None, inputs=None, seed: int = 0, options=None, *,
        timeout_s: float | None = 60.0, lowering: dict | None = None, progress=None, group=None,
        sms: int | None = None, **kwargs):
    """Run ``kernel`` for ``world_size`` ranks on the current GPU and return a
    :class:`~tldsl.runtime.gpu.run_result.RunResult` (``tl.simulate`` 's interface: ``result[r]``,
    ``.outputs``, ``.workspaces``, plus ``.launch_ms``, ``.plan`` and ``.tensors``).

    ``kernel``, ``world_size``, ``inputs`` (torch tensors anywhere, or numpy arrays: one dict or
    sequence per rank), ``seed``, ``options`` and the kernel's keyword values (``compute=``,
    ``comm=``, ...) are those of ``tl.simulate``: of ``options`` (a ``tl.SimOptions`` or a dict of
    its fields), ``launches`` and ``static_checks`` apply, the rest are the simulator's detectors.
    ``seed`` picks the order in which the ranks' work is enqueued. Inputs are copied; every rank
    gets its own tensors, workspaces poisoned as the simulator poisons them. Every launch runs on
    the caller's arguments, as the simulator's do: what the program writes into them is put back
    between launches (an in-place ``y += x`` returns one application of itself).

    ``timeout_s``: a launch that does not finish this long after it starts raises
    ``GpuHangError`` (kernels are built so that a wait longer than this traps); None: wait
    forever. A wait whose count, computed at run time, the simulator refuses (not positive, or
    past its ``per_launch``) is checked in the kernel too: ``RunCheckError`` (a
    ``SimulationError``) at the wait's line after the launch. ``lowering``: options for ``lower_all`` (``threads``, ``stages``, ...), and
    ``chain``: where a part that only waits on one other compute part runs — ``"after"`` it on
    its stream (the default; the signal between them is then dropped, the stream's order keeps
    its waits), ``"beside"`` it on a stream of its own (the waits real), or ``"folded"`` into its
    kernel where the recipe can. ``progress``: NVRTC's progress reports (``print`` in a notebook).
    ``sms``: plan the launch on this many of the GPU's SMs (None: all of them), as on a smaller
    GPU or beside other work: each part's kernel gets its share of them, and a persistent CTA
    then walks several tiles, in the compute schedule's order — the case the simulator checks
    (``tl.SimOptions.compute_slots``); the same-GPU copies of a copy-engine part take SMs from
    the GPU's others. Too few for the program's kernels to be resident at once is refused before
    anything launches (``ResidencyError``).

    ``group``: a torch.distributed process group — this process is one rank of it, on its own
    GPU (torchrun), ``inputs`` are this rank's arguments only (one dict, or the arrays in
    argument order), and every rank makes the same call. The program runs through the fused-op
    runtime (:class:`~tldsl.runtime.dist.program_op.FusedProgram`, registered here when
    ``tldsl.runtime.dist`` is imported); the result holds this rank's arrays (``result[rank]``).
    """
    check_sms(sms, group)
    from .codegen.toolchain.compiler import resolve_progress
    resolve_progress(progress)          # (refused here, not after the GPU is found: NVRTC's rule, one place)
    if group is not None:
        if _ACROSS_GROUP is None:
            raise InputError("tl.run(..., group=...) runs through tldsl.runtime.dist's fused-op runtime: "
                             "import tldsl.runtime.dist first")
        return _ACROSS_GROUP(kernel, world_size, inputs, seed, options, kwargs, group=group, timeout_s=timeout_s,
                             lowering=lowering, progress=progress)
    ir, per_rank, opts = trace_for_run(kernel, world_size, inputs, seed, options, kwargs)
    check_run_options(timeout_s, lowering, "tl.run")
    from .runtime.gpu.run_program import run_program        # (torch, codegen and the driver: at the call)
    return run_program(ir, per_rank, launches=opts.launches, seed=seed, timeout_s=timeout_s, lowering=lowering,
                       progress=progress, sms=sms)


def trace_for_run(kernel, world_size, inputs, seed, options, kwargs: dict):
    """``tl.simulate`` 's checks of its arguments and its trace — the simulator's own function, so
    both calls refuse alike: returns (the traced kernel, every rank's arrays in argument order,
    the options)."""
    from .runtime.sim.simulate import checked_call
    return checked_call(kernel, world_size, inputs, seed, options, kwargs, "run",
                        "it picks the order the ranks' work is enqueued")
