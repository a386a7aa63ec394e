"""What ``tl.run`` raises when a traced program cannot be launched, or did not finish.

Everything that can be known before a launch (a parameter nothing can pass, grids that cannot
all be resident at once) is raised before anything is enqueued: the GPU is left as it was."""
from __future__ import annotations

from ...errors import InputError, TldslError
from ...errors import RunCheckError  # noqa: F401  (defined there, so that tl.RunCheckError needs no GPU runtime)


class UnboundParameterError(InputError):
    """A lowered kernel takes a parameter ``tl.run`` has no value for (a scalar only the fused
    ops' own launchers pass, a tensor the program does not declare, ...). Nothing was launched."""


class ResidencyError(InputError):
    """The kernels of one launch cannot all be resident on the GPU at once, so a kernel waiting
    for another could wait forever. Nothing was launched; the message says what to shrink."""


class GpuRunError(TldslError):
    """A launch failed on the GPU (a kernel faulted or trapped); the CUDA context of this
    process is unusable afterwards (CUDA errors of this kind are sticky)."""


class GpuHangError(GpuRunError):
    """A launch did not finish within ``timeout_s``: a wait nothing satisfies (a
    mis-synchronised program), or a wait that timed out in a kernel and trapped."""
