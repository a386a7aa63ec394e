"""Run a traced program on one GPU: every rank's memory, every part lowered, compiled (cached),
loaded, bound and launched, each launch waited for with a timeout, the results read back.

The steps, one function each: lowering (:func:`.run_plan.lower_for_run`) and the check that
every parameter can be bound (:func:`.bind.check_bindings`: no GPU needed), :func:`prepare`
(compile, load, plan the grids: everything that can refuse does so before any memory is
touched), :func:`allocate` (every rank's tensors — the
inputs copied, workspaces poisoned as the simulator poisons them — and int64 signal counters at
zero, each rank's separate), :func:`enqueue_launch` (fork from the caller's stream, each planned
kernel or copy-engine part on its own stream, join), :func:`wait_for` (the launch's end, or a
:class:`~.run_errors.GpuHangError` after the timeout), :func:`read_back`.

Launches count from 1 (the epoch the waits count in: ``ir.semantics.wait_target``); signal
counters are zeroed once, before the first, and only grow. Launch ``L + 1`` starts after every
stream of launch ``L`` finished, as the simulator runs them.
"""
from __future__ import annotations

import random
import time

import numpy as np

from ...ir.types import bfloat16
from ..dist.plan_exec import DeviceArray, PlanExecutor
from ..sim.memory import poison_value, to_storage
from .bind import DeviceMemory, array_dtype, bind, check_bindings, is_kernel, pack, pointer_table
from .device import check, require_gpu, sm_count
from .module import load_kernel
from .run_errors import GpuHangError, GpuRunError
from .run_plan import RunPlan, lower_for_run, plan_run
from .run_result import RunResult

_TORCH = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "i32": "int32", "i1": "bool"}
#: seconds the host waits past the kernels' own wait timeout before it calls a launch hung
HOST_SLACK_S = 5.0
_STREAMS: dict[int, list[int]] = {}      # context -> driver streams this module created (reused, never destroyed)


def run_program(ir, per_rank: list[list], *, launches: int = 1, seed: int = 0, timeout_s: float | None = 60.0,
                lowering: dict | None = None, progress=None) -> RunResult:
    """Run ``ir`` (traced for W ranks) with ``per_rank[r]`` the arguments of rank ``r`` in order."""
    import torch
    wait_ns = None if timeout_s is None else int(timeout_s * 1e9)
    lowered = lower_for_run(ir, wait_timeout_ns=wait_ns, **dict(lowering or {}))
    check_bindings(ir, lowered)             # a parameter nothing can pass: refused here, GPU or not
    name = require_gpu()
    plan, loaded = prepare(ir, lowered, progress)
    device = torch.device("cuda", torch.cuda.current_device())
    tensors, mem = allocate(ir, per_rank, device)
    args = {(k.rank, k.part): pack(bind(k.lowered, k.rank, mem)) for k in plan.kernels}
    copies = {(c.rank, c.part): PlanExecutor(c.plan, c.rank, pointer_table(mem, c.rank, c.plan))
              for c in plan.copies}
    origin = torch.cuda.current_stream().cuda_stream
    streams = driver_streams(len(plan.items)) if len(plan.items) > 1 else [origin]
    rng = random.Random(seed)
    launch_ms = []
    for launch in range(1, launches + 1):
        order = list(plan.items)
        rng.shuffle(order)          # the seed picks the order the ranks' work is enqueued in
        start, end = enqueue_launch(plan, order, launch, loaded, args, copies, origin, streams)
        wait_for(end, launch, plan, mem, timeout_s)
        launch_ms.append(_elapsed_ms(start, end))
        _destroy((start, end))
    outputs, workspaces = read_back(ir, tensors)
    return RunResult(ir, outputs, workspaces, [], 0, launches, seed, 0, device=name, plan=plan, launch_ms=launch_ms,
                     tensors=tensors)


# -- before anything runs ---------------------------------------------------------------------------

def prepare(ir, lowered: dict, progress=None) -> tuple[RunPlan, dict]:
    """Compile the lowered kernels (NVRTC's pool; cached), load them, and plan the launch on
    this GPU. Returns the plan and ``{entry: LoadedKernel}``."""
    from ...codegen.toolchain.compiler import compile_many
    kernels = {lk.entry: lk for lk in lowered.values() if is_kernel(lk)}
    compiled = compile_many([lk.job() for lk in kernels.values()], progress=progress) if kernels else []
    loaded = {entry: load_kernel(c.cubin, entry, lk.smem_bytes) for (entry, lk), c in zip(kernels.items(), compiled)}
    plan = plan_run(ir, lowered, sm_count=sm_count(), occupancy=lambda lk: occupancy(loaded[lk.entry], lk))
    return plan, loaded


def occupancy(kernel, lowered) -> int:
    """CTAs of ``kernel`` one SM holds at once (the driver's answer)."""
    from cuda.bindings import driver as cu
    return int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.function, lowered.block[0],
                                                                     lowered.smem_bytes),
                     f"cuOccupancyMaxActiveBlocksPerMultiprocessor({lowered.entry})"))


def allocate(ir, per_rank: list[list], device) -> tuple[list[dict], DeviceMemory]:
    """Every rank's tensors (arguments copied from the inputs, workspaces poisoned) and signal
    counters (int64, zero), each rank's separate; the tables of peer addresses are uploaded
    when a kernel's binding first asks for them."""
    import torch
    from ..dist.comm_kernel import torch_uploader
    tensors, buffers, signals = [], [], []
    for r, arrays in enumerate(per_rank):
        mine = {}
        for b, arr in zip(ir.args, arrays):
            mine[b.name] = to_device(arr, b.type.dtype, device)
        for b in ir.workspaces:
            mine[b.name] = torch.full(tuple(b.type.shape), poison_value(b.type.dtype),
                                      dtype=getattr(torch, _TORCH[b.type.dtype.name]), device=device)
        sigs = {s.name: torch.zeros(int(s.type.slots), dtype=torch.int64, device=device) for s in ir.signals}
        tensors.append({**mine, **{f"signal:{k}": v for k, v in sigs.items()}})
        buffers.append({b.name: DeviceArray(mine[b.name].data_ptr(), tuple(b.type.shape), array_dtype(b.type.dtype),
                                            owner=mine[b.name]) for b in ir.buffers})
        signals.append({n: DeviceArray(t.data_ptr(), tuple(t.shape), "i64", owner=t) for n, t in sigs.items()})
    return tensors, DeviceMemory(len(per_rank), buffers, signals, torch_uploader,
                                 lambda spec, address: spec.encode(address))


def to_device(arr, dtype, device):
    """A fresh contiguous CUDA tensor of IR ``dtype`` holding ``arr`` (a torch tensor anywhere, or
    anything numpy takes, stored as the simulator stores it: bf16 rounded to nearest even)."""
    import torch
    want = getattr(torch, _TORCH[dtype.name])
    if isinstance(arr, torch.Tensor):
        return arr.detach().to(device=device, dtype=want).contiguous().clone()
    host = np.ascontiguousarray(to_storage(np.array(arr, copy=True), dtype))
    return torch.from_numpy(host).to(device=device).to(want).contiguous()


# -- a launch ---------------------------------------------------------------------------------------

def driver_streams(n: int) -> list[int]:
    """``n`` distinct non-blocking streams of the current context (created once, reused)."""
    from cuda.bindings import driver as cu
    pool = _STREAMS.setdefault(int(_context()), [])
    while len(pool) < n:
        s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        pool.append(int(s))
    return pool[:n]


def _event(timing: bool = False):
    from cuda.bindings import driver as cu
    flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
    return check(cu.cuEventCreate(flags), "cuEventCreate")


def _destroy(events) -> None:
    """Events are freed once the work they follow is done (the driver defers it)."""
    from cuda.bindings import driver as cu
    for ev in events:
        cu.cuEventDestroy(ev)


def _record(ev, stream: int) -> None:
    from cuda.bindings import driver as cu
    check(cu.cuEventRecord(ev, stream), "cuEventRecord")


def _wait_event(stream: int, ev) -> None:
    from cuda.bindings import driver as cu
    check(cu.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")


def enqueue_launch(plan: RunPlan, order, launch: int, loaded: dict, args: dict, copies: dict, origin: int,
                   streams: list[int]):
    """Launch ``launch`` of every planned item, in ``order``, each on its stream, after the
    caller's stream's work; the caller's stream waits for all of them. Returns the (timing)
    events recorded on the caller's stream before and after."""
    from .launch import launch as launch_kernel
    start, end = _event(timing=True), _event(timing=True)
    joins = []
    _record(start, origin)
    forked = any(s != origin for s in streams)
    if forked:
        for s in streams:
            _wait_event(s, start)
    for item in order:
        s = streams[item.stream]
        if hasattr(item, "lowered"):
            argpack, slot = args[(item.rank, item.part)]
            if slot is not None:
                argpack.set(slot, launch)
            launch_kernel(loaded[item.lowered.entry], item.grid, item.block, argpack, s, item.cluster)
        else:
            copies[(item.rank, item.part)].enqueue(s, launch)
    if forked:
        for s in streams:
            done = _event()
            joins.append(done)
            _record(done, s)
            _wait_event(origin, done)
    _record(end, origin)
    _destroy(joins)
    return start, end


def wait_for(end, launch: int, plan: RunPlan, mem: DeviceMemory, timeout_s: float | None) -> None:
    """Block until event ``end`` completes; past ``timeout_s`` (plus :data:`HOST_SLACK_S`) a
    :class:`GpuHangError` with what was launched and every signal's counters."""
    from cuda.bindings import driver as cu
    deadline = None if timeout_s is None else time.monotonic() + timeout_s + HOST_SLACK_S
    pause = 1e-5
    while True:
        err = _result(cu.cuEventQuery(end))
        if err == cu.CUresult.CUDA_SUCCESS:
            return
        if err != cu.CUresult.CUDA_ERROR_NOT_READY:
            _, name = cu.cuGetErrorName(err)
            name = name.decode() if name else str(err)
            if timeout_s is not None and ("LAUNCH_FAILED" in name or "ILLEGAL_INSTRUCTION" in name):
                raise GpuHangError(f"launch {launch} failed ({name}): most likely a wait timed out after {timeout_s} s "
                                   f"in a kernel and trapped (the kernel printed the slot, the value it held and the one it "
                                   f"needed). A wait nothing satisfies: check the program with tl.simulate. "
                                   f"What ran:\n{plan.describe()}")
            raise GpuRunError(f"launch {launch} failed on the GPU ({name}); the CUDA context is unusable now. "
                              f"What ran:\n{plan.describe()}")
        if deadline is not None and time.monotonic() > deadline:
            raise GpuHangError(f"launch {launch} did not finish in {timeout_s + HOST_SLACK_S:.0f} s: a wait nothing "
                               f"satisfies (check the program with tl.simulate), or the kernels could not all run at "
                               f"once. The GPU is still busy with it. What ran:\n{plan.describe()}\n"
                               f"signal counters: {read_counters(mem)}")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)


def read_counters(mem: DeviceMemory, patience_s: float = 2.0) -> str:
    """Every rank's signal counters, read on a stream of their own while the launch may still
    spin (best effort: 'unreadable' where the copy does not finish in ``patience_s``)."""
    import ctypes
    from cuda.bindings import driver as cu
    out = []
    try:
        stream = driver_streams(1 + len(_STREAMS.get(int(_context()), [])))[-1]      # one no launch uses
        for r, sigs in enumerate(mem.signals):
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


def _result(res):
    """The CUresult of a driver call that returns nothing else."""
    return res[0] if isinstance(res, tuple) else res


def _context():
    from .device import current_context
    return current_context()


def _elapsed_ms(start, end) -> float:
    from cuda.bindings import driver as cu
    return float(check(cu.cuEventElapsedTime(start, end), "cuEventElapsedTime"))


# -- after ------------------------------------------------------------------------------------------

def read_back(ir, tensors: list[dict]) -> tuple[list[dict], list[dict]]:
    """Every rank's arguments and workspaces as numpy arrays in the simulator's storage types
    (bf16 as float32)."""
    def host(t, dtype):
        if dtype.name == bfloat16.name:
            t = t.float()
        return t.cpu().numpy()
    outputs = [{b.name: host(ts[b.name], b.type.dtype) for b in ir.args} for ts in tensors]
    workspaces = [{b.name: host(ts[b.name], b.type.dtype) for b in ir.workspaces} for ts in tensors]
    return outputs, workspaces
