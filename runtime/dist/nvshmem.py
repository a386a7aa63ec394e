"""NVSHMEM for ``transport='nvshmem'`` communication kernels: the host library brought up with
the unique-id bootstrap over a torch.distributed group, symmetric memory from its heap, and
``nvshmemx_cumodule_init`` for every module compiled in NVSHMEM's header-only mode.

Why the unique-id bootstrap rather than torch's NVSHMEM symmetric-memory backend: that backend
is process-global (``set_backend("NVSHMEM")``), and once selected torch's own async-TP ops fail
in the same process (measured on 2x H200, BENCHMARKS.md). Bootstrapping NVSHMEM ourselves
leaves torch's symmetric memory on its CUDA backend — async-TP keeps working beside us — and
uses the very library torch links (``libnvshmem_host.so.3`` of ``nvidia-nvshmem-cu13``, the
version whose device headers our kernels compile against).

The host calls go through nvshmem4py's bindings (``nvshmem.bindings`` of ``nvshmem4py-cu13``:
one wrapper per C function, raising on a failed status), not through hand-written ctypes
signatures. nvshmem4py resolves each function in the process's global symbol scope before it
``dlopen``s ``libnvshmem_host.so.3`` by name, so :func:`host_library` first loads the file of
``nvidia-nvshmem-cu13`` (the one torch links) globally: both call that one library, once per
process (``python -m tldsl.checks.nvshmem_library`` shows it on a GPU host: one file mapped,
every function nvshmem4py resolved inside it). nvshmem4py's ``nvshmem.core.init`` is not used:
it keeps its own initialisation state and logging, and its ``InitAttr`` is ``numpy.empty``
with the nested arguments opaque, so the version tags NVSHMEM's versioned structs carry would be
left unset. ctypes is kept for exactly that: the ``UniqueId``/``InitAttr`` structs below, with
every tag set (their addresses go to the bindings), and loading the library file by path.

Collective points (every rank of the group, same order): :meth:`Nvshmem.get` the first time
in a process (init), :class:`NvshmemWorkspace` construction (``nvshmem_malloc``) and the
release of its lease (``nvshmem_free``: its op's ``close()``, or its own
:meth:`~NvshmemWorkspace.close` when it has no op; :mod:`.symmetric`). Nothing is freed by
garbage collection: ``nvshmem_free`` is a collective.
"""
from __future__ import annotations

import ctypes
import os
from typing import Sequence

from ... import env
from ...errors import InputError, TldslError
from .regions import RegionWorkspace, layout_regions

#: ``NVSHMEMX_INIT_WITH_UNIQUEID`` (host/nvshmemx_api.h)
INIT_WITH_UNIQUEID = 1 << 3


class NvshmemError(TldslError):
    """The NVSHMEM host library is missing or one of its calls failed."""


# -- the ABI structs of NVSHMEM 3.4 (bootstrap_device_host/nvshmem_uniqueid.h, device_host/nvshmem_types.h)

class UniqueId(ctypes.Structure):
    """``nvshmemx_uniqueid_v1`` (128 bytes)."""
    _fields_ = [("version", ctypes.c_int), ("internal", ctypes.c_char * 124)]


class UniqueIdArgs(ctypes.Structure):
    """``nvshmemx_uniqueid_args_v1`` (24 bytes)."""
    _fields_ = [("version", ctypes.c_int), ("id", ctypes.POINTER(UniqueId)), ("myrank", ctypes.c_int),
                ("nranks", ctypes.c_int)]


class InitArgs(ctypes.Structure):
    """``nvshmemx_init_args_v1`` (128 bytes)."""
    _fields_ = [("version", ctypes.c_int), ("uid_args", UniqueIdArgs), ("content", ctypes.c_char * 96)]


class InitAttr(ctypes.Structure):
    """``nvshmemx_init_attr_v1`` (144 bytes)."""
    _fields_ = [("version", ctypes.c_int), ("mpi_comm", ctypes.c_void_p), ("args", InitArgs)]


ABI_SIZES = {"UniqueId": 128, "UniqueIdArgs": 24, "InitArgs": 128, "InitAttr": 144}


def _struct_version(struct) -> int:
    """NVSHMEM's versioned-struct tag: ``(1 << 16) + sizeof``."""
    return (1 << 16) + ctypes.sizeof(struct)


def new_unique_id() -> UniqueId:
    uid = UniqueId()
    uid.version = _struct_version(UniqueId)
    return uid


def init_attr() -> InitAttr:
    """An ``nvshmemx_init_attr_t`` with the version tags ``nvshmemx_init_init_attr_ver_only`` sets."""
    attr = InitAttr()
    attr.version = _struct_version(InitAttr)
    attr.args.version = _struct_version(InitArgs)
    attr.args.uid_args.version = _struct_version(UniqueIdArgs)
    return attr


def find_host_library() -> str:
    """``libnvshmem_host.so.3`` of the installed ``nvidia-nvshmem-cu13`` (or ``$TLDSL_NVSHMEM_HOSTLIB``)."""
    override = env.get("TLDSL_NVSHMEM_HOSTLIB")
    if override:
        if not os.path.exists(override):
            raise NvshmemError(f"TLDSL_NVSHMEM_HOSTLIB={override} does not exist")
        return override
    try:
        import nvidia
        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    for r in roots:
        cand = os.path.join(r, "nvshmem", "lib", "libnvshmem_host.so.3")
        if os.path.exists(cand):
            return cand
    raise NvshmemError("libnvshmem_host.so.3 not found: pip install nvidia-nvshmem-cu13==3.4.5 (the version the "
                       "kernels' NVSHMEM headers and torch use)")


def host_library():
    """nvshmem4py's ``nvshmem.bindings`` over the ``libnvshmem_host.so.3`` of :func:`find_host_library`."""
    path = find_host_library()
    # ctypes, to load that file by path into the global scope: nvshmem4py looks every function up
    # there first (then dlopen's the soname, which finds this file already loaded).
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    try:
        from nvshmem import bindings
    except ImportError as e:
        raise NvshmemError(f"transport='nvshmem' needs nvshmem4py ({e}): pip install nvshmem4py-cu13 (beside torch, "
                           "whose nvidia-nvshmem-cu13 it uses)") from e
    return bindings


class Nvshmem:
    """The process's NVSHMEM host library, initialised over one torch.distributed group.
    ``lib``: nvshmem4py's ``nvshmem.bindings`` (or a stand-in with its functions)."""

    _instance: "Nvshmem | None" = None

    def __init__(self, lib, rank: int, world_size: int, group=None):
        self.lib, self.rank, self.world_size, self.group = lib, rank, world_size, group
        self._modules: set[int] = set()

    @classmethod
    def get(cls, ctx, *, lib=None, broadcast=None) -> "Nvshmem":
        """The initialised library (collective the first time: rank 0's unique id reaches every
        rank through ``broadcast``, default ``torch.distributed.broadcast_object_list``)."""
        if cls._instance is not None:
            inst = cls._instance
            if (inst.rank, inst.world_size) != (ctx.rank, ctx.world_size):
                raise InputError(f"NVSHMEM is already initialised for rank {inst.rank} of {inst.world_size} in this "
                                 f"process; this op's group is rank {ctx.rank} of {ctx.world_size}")
            return inst
        single_node_defaults()
        if lib is None:
            lib = host_library()
        uid = new_unique_id()
        if ctx.rank == 0:
            _call(lib.get_uniqueid, "nvshmemx_get_uniqueid", ctypes.addressof(uid))
        raw = [bytes(uid)]
        (broadcast or _torch_broadcast(ctx))(raw)
        uid = UniqueId.from_buffer_copy(raw[0])
        attr = init_attr()
        _call(lib.set_attr_uniqueid_args, "nvshmemx_set_attr_uniqueid_args", ctx.rank, ctx.world_size,
              ctypes.addressof(uid), ctypes.addressof(attr))
        _call(lib.hostlib_init_attr, "nvshmemx_hostlib_init_attr", INIT_WITH_UNIQUEID, ctypes.addressof(attr))
        pe, n = lib.my_pe(), lib.n_pes()
        if (pe, n) != (ctx.rank, ctx.world_size):
            raise NvshmemError(f"NVSHMEM came up as PE {pe} of {n}, but this is rank {ctx.rank} of {ctx.world_size}")
        cls._instance = cls(lib, pe, n, getattr(ctx, "group", None))
        return cls._instance

    def malloc(self, nbytes: int) -> int:
        """``nvshmem_malloc`` (collective; same size on every rank)."""
        p = _call(self.lib.malloc, "nvshmem_malloc", int(nbytes))
        if not p:
            raise NvshmemError(f"nvshmem_malloc({nbytes}) failed: the symmetric heap is too small "
                               "(raise NVSHMEM_SYMMETRIC_SIZE)")
        return int(p)

    def free(self, ptr: int) -> None:
        _call(self.lib.free, "nvshmem_free", int(ptr))

    def peer_address(self, sym: int, pe: int) -> int:
        """``nvshmem_ptr(sym, pe)``: rank ``pe``'s copy as mapped here (NVLink peers only)."""
        p = _call(self.lib.ptr, "nvshmem_ptr", int(sym), int(pe))
        if not p:
            raise NvshmemError(f"rank {pe} is not reachable by load/store from rank {self.rank} (nvshmem_ptr "
                               "returned null): transport='nvshmem' kernels need NVLink peers")
        return int(p)

    def init_module(self, module) -> None:
        """``nvshmemx_cumodule_init`` once per loaded module: fills the module's copy of NVSHMEM's
        device state (header-only mode) before any launch."""
        handle = int(module)
        if handle in self._modules:
            return
        _ok(_call(self.lib.cumodule_init, "nvshmemx_cumodule_init", handle), "nvshmemx_cumodule_init")
        self._modules.add(handle)

    def barrier_on_stream(self, stream: int) -> None:
        """Stream-ordered barrier of every PE (NVSHMEM's own kernel)."""
        _call(self.lib.barrier_all_on_stream, "nvshmemx_barrier_all_on_stream", int(stream))


def single_node_defaults(environ=None) -> dict:
    """When every rank runs on this host (torchrun's ``WORLD_SIZE == LOCAL_WORLD_SIZE``): no
    remote transport (NVLink and loopback sockets are all it needs; probing for InfiniBand
    libraries is slow or fails on hosts without them), bootstrap sockets on the loopback
    interface, and no NVLink multicast (NVLS) — each only where the user set nothing."""
    env = os.environ if environ is None else environ
    set_ = {}
    if env.get("WORLD_SIZE") and env.get("WORLD_SIZE") == env.get("LOCAL_WORLD_SIZE"):
        for k, v in (("NVSHMEM_REMOTE_TRANSPORT", "none"), ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
            if k not in env:
                env[k] = v
                set_[k] = v
    return set_


def _ok(status, what: str) -> None:
    if status not in (0, None):
        raise NvshmemError(f"{what} failed with status {status}")


def _call(fn, what: str, *args):
    """``fn(*args)``; nvshmem4py's error for a failed status (its ``.status``) as an NvshmemError."""
    try:
        return fn(*args)
    except Exception as e:      # noqa: BLE001 - nvshmem4py's NVSHMEMError, or a binding that cannot run
        status = getattr(e, "status", None)
        raise NvshmemError(f"{what} failed with status {status}" if status is not None
                           else f"{what} failed: {type(e).__name__}: {e}") from e


def _torch_broadcast(ctx):
    def bcast(objs):
        import torch.distributed as dist
        dist.broadcast_object_list(objs, src=0, group=getattr(ctx, "group", None))
    return bcast


class NvshmemWorkspace(RegionWorkspace):
    """The :class:`~.comm_kernel.SymmetricWorkspace` interface on NVSHMEM's symmetric heap: one
    ``nvshmem_malloc`` carved into named regions, torch views of them, every rank's address
    (``nvshmem_ptr``). Building it is collective; so is :meth:`close`, the only way it is freed."""

    def __init__(self, ctx, specs: Sequence[tuple[str, str, Sequence[int], str]], *, align: int = 512,
                 nvshmem: Nvshmem | None = None, as_tensor=None, lease=None):
        import functools
        from .symmetric import Lease
        self.ctx = ctx
        self.nv = nvshmem or Nvshmem.get(ctx)
        self.regions, self.total_bytes = layout_regions(specs, align)
        self._own_lease = lease is None
        self.lease = lease or Lease(ctx, f"NVSHMEM workspace of {self.total_bytes} bytes", self)
        self.base = self.nv.malloc(self.total_bytes)
        self.lease.hold(f"NVSHMEM heap, {self.total_bytes} bytes", functools.partial(self.nv.free, self.base),
                        spans=[(self.base, self.base + self.total_bytes)])
        self.closed = False
        view = as_tensor or _torch_view
        self.addresses: dict[str, tuple[int, ...]] = {}
        self.tensors: dict[str, object] = {}
        for r in self.regions:
            sym = self.base + r.offset
            self.addresses[r.name] = tuple(sym if q == ctx.rank else self.nv.peer_address(sym, q)
                                           for q in range(ctx.world_size))
            t = view(sym, r.shape, r.dtype, ctx.device)
            self.tensors[r.name] = t
            if r.kind == "signal":
                t.zero_()
        self.barrier()                       # nobody notifies a counter before its owner zeroed it
        _synchronize()

    def barrier(self, stream=None, channel: int = 0, timeout_ms: int | None = None):
        """Stream-ordered barrier of every PE on ``stream`` (default: the current stream).
        NVSHMEM's barrier has no timeout: ``timeout_ms`` is accepted for the interface and
        ignored (the kernels' own debug wait timeouts still report a stuck rank)."""
        import torch
        s = stream if stream is not None else torch.cuda.current_stream()
        self.nv.barrier_on_stream(s.cuda_stream)

    def close(self) -> None:
        """Drop this workspace's views of the heap; with its own lease free the allocation now
        (collective: every rank, same point), else its op's ``close()`` does."""
        if not self.closed:
            self.closed = True
            self.lease.forget(self)
            if self._own_lease:
                self.lease.release()

    def _title(self) -> str:
        return f"NVSHMEM workspace: {self.total_bytes} bytes at {self.base:#x}"


_TYPESTR = {"f16": "<f2", "f32": "<f4", "i32": "<i4", "u64": "<i8", "u8": "|u1"}


def _torch_view(ptr: int, shape, dtype: str, device: int):
    """A torch tensor over device memory torch did not allocate (``__cuda_array_interface__``);
    bf16 goes through an int16 view (the interface has no bf16 type)."""
    import torch

    class _Mem:
        def __init__(self, typestr):
            self.__cuda_array_interface__ = {"shape": tuple(int(x) for x in shape), "typestr": typestr,
                                             "data": (int(ptr), False), "version": 3, "strides": None}
    with torch.cuda.device(device):
        if dtype == "bf16":
            return torch.as_tensor(_Mem("<i2"), device=f"cuda:{device}").view(torch.bfloat16)
        return torch.as_tensor(_Mem(_TYPESTR[dtype]), device=f"cuda:{device}")


def _synchronize():
    import torch
    torch.cuda.synchronize()
