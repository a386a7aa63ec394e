"""What every launcher of a generated kernel shares: the call, and the checks on signals."""
from __future__ import annotations

from ...errors import InputError
from .launch import launch


def signal_pointer(entry: str, name: str, signals, slots: int | None = None) -> int:
    """Device address of this rank's counters of signal ``name`` (an int64 CUDA tensor)."""
    import torch
    sig = (signals or {}).get(name)
    if sig is None or not isinstance(sig, torch.Tensor) or sig.dtype != torch.int64 or not sig.is_cuda \
            or not sig.is_contiguous() or (slots is not None and sig.numel() < slots):
        need = f"at least {slots} counters" if slots is not None else "counters"
        raise InputError(f"{entry} waits on or notifies signal '{name}': pass signals={{'{name}': a contiguous "
                         f"int64 CUDA tensor of {need}}}")
    return sig.data_ptr()


class Launcher:
    """Base of the kernel launchers: subclasses provide ``args(buffers, signals, launch_index,
    rank)`` (an ArgPack, after validating every input), ``kernel``, ``grid`` and ``lowered``."""

    def __call__(self, buffers: dict | None = None, *, signals=None, launch_index: int = 1, rank: int = 0,
                 stream=None, **named):
        """Launch on ``stream`` (default: torch's current stream); buffers by IR name, signals
        by name, ``launch_index`` the 1-based epoch the waits count in."""
        import torch
        buffers = dict(buffers or {}, **named)
        pack = self.args(buffers, signals, launch_index, rank)
        s = stream if stream is not None else torch.cuda.current_stream()
        launch(self.kernel, self.grid, self.lowered.block, pack, s.cuda_stream, self.lowered.cluster_dims)
