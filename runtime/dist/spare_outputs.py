"""The next call's output tensors, allocated at the end of this call.

A fused op's GEMM takes its outputs' addresses as arguments, so they must exist before it is
handed to the driver — and with the device idle when the op is called, the host's time until
then is the op's. ``torch.empty`` costs 6–6.5 µs a tensor on the benchmark machine (2× H200,
measured beside the driver calls in BENCHMARKS.md): two of them were half of AG+GEMM's host
time before its GEMM was handed over.
So a call ends by allocating the next call's outputs on its stream, off the critical path (the
GEMM is already enqueued), and the next call on that stream takes them. The semantics are those of
allocating at the call's start: the caching allocator orders memory by stream, and a call on
another stream allocates afresh (the spares are freed).

The price is one call's outputs held between calls; :func:`keep_spares` keeps them only where
they are small, which is where a GEMM is short enough for the host's microseconds to matter.
``spare_outputs=`` on the op decides by hand; ``TLDSL_SPARE_OUTPUTS=0`` (or ``1``) decides for every
op that was not told (the torch custom ops among them).
"""
from __future__ import annotations

#: outputs up to this size are kept spare by default (an H200 has 141 GB; at this size a GEMM
#: takes ~1 ms or less, so 13 µs of allocation is 1% or more of it)
SPARE_LIMIT_BYTES = 256 << 20


def keep_spares(requested: bool | None, nbytes: int) -> bool:
    """``requested`` if given, else ``TLDSL_SPARE_OUTPUTS`` if set, else whether ``nbytes`` of
    outputs are small enough to keep spare."""
    if requested is None:
        from ... import env
        chosen = (env.get("TLDSL_SPARE_OUTPUTS") or "").strip()
        if chosen:
            if chosen not in ("0", "1"):
                from ...errors import InputError
                raise InputError(f"TLDSL_SPARE_OUTPUTS={chosen!r}: 0 (never keep spare outputs) or 1 (always)")
            return chosen == "1"
        return nbytes <= SPARE_LIMIT_BYTES
    if not isinstance(requested, bool):
        from ...errors import InputError
        raise InputError(f"spare_outputs={requested!r}: True, False or None (by size)")
    return requested


class SpareOutputs:
    """The spare A_gathered and C of an AllGather+GEMM, for its next call on the same stream.
    Holds plain values only (shapes, dtype, device): no reference back to the op, so dropping the
    op frees its symmetric memory at once."""

    NAMES = ("a_gathered", "c")

    def __init__(self, gathered_shape, c_shape, dtype, device, requested: bool | None):
        self.shapes = {"a_gathered": tuple(gathered_shape), "c": tuple(c_shape)}
        self.dtype, self.device = dtype, device
        nbytes = sum(_numel(shape) for shape in self.shapes.values()) * dtype.itemsize
        self.enabled = keep_spares(requested, nbytes)
        self._stream: int | None = None
        self._spares: dict = {}

    def new(self, name: str):
        """A fresh output ``name``, allocated now on the current stream."""
        import torch
        return torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)

    def take(self, stream: int) -> dict:
        """The spares allocated for a call on ``stream`` (empty if none, or another stream's:
        those are dropped). Each is handed out once."""
        spares, self._spares = self._spares, {}
        return spares if self._stream == stream else {}

    def refill(self, stream: int, with_c: bool) -> None:
        """After a call on ``stream``: allocate the next call's outputs (C only if this call
        allocated its own — a caller passing ``out=`` gets no spare C)."""
        if self.enabled:
            self._stream = stream
            self._spares = {n: self.new(n) for n in (self.NAMES if with_c else self.NAMES[:1])}

    def clear(self) -> None:
        self._spares = {}

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._spares.values())


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n
