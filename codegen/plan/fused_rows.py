"""Planning the parts a schedule fused into AllGather+GEMM's compute part.

With ``CommSchedule(own_rows='compute')`` the all-gather (``tldsl.collectives.all_gather``)
leaves this rank's rows to parts the compute part's kernel runs (``Part.fused``): the GEMM
reads its rows from the shard and stores each stage it loads where those parts say. The
simulator runs the parts as written; here they are evaluated for every rank
(:func:`.copy_engine.part_events`) and must be, event for event, one of the protocols the
GEMM template implements:

* ``own_rows`` (``mode='pull'``; ``tldsl::sm90::OwnRows``): one part that waits until every
  peer has published the launch before (``lag=1``: the slot is double-buffered by the runtime),
  copies the shard into the symmetric slot and into this rank's rows of the gathered tensor,
  notifies this rank's ready slot, then publishes the arrival on every peer;
* ``gather_rows`` (``mode='push'`` on the copy engine; ``GatherRows``): a part copying the shard
  into this rank's rows (each piece followed by its ready notify) and one copying every row
  block, once ready, into the gathered output;
* ``push_rows`` (``engine='compute'``; ``GatherRows<W, true, true>``): those two and a part
  copying the shard into every peer's gathered tensor, each piece followed by a notify of this
  rank's slot there.

The GEMM's own tiles then skip their waits (their rows are the shard itself).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import core
from ..errors import fail
from .copy_engine import part_events

WHAT = "gemm"


@dataclass(frozen=True)
class FusedRows:
    """What the fused parts ask of the GEMM, and the IR names its extra parameters bind to."""
    kind: str                         # "own_rows" | "gather_rows" | "push_rows"
    shard: core.Buffer                # this rank's rows, read by the GEMM in place of theirs in ``gathered``
    gathered: core.Buffer             # the GEMM's A
    ready: core.Signal                # the gathered rows' signal (the GEMM's waits; push_rows: notified on peers)
    slot: core.Buffer | None = None   # own_rows: the symmetric slot peers pull the shard from
    arrive: core.Signal | None = None  # own_rows: the arrival published on every peer
    out: core.Buffer | None = None    # gather/push_rows: the gathered output every row is stored into
    pieces: int = 1                   # column slices per shard (the ready slot's notifies per launch)


def _norm(e) -> tuple:
    """An event without its op and task, names for objects: comparable to an expected one."""
    if e[0] == "copy":
        _, _, sb, sr, so, db, dr, do, shape, _ = e
        return ("copy", sb.name, sr, tuple(so), db.name, dr, tuple(do), tuple(shape))
    if e[0] == "notify":
        _, _, sig, ch, target, _ = e
        return ("notify", sig.name, ch, target)
    _, _, sig, ch, count, epoch, per_launch, _, lag = e
    return ("wait", sig.name, ch, count, epoch, per_launch, lag)


def _expect(part: core.Part, got: list, want: list, what: str, rank: int) -> None:
    if got != want:
        first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        g = got[first] if first < len(got) else "nothing"
        w = want[first] if first < len(want) else "nothing"
        raise fail(WHAT, f"fused part '{part.name}' is not the {what} the GEMM implements: on rank {rank} its "
                   f"event {first} is {g}, expected {w}", part)


def plan_fused_rows(kernel: core.Kernel, part: core.Part, gathered: core.Buffer) -> FusedRows | None:
    """The protocol of the parts fused into compute part ``part`` (None: there are none)."""
    fused = [p for p in kernel.parts if p.fused]
    if not fused:
        return None
    W = kernel.world_size
    events = {p.name: [[_norm(e) for e in part_events(kernel, p, r)] for r in range(W)] for p in fused}
    raw0 = {p.name: part_events(kernel, p, 0) for p in fused}
    by_role: dict[str, core.Part] = {}
    for p in fused:
        ev = events[p.name][0]
        copies = [e for e in ev if e[0] == "copy"]
        if any(e[1] == gathered.name for e in copies):
            role = "out"                      # reads the gathered rows
        elif any(e[0] == "wait" and e[6] for e in ev) or any(e[4] != gathered.name for e in copies):
            role = "stage"                    # waits for an earlier launch / fills a slot
        elif any(e[5] != 0 for e in copies):
            role = "push"                     # (rank 0's events) writes another rank's rows
        else:
            role = "own"
        if role in by_role:
            raise fail(WHAT, f"fused parts '{by_role[role].name}' and '{p.name}' both move this rank's rows the same "
                       "way: the GEMM carries one of each", p)
        by_role[role] = p
    kinds = {frozenset({"stage"}): "own_rows", frozenset({"own", "out"}): "gather_rows",
             frozenset({"own", "out", "push"}): "push_rows"}
    kind = kinds.get(frozenset(by_role))
    if kind is None:
        raise fail(WHAT, f"the parts fused into '{part.name}' ({', '.join(p.name for p in fused)}) are none of the "
                   "protocols the GEMM implements (all_gather with own_rows='compute')", fused[0])
    lead = by_role["stage" if kind == "own_rows" else "own"]
    copies = [e for e in raw0[lead.name] if e[0] == "copy" and e[5] is gathered]
    notifies = [e for e in raw0[lead.name] if e[0] == "notify"]
    if not copies or not notifies:
        raise fail(WHAT, f"fused part '{lead.name}' copies nothing into '{gathered.name}'", lead)
    shard, ready = copies[0][2], notifies[0][2]
    if len(shard.type.shape) != 2:
        raise fail(WHAT, f"fused part '{lead.name}': the GEMM stages 2-d shards, '{shard.name}' is "
                   f"{list(shard.type.shape)}", lead)
    rows, K = shard.type.shape
    pieces = [(tuple(e[4]), tuple(e[8])) for e in copies]
    if kind == "own_rows":
        slot_copy = [e for e in raw0[lead.name] if e[0] == "copy" and e[5] is not gathered]
        arrive_waits = [e for e in raw0[lead.name] if e[0] == "wait"]
        if not slot_copy or len(pieces) != 1:
            raise fail(WHAT, f"fused part '{lead.name}': the GEMM stages whole shards into one slot", lead)
        slot = slot_copy[0][5]
        published = [e for e in notifies if e[2] is not ready]
        arrive = arrive_waits[0][2] if arrive_waits else (published[0][2] if published else None)  # None: W = 1
        for r in range(W):
            want = [("wait", arrive.name, p, 1, True, None, 1) for p in range(W) if p != r] if W > 1 else []
            want += [("copy", shard.name, r, (0, 0), slot.name, r, (0, 0), (rows, K)),
                     ("copy", shard.name, r, (0, 0), gathered.name, r, (r * rows, 0), (rows, K)),
                     ("notify", ready.name, r, r)]
            want += [("notify", arrive.name, r, p) for p in range(W) if p != r] if W > 1 else []
            _expect(lead, events[lead.name][r], want, "staging of this rank's rows (own_rows)", r)
        return FusedRows(kind, shard, gathered, ready, slot=slot, arrive=arrive)
    S = len(pieces)
    out_part = by_role["out"]
    out = next(e for e in raw0[out_part.name] if e[0] == "copy")[5]
    for r in range(W):
        want = []
        for offs, shape in pieces:
            want += [("copy", shard.name, r, offs, gathered.name, r, (r * rows + offs[0],) + offs[1:], shape),
                     ("notify", ready.name, r, r)]
        _expect(lead, events[lead.name][r], want, "copy of this rank's rows", r)
        want = []
        for p in range(W):
            for j, (offs, shape) in enumerate(pieces):
                at = (p * rows + offs[0],) + offs[1:]
                want += [("wait", ready.name, p, j + 1 if S > 1 else 1, True, S if S > 1 else None, 0),
                         ("copy", gathered.name, r, at, out.name, r, at, shape)]
        _expect(out_part, events[out_part.name][r], want, "copy of every row into the gathered output", r)
        if kind == "push_rows":
            want = []
            for i in range(1, W):
                peer = (r + W - i) % W
                for offs, shape in pieces:
                    want += [("copy", shard.name, r, offs, gathered.name, peer, (r * rows + offs[0],) + offs[1:], shape),
                             ("notify", ready.name, r, peer)]
            _expect(by_role["push"], events[by_role["push"].name][r], want, "push of this rank's rows", r)
    if kind == "push_rows" and S != 1:
        raise fail(WHAT, "the GEMM pushes whole shards (no column slices)", by_role["push"])
    return FusedRows(kind, shard, gathered, ready, out=out, pieces=S)
