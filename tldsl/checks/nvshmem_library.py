"""Does nvshmem4py drive the NVSHMEM library torch loads, once per process? (GPU host, torchrun)

    torchrun --standalone --nproc_per_node=1 -m tldsl.checks.nvshmem_library   (or 2: every rank checks)

Step by step, reading ``/proc/self/maps`` after each (the ``libnvshmem_host`` files mapped):

1. ``import torch`` and ``torch.distributed._symmetric_memory.is_nvshmem_available()`` (torch
   loads its NVSHMEM there if it had not): the file torch uses.
2. ``runtime/dist/nvshmem.py``'s bring-up, exactly as the ``transport='nvshmem'`` ops do it —
   :meth:`~tldsl.runtime.dist.nvshmem.Nvshmem.get` over the torch.distributed group (rank 0's
   unique id broadcast, ``nvshmemx_hostlib_init_attr``), every call through nvshmem4py's bindings.
3. Every function pointer nvshmem4py resolved (its ``_inspect_function_pointers``) must lie in
   torch's file's mapping, and exactly one ``libnvshmem_host`` file may be mapped; the library's
   version (``nvshmemx_vendor_get_version_info`` through nvshmem4py) is printed beside nvshmem4py's.
4. The calls the runtime makes work: ``nvshmem_malloc``, ``nvshmem_ptr`` (to this rank), a
   stream barrier, and an NVSHMEM header-only kernel loaded through
   :func:`~tldsl.runtime.gpu.module.load_kernel` (cuda.core), given NVSHMEM's device state by
   ``nvshmemx_cumodule_init`` and launched: its ``nvshmem_ptr``/``nvshmem_my_pe``/``nvshmem_n_pes``
   must agree with the host's; then ``nvshmem_free``.

Prints one ``PASS``/``FAIL`` line per step and exits non-zero on any FAIL.
"""
from __future__ import annotations

import ctypes
import os
import sys

PROBE = r'''#include "tldsl/comm_nvshmem.hpp"
extern "C" __global__ void tl_nvshmem_probe(unsigned long long* sym, unsigned long long* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    out[0] = (unsigned long long)nvshmem_ptr(sym, nvshmem_my_pe());
    out[1] = (unsigned long long)nvshmem_my_pe();
    out[2] = (unsigned long long)nvshmem_n_pes();
  }
}
'''


def mapped(name: str = "libnvshmem_host", maps: str = "/proc/self/maps") -> dict[str, list[tuple[int, int]]]:
    """``{real path: [(start, end), ...]}`` of every mapped file whose name contains ``name``."""
    out: dict[str, list[tuple[int, int]]] = {}
    with open(maps) as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and name in parts[5]:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.setdefault(os.path.realpath(parts[5].strip()), []).append((lo, hi))
    return out


def outside(pointers: dict[str, int], spans: list[tuple[int, int]]) -> list[str]:
    """The names of the non-null pointers that lie in none of ``spans``."""
    return sorted(k for k, p in pointers.items() if p and not any(lo <= p < hi for lo, hi in spans))


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world = dist.get_world_size()
    failures = []

    def report(step: str, ok: bool, detail: str) -> None:
        print(f"[rank {rank}] {'PASS' if ok else 'FAIL'} {step}: {detail}", flush=True)
        if not ok:
            failures.append(step)

    at_import = mapped()
    from torch.distributed import _symmetric_memory as symm
    available = symm.is_nvshmem_available()
    torch_files = mapped()
    report("torch's NVSHMEM", len(torch_files) == 1,
           f"is_nvshmem_available()={available}; mapped after import torch: {sorted(at_import) or 'none'}; "
           f"after is_nvshmem_available: {sorted(torch_files) or 'none'}")

    from types import SimpleNamespace
    from tldsl.runtime.dist import nvshmem as nvm
    import nvshmem
    ctx = SimpleNamespace(rank=rank, world_size=world, group=None, device=local)
    nv = nvm.Nvshmem.get(ctx)
    after = mapped()
    from nvshmem.bindings._internal import nvshmem as internal
    pointers = {k: int(v) for k, v in internal._inspect_function_pointers().items()}
    resolved = sum(1 for p in pointers.values() if p)
    spans = [s for f in torch_files for s in after.get(f, [])]
    stray = outside(pointers, spans)
    major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    nv.lib.vendor_get_version_info(ctypes.addressof(major), ctypes.addressof(minor), ctypes.addressof(patch))
    version = f"{major.value}.{minor.value}.{patch.value}"
    report("one library", len(after) == 1 and set(after) == set(torch_files) and not stray and resolved > 0,
           f"after Nvshmem.get (PE {nv.rank} of {nv.world_size}) mapped: {sorted(after)}; nvshmem4py "
           f"{nvshmem.__version__} resolved {resolved} of {len(pointers)} functions, "
           f"{len(stray)} outside torch's file{': ' + ', '.join(stray[:5]) if stray else ''}; libnvshmem {version}")
    try:
        from importlib import metadata
        wheel = metadata.version("nvidia-nvshmem-cu13")
    except Exception:   # noqa: BLE001 - the version line is information
        wheel = "?"
    report("version", version == wheel, f"libnvshmem_host reports {version}; nvidia-nvshmem-cu13 wheel {wheel}; "
           f"find_host_library() = {os.path.realpath(nvm.find_host_library())}")

    try:
        sym = nv.malloc(1 << 20)
        here = nv.peer_address(sym, rank)
        nv.barrier_on_stream(torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        from tldsl.codegen.toolchain.compiler import compile_cuda
        from tldsl.runtime.gpu.launch import ArgPack, launch
        from tldsl.runtime.gpu.module import load_kernel
        k = load_kernel(compile_cuda(PROBE, "tl_nvshmem_probe", options=["-D__NVSHMEM_NUMBA_SUPPORT__"]).cubin,
                        "tl_nvshmem_probe")
        nv.init_module(k.module)
        out = torch.zeros(3, dtype=torch.int64, device="cuda")
        pack = ArgPack()
        pack.add("ptr", sym)
        pack.add("ptr", out.data_ptr())
        launch(k, (1, 1, 1), (32, 1, 1), pack, torch.cuda.current_stream().cuda_stream)
        got = [int(x) for x in out.tolist()]
        want = [here, rank, world]
        nv.barrier_on_stream(torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        nv.free(sym)
        report("runtime calls", got == want and here == sym,
               f"nvshmem_malloc {sym:#x}, nvshmem_ptr(sym, {rank}) {here:#x}; kernel loaded by cuda.core, "
               f"nvshmemx_cumodule_init, launched: ptr/my_pe/n_pes {[hex(got[0])] + got[1:]} (want "
               f"{[hex(want[0])] + want[1:]}); barrier, free")
    except Exception as e:      # noqa: BLE001 - the step fails with its reason; the others were reported
        report("runtime calls", False, f"{type(e).__name__}: {e}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
