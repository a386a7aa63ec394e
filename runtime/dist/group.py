"""Who we are in the process group, and the symmetric-memory backend."""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

from ... import env
from ...errors import InputError
from ..gpu.device import require_gpu

# NVLink multicast can take a shared host's GPUs out of service: keep it off everywhere.
_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: int
    group: object
    group_name: str
    backend: str          # symmetric-memory backend in use


@functools.lru_cache(maxsize=None)
def _choose_backend() -> str:
    """torch's default (CUDA) symmetric-memory backend, unless TLDSL_SYMM_BACKEND=NVSHMEM.

    Why: the copy-engine path only needs every rank's address of a symmetric buffer
    (``buffer_ptrs``), which the CUDA backend gives; switching torch's process-wide backend
    to NVSHMEM breaks torch's own async-TP ops in the same process (measured: their
    allocations then fail), and users run both side by side."""
    backend = env.get("TLDSL_SYMM_BACKEND", "CUDA").upper()
    if backend == "NVSHMEM":
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.set_backend("NVSHMEM")
    return backend


def dist_context(group=None) -> DistContext:
    """The current rank's view of ``group`` (default: WORLD). torch.distributed must be
    initialised (torchrun + ``dist.init_process_group('nccl')``)."""
    import torch
    import torch.distributed as dist
    if group is not None and not isinstance(group, dist.ProcessGroup):    # (a falsy 0 or "" is no WORLD)
        raise InputError(f"group must be a torch.distributed process group (None: WORLD), got "
                         f"{type(group).__name__} {group!r}")
    for k, v in _SAFE_ENV.items():
        if os.environ.get(k, v) != v:
            raise InputError(f"{k}={os.environ[k]}: tldsl needs {k}={v} (NVLink multicast must stay off)")
        os.environ[k] = v
    require_gpu()
    if not dist.is_initialized():
        raise InputError("torch.distributed is not initialised: run under torchrun and call "
                         "torch.distributed.init_process_group('nccl') first")
    group = dist.group.WORLD if group is None else group
    return DistContext(dist.get_rank(group), dist.get_world_size(group), torch.cuda.current_device(), group,
                       group.group_name, _choose_backend())


def resolve_group(group_name):
    """The process group torch registered under ``group_name`` (what the torch ops take, as
    async-TP's do). An unknown name is an InputError listing the registered ones (torch's own
    error is a RuntimeError that names none)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    if not dist.is_initialized():
        raise InputError("torch.distributed is not initialised (run under torchrun, init_process_group('nccl'))")
    if not isinstance(group_name, str):
        raise InputError(f"group_name must be a process group's name (a str: group.group_name), "
                         f"got {type(group_name).__name__}")
    try:
        return c10d._resolve_process_group(group_name)
    except RuntimeError:
        known = sorted(getattr(getattr(c10d, "_world", None), "pg_names", {}).values())
        raise InputError(f"group_name {group_name!r}: no process group is registered under that name "
                         f"(registered: {known}); pass a group's .group_name, e.g. "
                         f"torch.distributed.group.WORLD.group_name") from None


_IR_DTYPES = {"bfloat16": "bf16", "float16": "f16", "bf16": "bf16", "f16": "f16"}


def dtype_name(dtype, op: str) -> str:
    """``bf16`` / ``f16`` for a torch dtype or its name — the fused ops' input dtypes;
    InputError naming ``op`` otherwise (before anything is built)."""
    s = str(dtype).replace("torch.", "")
    if s not in _IR_DTYPES:
        raise InputError(f"dtype {dtype}: {op} runs on bfloat16 or float16 inputs")
    return _IR_DTYPES[s]


def disagreements(configs: list[dict]) -> list[str]:
    """``key: rank r has x, rank q has y`` for every key the ranks' configurations differ in."""
    out = []
    for key in configs[0]:
        vals = [c.get(key) for c in configs]
        if any(v != vals[0] for v in vals):
            groups: list[tuple[object, list[int]]] = []      # (value, its ranks), in rank order
            for r, v in enumerate(vals):
                for gv, rs in groups:
                    if gv == v:
                        rs.append(r)
                        break
                else:
                    groups.append((v, [r]))
            out.append(f"{key}: " + ", ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} {v}"
                                              for v, rs in groups))
    return out


class _Build:
    """What :func:`built_alike` compares: set ``config`` once the op's sizes, dtype and schedule
    are resolved."""
    config: dict | None = None


@contextlib.contextmanager
def built_alike(op: str, group=None):
    """Wrap the part of an op's construction that validates and resolves it (everything before
    its first collective allocation), so that every rank leaves it alike: one collective at its
    end exchanges each rank's resolved configuration — or its error. A rank that failed raises
    its own error; its peers raise an InputError naming it (instead of entering the allocation
    and waiting for it for ever); ranks that resolved different sizes, dtypes or schedules all
    raise the same InputError. Without torch.distributed, or alone, it costs nothing."""
    build = _Build()
    try:
        yield build
    except Exception as e:
        _exchange(op, group, None, e)
        raise
    _exchange(op, group, build.config, None)


def _exchange(op: str, group, config: dict | None, error: Exception | None) -> None:
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return
    group = dist.group.WORLD if group is None else group
    W = dist.get_world_size(group)
    if W == 1:
        return
    mine = agreement_entry(config, error)
    every = [None] * W
    dist.all_gather_object(every, mine, group=group)
    check_agreement(op, every, error)


def agreement_entry(config: dict | None, error: Exception | None) -> dict:
    """What one rank contributes to the agreement check: its error, or its resolved configuration."""
    return {"error": f"{type(error).__name__}: {error}" if error is not None else None,
            "config": None if config is None else {k: repr(v) for k, v in config.items()}}


def check_agreement(what: str, every: list, error: Exception | None, differ: str = "built it differently") -> None:
    """The one agreement check of every collective build (the fused ops' and FusedProgram's), on
    every rank's :func:`agreement_entry`: a rank that failed returns here (it raises its own
    error); its peers raise an :class:`InputError` naming the first rank that failed; ranks whose
    configurations differ all raise the same InputError naming the differences."""
    if error is not None:
        return
    failed = [(q, e["error"]) for q, e in enumerate(every) if e["error"] is not None]
    if failed:
        q, why = failed[0]
        raise InputError(f"{what}: rank {q} could not build it ({why.splitlines()[0]})"
                         + (f"; and {len(failed) - 1} more rank(s)" if len(failed) > 1 else ""))
    diff = disagreements([e["config"] for e in every])
    if diff:
        raise InputError(f"{what}: the ranks {differ} — " + "; ".join(diff))


def init_ranks() -> str:
    """The start of a torchrun script (the checks, the benchmarks): NVLink multicast off where
    nothing says otherwise, the NCCL process group, this rank's GPU (``LOCAL_RANK``), torch
    symmetric memory enabled for WORLD (older torch needs it). Returns WORLD's group name."""
    import torch
    import torch.distributed as dist
    for k, v in _SAFE_ENV.items():
        os.environ.setdefault(k, v)
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))   # barriers know their GPU
    name = dist.group.WORLD.group_name
    enable_symmetric_memory(name)
    return name


def enable_symmetric_memory(group_name: str) -> None:
    """Older torch (< 2.8) needs a group enabled for symmetric memory; newer ones need nothing
    and deprecate the call (its warning silenced here)."""
    try:
        import warnings
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable_symm_mem_for_group(group_name)
    except Exception:   # noqa: BLE001 - newer torch needs no enabling
        pass
