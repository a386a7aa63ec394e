"""Pin a benchmark rank to the CPU cores next to its GPU (``--bind``).

A fused op's small shapes are host-bound: with the device idle when the op is called, every
microsecond before its first kernel reaches the GPU is the op's, and so is a rank whose host
was preempted or migrated to a far socket. Distributed benchmarks usually pin each rank to its
GPU's NUMA node (NCCL's tests, MLPerf); ``--bind`` does that for every candidate of the run
alike. The cores come from the GPU's PCI device in sysfs (``local_cpulist``), intersected with
the cores this process may use.
"""
from __future__ import annotations

import os


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_pci_address(device: int) -> str:
    """``dddd:bb:dd.f`` (lower case, as sysfs names it) of CUDA device ``device``."""
    import torch
    p = torch.cuda.get_device_properties(device)
    if all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    from cuda.bindings import runtime as rt
    err, bus = rt.cudaDeviceGetPCIBusId(32, device)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaDeviceGetPCIBusId({device}) failed: {err}")
    return (bus.decode() if isinstance(bus, bytes) else str(bus)).strip("\x00").lower()


def gpu_local_cpus(device: int, sysfs: str = "/sys/bus/pci/devices") -> set[int]:
    """The cores sysfs lists as local to the GPU and this process may run on (empty if unknown)."""
    try:
        with open(os.path.join(sysfs, gpu_pci_address(device), "local_cpulist")) as f:
            local = parse_cpulist(f.read())
    except (OSError, RuntimeError, ValueError):
        return set()
    return local & set(os.sched_getaffinity(0))


def bind_to_gpu(device: int) -> str:
    """Pin this process to its GPU's local cores; returns what was done, for the log."""
    cpus = gpu_local_cpus(device)
    if not cpus:
        return f"GPU {device}: no local cores known here, not bound"
    os.sched_setaffinity(0, cpus)
    return f"GPU {device}: bound to its {len(cpus)} local core(s) {min(cpus)}-{max(cpus)}"
