"""The GPU runtime: load NVRTC cubins through the CUDA driver API (cuda-python), encode TMA
descriptors on the host, and launch on torch's current stream with torch tensors.

Every driver call is checked; where there is no GPU (or no torch / cuda-python) the first
use raises :class:`GPUUnavailableError` with the reason — never a crash.
"""
from .device import GPUUnavailableError, gpu_available, require_gpu
from .module import LoadedKernel, load_kernel
from .gemm import GemmKernel

__all__ = ["GPUUnavailableError", "gpu_available", "require_gpu", "LoadedKernel", "load_kernel", "GemmKernel"]
