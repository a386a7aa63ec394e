"""Planning an SM communication kernel: its launch (threads, lanes, the order tasks are dealt
to CTAs), how each statement streams its tile through the CTA (chunk width, unroll), and its
ABI — the flat parameter list the runtime binds (the contract is in :mod:`..recipes.sm_comm`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...ir import core
from ..abi import (LAUNCH_PARAM, RANK_PARAM, KernelParam, buffer_param, entry_name, peer_buffer_param,
                   peer_signal_param, signal_param, table_param, wait_timeout_options)
from ..dtypes import ctype, elem_bytes
from ..errors import fail
from ..ir_queries import const_value
from ..match.comm import WHAT, CommMatch, Statement

DEFAULT_THREADS = 256
MAX_UNROLL = 8
CHUNK_REGISTERS = 32      # 32-bit registers per thread for the chunks a round keeps in flight


def task_decode(grid: tuple[int, ...], order: str) -> list[tuple[int, int, int | None]]:
    """How task index ``t`` of ``CommSchedule(order=...).task_order(grid)`` gives the program
    ids: one ``(axis, divisor, modulus)`` per axis, ``pid[axis] = t // divisor % modulus``
    (``modulus`` None: no modulo needed)."""
    n = len(grid)
    if order == "full_mesh" and n >= 2:
        axes = list(range(1, n)) + [0]        # sort key (c[1:], c[0]): c0 fastest, then row-major
    else:
        axes = list(range(n))
    out = []
    div = 1
    for pos in reversed(range(n)):
        a = axes[pos]
        out.append((a, div, grid[a] if pos > 0 else None))
        div *= grid[a]
    return sorted(out)


@dataclass(frozen=True)
class Chunking:
    """How a statement streams its tile: ``rows`` rows of ``cols`` elements, in chunks of
    ``vec`` elements of a row (16 bytes of its narrowest access), ``chunks`` per row; each
    thread keeps ``unroll`` chunks in flight per round. ``aligned``: every access's row length
    and constant column offset are multiples of ``vec`` (the 16-byte path may run; column
    offsets that are not constants are checked at run time)."""
    rows: int
    cols: int
    vec: int
    chunks: int
    unroll: int
    aligned: bool


def chunking(st: Statement) -> Chunking:
    accesses = list(st.vector_reads) + [st.dst]
    V = 16 // min(elem_bytes(a.dtype) for a in accesses)
    if st.copy:                                # a copy stores the chunk it loaded
        regs = V * elem_bytes(st.vector_reads[0].dtype) // 4
    else:
        regs = sum(V * elem_bytes(a.dtype) // 4 for a in accesses)
    aligned = all(a.dims[-1] % V == 0 for a in accesses)
    for a in accesses:
        off = const_value(a.col_offset)
        if isinstance(off, int) and not isinstance(off, bool) and off % V:
            aligned = False
    C = st.shape[-1]
    return Chunking(rows=math.prod(st.shape[:-1]), cols=C, vec=V, chunks=-(-C // V),
                    unroll=max(1, min(MAX_UNROLL, CHUNK_REGISTERS // max(1, regs))), aligned=aligned)


@dataclass(frozen=True)
class CommAbi:
    """The kernel's parameters, and what the runtime must provide for them."""
    params: tuple[KernelParam, ...]
    signals: tuple[str, ...]              # every signal the kernel touches
    remote_buffers: tuple[str, ...]       # tensors addressed on other ranks: they must be symmetric
    remote_signals: tuple[str, ...]       # signals notified on other ranks (either transport)


def kernel_abi(kernel: core.Kernel, m: CommMatch, transport: str) -> CommAbi:
    """The parameter list, in order: per tensor (kernel order) this rank's pointer (const when
    only read) and the peer-pointer table; per signal this rank's counters and the peer table;
    the ``load_scalar`` tables; ``rank``; ``launch``. Transport ``nvshmem`` reaches peers
    through this rank's symmetric address, so it takes no peer tables."""
    local_b: dict[int, set] = {}
    peer_b: dict[int, set] = {}
    remote_b: set[int] = set()
    for a in m.accesses:
        if not a.this_rank:
            remote_b.add(id(a.buf))
        mine = a.this_rank or transport == "nvshmem"
        (local_b if mine else peer_b).setdefault(id(a.buf), set()).add(a.mode)
    local_s: dict[int, set] = {}
    peer_s: set[int] = set()
    remote_s: set[int] = set()
    for u in m.signal_uses:
        if not u.this_rank:
            remote_s.add(id(u.sig))
        if u.this_rank or transport == "nvshmem":
            local_s.setdefault(id(u.sig), set()).add(u.mode)
        else:
            peer_s.add(id(u.sig))

    params: list[KernelParam] = []
    for b in kernel.buffers:
        st = ctype(b.type.dtype).comm if id(b) in local_b or id(b) in peer_b else None
        if id(b) in local_b:
            const = "const " if local_b[id(b)] == {"r"} else ""
            params.append(KernelParam(buffer_param(b), f"{const}{st}*", "ptr", f"buffer:{b.name}"))
        if id(b) in peer_b:
            params.append(KernelParam(peer_buffer_param(b), f"{st}* const* __restrict__", "ptr", f"peers:{b.name}"))
    for s in kernel.signals:
        if id(s) in local_s:
            const = "const " if local_s[id(s)] == {"r"} else ""
            params.append(KernelParam(signal_param(s), f"{const}unsigned long long*", "ptr", f"signal:{s.name}"))
        if id(s) in peer_s:
            params.append(KernelParam(peer_signal_param(s), "unsigned long long* const* __restrict__", "ptr",
                                      f"peer_signals:{s.name}"))
    for t in m.tables:
        params.append(KernelParam(table_param(t), "const int* __restrict__", "ptr", f"buffer:{t.name}"))
    params += [RANK_PARAM, LAUNCH_PARAM]
    return CommAbi(tuple(params),
                   tuple(s.name for s in kernel.signals if id(s) in local_s or id(s) in peer_s),
                   tuple(b.name for b in kernel.buffers if id(b) in remote_b),
                   tuple(s.name for s in kernel.signals if id(s) in remote_s))


@dataclass(frozen=True)
class CommPlan:
    """Everything :func:`..recipes.sm_comm.render_sm_comm` needs."""
    kernel: core.Kernel
    part: core.Part
    match: CommMatch
    entry: str
    threads: int
    lanes: int
    order: str                      # ring | full_mesh: the task order walked
    transport: str                  # ptr: peer-pointer tables; nvshmem: NVSHMEM device calls
    decode: tuple[tuple[int, int, int | None], ...]
    chunking: dict                  # id(statement op) -> Chunking
    abi: CommAbi
    options: tuple[str, ...]        # NVRTC options


def plan_sm_comm(kernel: core.Kernel, part: core.Part, m: CommMatch, *, threads: int = DEFAULT_THREADS,
                 wait_timeout_ns: int | None = None, entry: str | None = None) -> CommPlan:
    """Options: ``threads`` per CTA (a multiple of 32 up to 1024), ``wait_timeout_ns`` (a debug
    build whose waits trap after that long), ``entry`` (the kernel's name)."""
    if not (isinstance(threads, int) and 32 <= threads <= 1024 and threads % 32 == 0):
        raise fail(WHAT, f"threads={threads}: need a multiple of 32 between 32 and 1024", part)
    sched = kernel.comm_schedule
    order = sched.order if sched is not None else "ring"
    lanes = int(part.lanes or (sched.lanes if sched is not None else 1))
    transport = sched.transport if sched is not None else "ptr"
    options = list(wait_timeout_options(wait_timeout_ns))
    if transport == "nvshmem":
        options.append("-D__NVSHMEM_NUMBA_SUPPORT__")       # header-only NVSHMEM: no device library to link
    return CommPlan(kernel, part, m, entry_name(kernel, part, entry), threads, lanes, order,
                    transport, tuple(task_decode(tuple(part.grid), order)),
                    {id(st.op): chunking(st) for st in m.statements}, kernel_abi(kernel, m, transport),
                    tuple(options))
