"""The GPU as ``tl.run`` uses it: torch's allocator and current stream, and the CUDA driver calls
(cuda-python) that compile-and-load, size, launch, order and wait — every one checked.

:func:`~.run_program.run_program` asks only these methods of its device, so the host tests can
hand it a fake one that runs each kernel's tile program in the simulator's rules on CPU tensors
(tests/test_run_fake_device.py): the orchestration is tested where there is no GPU."""
from __future__ import annotations

import ctypes
import time

from .device import check, current_context, require_gpu, sm_count
from .module import load_kernel

_STREAMS: dict[int, list[int]] = {}      # context -> driver streams created here (reused, never destroyed)


def _driver():
    from cuda.bindings import driver
    return driver


def _result(res):
    """The CUresult of a driver call that returns nothing else."""
    return res[0] if isinstance(res, tuple) else res


class CudaDevice:
    """The current CUDA device of torch."""

    def __init__(self):
        import torch
        self.name = require_gpu()
        self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self.sm_count = sm_count()
        self.ce_driver = None                    # PlanExecutor's default: cuda.bindings.driver

    # -- kernels ----------------------------------------------------------------------------------
    def load(self, kernels: dict, progress=None) -> dict:
        """``{entry: lowered}`` compiled together (NVRTC's pool; cached) and loaded; a kernel that
        checks wait counts at run time records failures in :attr:`run_checks`."""
        from ...codegen.toolchain.compiler import compile_many
        from .run_checks import checks_counts
        compiled = compile_many([lk.job() for lk in kernels.values()], progress=progress) if kernels else []
        loaded = {entry: load_kernel(c.cubin, entry, lk.smem_bytes) for (entry, lk), c in zip(kernels.items(), compiled)}
        for entry, lk in kernels.items():
            if checks_counts(lk):
                self.run_checks.attach(loaded[entry].module, entry)
        return loaded

    @property
    def run_checks(self):
        """The word this context's kernels record a failed run-time check in (:mod:`.run_checks`)."""
        from .run_checks import word_for_context
        return word_for_context()

    def occupancy(self, kernel, lowered) -> int:
        """CTAs of ``kernel`` one SM holds at once (the driver's answer)."""
        cu = _driver()
        return int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.function, lowered.block[0],
                                                                         lowered.smem_bytes),
                         f"cuOccupancyMaxActiveBlocksPerMultiprocessor({lowered.entry})"))

    def launch(self, kernel, item, args, stream: int) -> None:
        from .launch import launch
        launch(kernel, item.grid, item.block, args, stream, item.cluster)

    # -- memory -----------------------------------------------------------------------------------
    def free_memory(self) -> int:
        """Bytes this process could still allocate on the device: the driver's free memory and
        what torch's allocator holds unused."""
        import torch
        free, _ = torch.cuda.mem_get_info(self.torch_device)
        return int(free + torch.cuda.memory_reserved(self.torch_device) - torch.cuda.memory_allocated(self.torch_device))

    def upload(self, values):
        from .plan_exec import torch_uploader
        return torch_uploader(values)

    def encode_tma(self, spec, address: int) -> bytes:
        return spec.encode(address)

    # -- streams and events -------------------------------------------------------------------------
    def origin(self) -> int:
        """The caller's stream: torch's current stream."""
        import torch
        return torch.cuda.current_stream().cuda_stream

    def streams(self, n: int) -> list[int]:
        """``n`` distinct non-blocking streams (created once per context, reused)."""
        cu = _driver()
        pool = _STREAMS.setdefault(int(current_context()), [])
        while len(pool) < n:
            pool.append(int(check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")))
        return pool[:n]

    def torch_stream(self, handle: int):
        """torch's view of raw stream ``handle`` (for callers that enqueue torch work on it)."""
        import torch
        return torch.cuda.ExternalStream(handle, device=self.torch_device)

    def event(self, timing: bool = False):
        cu = _driver()
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return check(cu.cuEventCreate(flags), "cuEventCreate")

    def record(self, event, stream: int) -> None:
        check(_driver().cuEventRecord(event, stream), "cuEventRecord")

    def wait_event(self, stream: int, event) -> None:
        check(_driver().cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def destroy(self, events) -> None:
        """Freed once the work they follow is done (the driver defers it)."""
        for ev in events:
            _driver().cuEventDestroy(ev)

    def query(self, event) -> str | None:
        """None once ``event`` completed, ``"not ready"`` before, else the driver's error name."""
        cu = _driver()
        err = _result(cu.cuEventQuery(event))
        if err == cu.CUresult.CUDA_SUCCESS:
            return None
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return "not ready"
        _, name = cu.cuGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(err)

    def elapsed_ms(self, start, end) -> float:
        return float(check(_driver().cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def read_counters(self, signals, patience_s: float = 2.0) -> str:
        """Every rank's signal counters (``signals[r][name]``: DeviceArrays), copied on a stream of
        their own while a launch may still spin (best effort: where the copy does not finish in
        ``patience_s``, the rest are unreadable)."""
        cu = _driver()
        out = []
        try:
            stream = self.streams(len(_STREAMS.get(int(current_context()), [])) + 1)[-1]   # one no launch uses
            for r, sigs in enumerate(signals):
                for name, arr in sigs.items():
                    host = (ctypes.c_int64 * arr.numel)()
                    check(cu.cuMemcpyDtoHAsync(int(ctypes.addressof(host)), arr.ptr, arr.nbytes, stream),
                          "cuMemcpyDtoHAsync")
                    t0 = time.monotonic()
                    while _result(cu.cuStreamQuery(stream)) != cu.CUresult.CUDA_SUCCESS:
                        if time.monotonic() - t0 > patience_s:
                            return "; ".join(out + ["the rest unreadable (the copy did not finish)"])
                        time.sleep(1e-3)
                    out.append(f"rank {r} {name}={list(host)}")
        except Exception as e:      # noqa: BLE001 - a diagnostic of a failure must not hide the failure
            out.append(f"unreadable ({type(e).__name__}: {e})")
        return "; ".join(out) or "none"
