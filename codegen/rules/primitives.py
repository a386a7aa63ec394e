"""The C++ of the TileLink primitives: each primitive in exactly one rule.

Every recipe (the warp-specialised GEMM's producer and epilogue, the grouped GEMM's hooks, the
combine, flash attention's control code, the SM communication kernels) renders a primitive
through these functions; what differs between them is only *who* runs the statement — one
thread (``cta=False``: the GEMM producer, an epilogue thread) or the whole CTA
(``cta=True``: the communication kernels, whose helpers meet the CTA around the signal op).

The semantics — a wait's target across launches (:func:`tldsl.ir.semantics.wait_target`),
default memory scopes — live in the IR; the simulator executes the same definitions.
"""
from __future__ import annotations

from ..abi import marker
from ..ir_queries import scope_of
from ...ir import core
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS

#: C++ scope constants of ``signals.hpp``
SCOPE = {"gpu": "tldsl::kScopeGpu", "sys": "tldsl::kScopeSys"}


def wait_target(op: core.Op, count: str, launch: str = "launch") -> str:
    """C++ of a wait's target (:func:`tldsl.ir.semantics.wait_target`): ``count`` times the
    launch index when the wait counts in epochs, ``per_launch * (launch - 1) + count`` when it
    waits for the first ``count`` of a slot's ``per_launch`` notifies, else ``count``."""
    return wait_target_formula(count, op.attrs.get("epoch", True), op.attrs.get("per_launch"), launch,
                               lag=op.attrs.get("lag", 0))


def wait_target_formula(count, epoch: bool, per_launch: int | None, launch: str = "launch", *,
                        cpp: bool = True, lag: int = 0) -> str:
    """A wait's target as a formula of ``launch``: C++ (``cpp``, 64-bit unsigned) or plain text
    for descriptions (the copy-engine plan's waits). ``lag``: for launch ``launch - lag`` (0
    before the first launch; unsigned C++ must not wrap)."""
    u64 = (lambda x: f"(unsigned long long)({x})") if cpp else str
    one = "1ull" if cpp else "1"
    if not epoch:
        return u64(count)
    if lag:
        per = (f"{int(per_launch)}ull" if cpp else str(int(per_launch))) if per_launch is not None else u64(count)
        back = f"{int(lag) + 1}ull" if cpp else str(int(lag) + 1)
        if cpp:
            return f"({launch} > {int(lag)}ull ? {per} * ({launch} - {back}) + {u64(count)} : 0ull)"
        return f"{per} * ({launch} - {back}) + {count} (0 before launch {int(lag) + 1})"
    if per_launch is None:
        return f"{u64(count)} * {launch}"
    per = f"{int(per_launch)}ull" if cpp else str(int(per_launch))
    return f"{per} * ({launch} - {one}) + {u64(count)}"


def wait(op: core.Op, slot: str, count: str, *, cta: bool = False, launch: str = "launch",
         site: int | None = None) -> str:
    """``consumer_tile_wait`` / ``peer_tile_wait`` / ``rank_wait``: spin until the signal slot at
    address ``slot`` holds the target, then acquire at the op's scope. ``cta``: the whole CTA
    waits (one thread spins, the CTA meets after it). ``site`` (:func:`..ir_queries.wait_site`):
    a count computed at run time is checked there as the simulator checks it (:func:`checked_count`)."""
    assert op.name in WAIT_OPS, op.name
    fn = "tldsl::comm::cta_wait" if cta else "tldsl::wait_at_least"
    if site is not None:
        count = checked_count(op, count, site)
    return f"{fn}<{SCOPE[scope_of(op)]}>({slot}, {wait_target(op, count, launch)});  // {op.name}{marker(op.loc)}"


def checked_count(op: core.Op, count: str, site: int) -> str:
    """C++ of a wait's count, checked where it is computed at run time: positive, and no more than
    the slot's notifies per launch (``per_launch``), as the simulator requires. A failed check is
    recorded for the host (``signals.hpp``: ``tldsl::checked_count``) and the wait passes; a count
    written as a literal was checked when the program was traced."""
    if count.strip().lstrip("-").isdigit():
        return count
    most = int(op.attrs.get("per_launch") or 0)
    return f"tldsl::checked_count({count}, {int(site)}u, {most})"


def notify(op: core.Op, slot: str, *, cta: bool = False, nvshmem_rank: str | None = None,
           note: str = "") -> str:
    """``producer_tile_notify`` / ``peer_tile_notify`` / ``rank_notify``: add 1 to the signal
    slot at ``slot``.

    ``cta=False``: one relaxed add by this thread; the caller has already ordered the data
    before it with :func:`release_fence` at :func:`..ir_queries.widest_scope` of the notifies it renders.
    ``cta=True``: the CTA meets, then one thread fences at the op's scope and adds.
    ``nvshmem_rank``: the slot is NVSHMEM symmetric memory and the add goes to that rank's copy."""
    assert op.name in NOTIFY_OPS, op.name
    tail = f"  // {op.name}{note}{marker(op.loc)}"
    if nvshmem_rank is not None:
        return f"tldsl::comm::cta_notify_peer({slot}, {nvshmem_rank});{tail}"
    if cta:
        return f"tldsl::comm::cta_notify<{SCOPE[scope_of(op)]}>({slot});{tail}"
    return f"tldsl::red_relaxed_add<{SCOPE[scope_of(op)]}>({slot}, 1ull);{tail}"


def release_fence(scope: str, note: str = "") -> str:
    """The fence that orders a tile's writes before the relaxed adds of its notifies."""
    return f"tldsl::fence_acq_rel<{SCOPE[scope]}>();" + (f"  // {note}" if note else "")


# -- data movement on SMs (the communication kernels stream a tile through the CTA in chunks of
# a row; ``include/tldsl/comm.hpp``). A local ``load`` / ``store`` is the same rule at this
# rank's row pointer. ``row``: the row's first element on the rank that holds it, null where the
# row lies outside the tensor; ``col``: the first column; ``ncols``: the row's length; ``left``:
# how many of the chunk's ``vec`` columns belong to the tile; ``vec_ok``: 16-byte vectors are
# aligned (row pitch and column offset multiples of ``vec``). ``rank_copy_data`` has no SM rule:
# the copy engine moves it (a ``CeCopy`` of :mod:`..plan.copy_engine`, ``cuMemcpy2DAsync``).

def tile_pull_data(elem: str, row: str, col: str, ncols, *, chunk: str | None = None, vec: str = "",
                   left: str = "", vec_ok: str = "", mask: str | None = None) -> str:
    """``tile_pull_data``: read a rank's tensor. With ``chunk``: the statement that loads ``vec``
    columns into it (zeros outside the tensor), assigning the in-bounds mask to ``mask`` when
    given (a copy stores only those elements); without: the expression of one element."""
    if chunk is None:
        return f"tldsl::comm::load_elem<{elem}>({row}, {col}, {ncols})"
    into = f"{mask} = " if mask else ""
    return f"{into}tldsl::comm::load_chunk<{elem}, {vec}>({chunk}, {row}, {col}, {ncols}, {left}, {vec_ok});"


def tile_push_data(elem: str, row: str, col: str, ncols, chunk: str, mask: str, *, vec: str, left: str,
                   vec_ok: str) -> str:
    """``tile_push_data``: write the elements of ``chunk`` in ``mask`` into a rank's tensor
    (dropped outside it)."""
    return f"tldsl::comm::store_chunk<{elem}, {vec}>({row}, {col}, {ncols}, {left}, {vec_ok}, {mask}, {chunk});"

