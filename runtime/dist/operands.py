"""Checks of the fused ops' sizes, operands and outputs, shared by AllGather+GEMM and
GEMM+ReduceScatter: every problem found at once, as one InputError, before anything is enqueued
(a launch that fails half-way leaves the peers waiting for this rank's flags)."""
from __future__ import annotations

import numbers

from ...errors import InputError


def check_sizes(op: str, **sizes) -> None:
    """Every size a positive integer (not a float truncated, not a bool)."""
    for name, v in sizes.items():
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v <= 0:
            raise InputError(f"{op}: {name}={v!r} must be a positive int")


def shape_and_dtype(name: str, x) -> tuple:
    """``(shape, tl dtype)`` of a torch tensor, numpy array or ``tl.TensorSpec`` given for argument
    ``name`` (what the ops built from specs take); an InputError naming it for anything else, or
    for a dtype tldsl does not take."""
    from ...ir.types import dtype_of
    from ...kernel import TensorSpec
    if isinstance(x, TensorSpec):
        return tuple(x.shape), x.dtype
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise InputError(f"{name}: a torch tensor, numpy array or tl.TensorSpec, got {type(x).__name__}")
    try:
        return tuple(x.shape), dtype_of(x.dtype)
    except TypeError as e:
        raise InputError(f"{name}: {e}") from e


def check_schedules(op: str, compute, comm) -> None:
    """``compute`` a ``tl.ComputeSchedule`` and ``comm`` a ``tl.CommSchedule``, each or None (the
    op's default): a string, a tuple or the two swapped would otherwise fail deep in the build."""
    from ...ir.schedule import CommSchedule, ComputeSchedule
    for name, v, cls in (("compute", compute, ComputeSchedule), ("comm", comm, CommSchedule)):
        if v is not None and not isinstance(v, cls):
            raise InputError(f"{op}: {name} must be a tl.{cls.__name__} (or None: the op's default), got "
                             f"{type(v).__name__} {v!r}")


def check_progress(op: str, progress) -> None:
    """``progress`` as the compiler takes it (None, a bool or a callable), checked before the build
    that compiles: 42 would otherwise fail at the first compile's first report."""
    from ...codegen.toolchain.compiler import resolve_progress
    try:
        resolve_progress(progress)
    except InputError as e:
        raise InputError(f"{op}: {e}") from None


def byte_span(t) -> tuple[int, int]:
    """``[first, last)`` bytes a tensor's elements occupy (for any strides >= 0)."""
    p = t.data_ptr()
    if t.is_contiguous():                        # the common case, on the host path before a launch
        return p, p + t.numel() * t.element_size()
    if t.numel() == 0:
        return p, p
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return p, p + (last + 1) * t.element_size()


def overlaps(x, y) -> bool:
    return _meet(byte_span(x), byte_span(y))


def _meet(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


def check_no_grad(op: str, named) -> None:
    """``named``: ``(name, tensor)``; none requires grad while autograd records. The fused ops
    have no backward: such a call would launch, then drop the gradient or fail in
    ``backward()`` — refused before anything runs instead."""
    import torch
    if not torch.is_grad_enabled():
        return
    for name, t in named:
        if getattr(t, "requires_grad", False):
            raise InputError(f"{op}: {name} requires grad, but the op has no backward (autograd cannot differentiate "
                             f"it): call it under torch.no_grad() or torch.inference_mode(), or pass a detached "
                             f"tensor (.detach())")


def check_operands(op: str, operands, dtype, device: int | None, *, strided_ok: tuple[str, ...] = ()) -> None:
    """``operands``: ``(name, tensor, shape)``; each a CUDA tensor on ``device`` of that shape and
    dtype, contiguous and 16-byte aligned (TMA and the copy engines read it) — unless its name is
    in ``strided_ok`` (the op copies such an operand first) — and none requiring grad
    (:func:`check_no_grad`)."""
    check_no_grad(op, [(name, t) for name, t, _ in operands])
    problems = []
    for name, t, shape in operands:
        if not (hasattr(t, "shape") and hasattr(t, "dtype") and hasattr(t, "is_contiguous")):
            problems.append(f"{name} must be a torch tensor, got {type(t).__name__}")
            continue
        if not getattr(t, "is_cuda", False):
            problems.append(f"{name} must be a CUDA tensor (it is on {t.device})")
        elif device is not None and t.device.index != device:
            problems.append(f"{name} is on {t.device}; this op runs on cuda:{device}")
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name} has shape {tuple(t.shape)}; this op was built for {tuple(shape)}")
        if t.dtype != dtype:
            problems.append(f"{name} is {t.dtype}; this op was built for {dtype}")
        if name in strided_ok:
            continue
        if not t.is_contiguous():
            problems.append(f"{name} must be contiguous (row-major; call .contiguous())")
        elif getattr(t, "is_cuda", False) and t.data_ptr() % 16:
            problems.append(f"{name} must start 16-byte aligned for TMA (it starts at {t.data_ptr():#x})")
    if problems:
        raise InputError(f"{op}: " + "; ".join(problems))


def check_output(op: str, out, shape, dtype, device: int | None, inputs=()) -> None:
    """``out``: a contiguous, 16-byte aligned CUDA tensor of ``shape`` and ``dtype`` on ``device``
    that shares no byte with ``inputs`` (the op writes it while it still reads them)."""
    ok = hasattr(out, "is_cuda") and out.is_cuda and tuple(out.shape) == tuple(shape) and out.dtype == dtype and \
        out.is_contiguous() and out.data_ptr() % 16 == 0 and (device is None or out.device.index == device)
    if not ok:
        raise InputError(f"{op}: out must be a contiguous, 16-byte aligned CUDA tensor {tuple(shape)} of {dtype}"
                         + (f" on cuda:{device}" if device is not None else ""))
    span = byte_span(out)
    for name, t in inputs:
        if _meet(span, byte_span(t)):
            raise InputError(f"{op}: out overlaps {name} in memory; the op writes out while it still reads "
                             f"{name} — pass a separate tensor")


def dense(t):
    """``t`` itself where TMA and the copy engines can read it (contiguous and 16-byte aligned),
    else a dense copy (``.contiguous()`` would keep an unaligned view as it is)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    import torch
    return t.clone(memory_format=torch.contiguous_format)


def check_open(op: str, closed: bool) -> None:
    if closed:
        raise InputError(f"{op} was closed (its symmetric workspace is released); build a new one")
