"""Run a traced program on one GPU: every rank's memory, every part lowered, compiled (cached),
loaded, bound and launched, each launch waited for with a timeout, the results read back.

The steps, one function each: lowering (:func:`.run_plan.lower_for_run`) and the check that
every parameter can be bound (:func:`.bind.check_bindings`: no GPU needed); :func:`prepare`
(compile, load, plan the grids: everything that can refuse does so before any memory is
touched); :func:`allocate` (every rank's tensors — the inputs copied, workspaces poisoned as the
simulator poisons them — and int64 signal counters at zero, each rank's separate);
:func:`enqueue_launch` (fork from the caller's stream, each planned kernel or copy-engine part on
its own stream, join); :func:`wait_for` (the launch's end, or a
:class:`~.run_errors.GpuHangError` after the timeout); :func:`read_back`.

Launches count from 1 (the epoch the waits count in: ``ir.semantics.wait_target``); signal
counters are zeroed once, before the first, and only grow. Launch ``L + 1`` starts after every
stream of launch ``L`` finished, as the simulator runs them. The device (driver calls, torch's
allocator and stream) is :class:`.cuda_device.CudaDevice` unless one is passed.
"""
from __future__ import annotations

import math
import random
import time

import numpy as np

from ...codegen.dtypes import elem_bytes
from ...errors import InputError
from ...ir.opdefs import written_arguments
from ...ir.types import bfloat16
from .plan_exec import DeviceArray, PlanExecutor
from ..sim.memory import poison_value, to_storage
from .bind import (SCRATCH_POISON_WORD, DeviceMemory, array_dtype, bind, check_bindings, is_kernel, pack,
                   pointer_table)
from .run_checks import failure as run_check_failure
from .run_errors import GpuHangError, GpuRunError
from .run_plan import RunPlan, lower_for_run, plan_run, reserve_hardware_queues
from .run_result import RunResult
from .scratch_fit import HEADROOM_BYTES

_TORCH = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "i32": "int32", "i1": "bool"}
#: seconds the host waits past the kernels' own wait timeout before it calls a launch hung
HOST_SLACK_S = 5.0


def run_program(ir, per_rank: list[list], *, launches: int = 1, seed: int = 0, timeout_s: float | None = 60.0,
                lowering: dict | None = None, progress=None, device=None, sms: int | None = None) -> RunResult:
    """Run ``ir`` (traced for W ranks) with ``per_rank[r]`` the arguments of rank ``r`` in order, on
    ``sms`` of the device's SMs (None: all)."""
    wait_ns = None if timeout_s is None else int(timeout_s * 1e9)
    lowering = dict(lowering or {})
    chain = lowering.get("chain", "after")  # where chained parts run: lowered and planned alike
    lowered = lower_for_run(ir, wait_timeout_ns=wait_ns, **lowering)
    check_bindings(ir, lowered)             # a parameter nothing can pass: refused here, GPU or not
    if device is None:
        from .cuda_device import CudaDevice
        from .device import cuda_context_exists
        reserve_hardware_queues(ir, lowered, cuda_context_exists)
        device = CudaDevice()
    if sms is not None and sms > device.sm_count:
        raise InputError(f"sms={sms}: the GPU ({device.name}) has {device.sm_count} SMs")
    plan, loaded = prepare(ir, lowered, device, progress, chain, sms)
    tensors, mem = allocate(ir, per_rank, device)
    args = {(k.rank, k.part): pack(bind(k.lowered, k.rank, mem, ctas=k.ctas)) for k in plan.kernels}
    copies = {(c.rank, c.part): PlanExecutor(c.plan, c.rank, pointer_table(mem, c.rank, c.plan),
                                             driver=device.ce_driver) for c in plan.copies}
    origin = device.origin()
    streams = device.streams(plan.streams) if plan.streams > 1 else [origin]
    rng = random.Random(seed)
    launch_ms = []
    restore = restore_arguments(ir, tensors)
    checks = getattr(device, "run_checks", None)    # (the host tests' fake device checks in the simulator's rules)
    for launch in range(1, launches + 1):
        if launch > 1:
            restore()
        order = plan.shuffled(rng)  # the seed picks the order the ranks' work is enqueued in
        if checks is not None:
            checks.clear()
        start, end = enqueue_launch(device, order, launch, loaded, args, copies, origin, streams)
        wait_for(device, end, launch, plan, mem, timeout_s)
        launch_ms.append(device.elapsed_ms(start, end))
        device.destroy((start, end))
        if checks is not None and (failed := run_check_failure(ir, checks.read(), launch)) is not None:
            raise failed
    outputs, workspaces = read_back(ir, tensors)
    return RunResult(ir, outputs, workspaces, [], 0, launches, seed, 0, device=device.name, plan=plan,
                     launch_ms=launch_ms, tensors=tensors)


def restore_arguments(ir, tensors: list[dict]):
    """A function putting back the caller's values of the arguments ``ir`` writes (as the
    simulator does between launches: :func:`tldsl.runtime.sim.simulate.restore_arguments`), copied
    now; called between launches, after the last one finished (``wait_for``) and before the next
    is enqueued."""
    import torch
    args = written_arguments(ir)
    saved = [(t[b.name], t[b.name].clone()) for t in tensors for b in args]

    def restore():
        for tensor, original in saved:
            tensor.copy_(original)
        for device in {t.device for t, _ in saved if t.is_cuda}:
            torch.cuda.synchronize(device)      # the copies land before the next launch's streams start
    return restore


def prepare(ir, lowered: dict, device, progress=None, chain: str = "after",
            sms: int | None = None) -> tuple[RunPlan, dict]:
    """Compile and load the lowered kernels, and plan the launch on ``device``'s SMs (``sms`` of
    them, where given) with the driver's occupancy (chained parts where ``chain`` says). Returns
    the plan and ``{entry: loaded kernel}``."""
    loaded = device.load({lk.entry: lk for lk in lowered.values() if is_kernel(lk)}, progress)
    plan = plan_run(ir, lowered, sm_count=device.sm_count if sms is None else sms,
                    spare_sms=0 if sms is None else device.sm_count - sms,
                    occupancy=lambda lk: device.occupancy(loaded[lk.entry], lk), chain=chain,
                    scratch_budget=scratch_budget(ir, device))
    return plan, loaded


def scratch_budget(ir, device, ranks: int | None = None) -> int | None:
    """The bytes the kernels' global-memory scratch may take on ``device``: its free memory less
    the tensors and signals of the ``ranks`` it holds (None: every rank, as ``tl.run`` does),
    which are allocated next, and a headroom (:data:`~.scratch_fit.HEADROOM_BYTES`, or an eighth
    of what is left where less; None: the device does not say)."""
    free = getattr(device, "free_memory", None)
    if free is None:
        return None
    tensors = sum(math.prod(b.type.shape) * elem_bytes(b.type.dtype) for b in (*ir.args, *ir.workspaces))
    signals = sum(int(s.type.slots) * 8 for s in ir.signals)
    left = free() - (ir.world_size if ranks is None else ranks) * (tensors + signals)
    return left - min(HEADROOM_BYTES, max(left, 0) // 8)


def allocate(ir, per_rank: list[list], device) -> tuple[list[dict], DeviceMemory]:
    """Every rank's tensors (arguments copied from the inputs, workspaces poisoned) and signal
    counters (int64, zero; in ``tensors[r]`` as ``"signal:<name>"``), each rank's separate; the
    tables of peer addresses and the kernels' scratch (:func:`scratch_allocator`) are allocated
    when a kernel's binding first asks for them."""
    import torch
    at = device.torch_device
    tensors, buffers, signals = [], [], []
    for arrays in per_rank:
        mine = {b.name: to_device(arr, b.type.dtype, at) for b, arr in zip(ir.args, arrays)}
        for b in ir.workspaces:
            mine[b.name] = torch.full(tuple(b.type.shape), poison_value(b.type.dtype),
                                      dtype=getattr(torch, _TORCH[b.type.dtype.name]), device=at)
        sigs = {s.name: torch.zeros(int(s.type.slots), dtype=torch.int64, device=at) for s in ir.signals}
        tensors.append({**mine, **{f"signal:{k}": v for k, v in sigs.items()}})
        buffers.append({b.name: DeviceArray(mine[b.name].data_ptr(), tuple(b.type.shape), array_dtype(b.type.dtype),
                                            owner=mine[b.name]) for b in ir.buffers})
        signals.append({n: DeviceArray(t.data_ptr(), tuple(t.shape), "i64", owner=t) for n, t in sigs.items()})
    return tensors, DeviceMemory(len(per_rank), buffers, signals, device.upload, device.encode_tma,
                                 allocate=scratch_allocator(at))


def scratch_allocator(at):
    """A function allocating ``nbytes`` of poisoned memory on torch device ``at``: a kernel's
    scratch (:meth:`.bind.DeviceMemory.scratch`)."""
    def allocate(nbytes: int) -> DeviceArray:
        import torch
        t = torch.full((-(-nbytes // 8),), SCRATCH_POISON_WORD, dtype=torch.int64, device=at)
        return DeviceArray(t.data_ptr(), (t.numel(),), "u64", owner=t)
    return allocate


def to_device(arr, dtype, at):
    """A fresh contiguous tensor on torch device ``at`` of IR ``dtype`` holding ``arr`` (a torch
    tensor anywhere, or anything numpy takes, stored as the simulator stores it: bf16 rounded to
    nearest even)."""
    import torch
    want = getattr(torch, _TORCH[dtype.name])
    if isinstance(arr, torch.Tensor):
        return arr.detach().to(device=at, dtype=want).contiguous().clone()
    host = np.ascontiguousarray(to_storage(np.array(arr, copy=True), dtype))
    return torch.from_numpy(host).to(device=at).to(want).contiguous()


def enqueue_launch(device, order, launch: int, loaded: dict, args: dict, copies: dict, origin: int,
                   streams: list[int], watch=None, hoist: bool = False):
    """Launch ``launch`` of every planned item, in ``order``, each on its stream, after the
    caller's stream's work; the caller's stream waits for all of them. Returns the (timing)
    events recorded on the caller's stream before and after. ``watch(item, stream, when)``, if
    given, runs on the host before (``when="before"``) and after (``"after"``) each item's enqueue.
    ``hoist``: the copy-engine parts' hoistable same-GPU copies first, on the caller's stream,
    before anything is forked (:func:`~.plan_exec.hoistable`; planned with ``hoist_local_copies``)."""
    start, end = device.event(timing=True), device.event(timing=True)
    device.record(start, origin)
    fork, made = start, []
    if hoist:
        early = [item for item in order if not is_kernel(getattr(item, "lowered", None))
                 and any(copies[(item.rank, item.part)].hoisted)]
        for item in early:
            copies[(item.rank, item.part)].enqueue(origin, launch, only="hoisted")
        if early:
            fork = device.event()
            made.append(fork)
            device.record(fork, origin)
    forked = [s for s in streams if s != origin]
    for s in forked:
        device.wait_event(s, fork)
    for item in order:
        s = streams[item.stream]
        if watch is not None:
            watch(item, s, "before")
        if is_kernel(getattr(item, "lowered", None)):
            argpack, slot = args[(item.rank, item.part)]
            if slot is not None:
                argpack.set(slot, launch)       # the driver copies the arguments at the launch call
            device.launch(loaded[item.lowered.entry], item, argpack, s)
        else:
            copies[(item.rank, item.part)].enqueue(s, launch, only="rest" if hoist else "all")
        if watch is not None:
            watch(item, s, "after")
    joins = made
    for s in forked:
        done = device.event()
        joins.append(done)
        device.record(done, s)
        device.wait_event(origin, done)
    device.record(end, origin)
    device.destroy(joins)
    return start, end


#: what a timed-out wait's report (the kernels built to print it) says
_SLOT_REPORT = "the slot, the value it held and the one it needed"


def reports_slot(plan: RunPlan) -> bool:
    """Whether the kernels were built to print a timed-out wait's slot (while TLDSL_WAIT_TIMEOUT_NS
    was set)."""
    from ...codegen.abi import WAIT_REPORT_OPTION
    return any(WAIT_REPORT_OPTION in getattr(k.lowered, "options", ()) for k in plan.kernels)


def trap_report(plan: RunPlan, timeout_s: float) -> str:
    """Where a trapped wait's report is: printed by the kernels if they were built to, else how to
    have them print it."""
    if reports_slot(plan):
        return f"the kernel printed {_SLOT_REPORT}"
    # (the variable is also the fused ops' wait timeout: no shorter than this run's)
    return f"run again with TLDSL_WAIT_TIMEOUT_NS={int(timeout_s * 1e9)} set to have the kernel print {_SLOT_REPORT}"


def _stuck_report(plan: RunPlan, timeout_s: float) -> str:
    """The host's deadline passed before any trap: what a stuck wait's trap will print, or how to
    have it print that."""
    if reports_slot(plan):
        return f"and prints {_SLOT_REPORT}"
    return trap_report(plan, timeout_s)


def wait_for(device, end, launch: int, plan: RunPlan, mem: DeviceMemory, timeout_s: float | None) -> None:
    """Block until event ``end`` completes; past ``timeout_s`` (plus :data:`HOST_SLACK_S`) a
    :class:`GpuHangError` with what was launched and every signal's counters."""
    began = time.monotonic()
    deadline = None if timeout_s is None else began + timeout_s + HOST_SLACK_S
    pause = 1e-5
    while True:
        state = device.query(end)
        if state is None:
            return
        if state != "not ready":
            trapped = "LAUNCH_FAILED" in state or "ILLEGAL_INSTRUCTION" in state or \
                (timeout_s is not None and time.monotonic() - began >= timeout_s)
            if timeout_s is not None and trapped:
                raise GpuHangError(f"launch {launch} failed ({state}): most likely a wait timed out after "
                                   f"{timeout_s} s in a kernel and trapped ({trap_report(plan, timeout_s)}): a "
                                   f"wait nothing satisfies — check the program with tl.simulate. The CUDA "
                                   f"context of this process is unusable now. What ran:\n{plan.describe()}")
            raise GpuRunError(f"launch {launch} failed on the GPU ({state}); the CUDA context of this process is "
                              f"unusable now. What ran:\n{plan.describe()}")
        if deadline is not None and time.monotonic() > deadline:
            raise GpuHangError(f"launch {launch} did not finish in {timeout_s + HOST_SLACK_S:.0f} s: a wait nothing "
                               f"satisfies (check the program with tl.simulate), or the kernels could not all run at "
                               f"once. The GPU is still busy with it; a wait stuck {timeout_s} s traps "
                               f"({_stuck_report(plan, timeout_s)}). What ran:\n{plan.describe()}\n"
                               f"signal counters: {device.read_counters(mem.signals)}")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)


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
