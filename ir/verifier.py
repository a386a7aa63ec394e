"""Structural and semantic checks on a kernel's IR; each error names the user's line.

Run after tracing and after every pass, so the simulator and the code generator can
trust what they are given."""
from __future__ import annotations

from ..errors import VerificationError
from .analysis import check_channels
from .core import Block, Kernel, Op, Part
from .opdefs import (COPY_ENGINE_OPS, NOTIFY_OPS, OPS, SIGNAL_SCOPE, WAIT_OPS, data_operands)
from .types import FragmentType, MemSpace, ScalarType, SignalType, TensorType, TileType

_PAIR = {"consumer_tile_wait": "producer_tile_notify", "peer_tile_wait": "peer_tile_notify",
         "rank_wait": "rank_notify"}


def _err(msg: str, op: Op | None = None, loc=None):
    raise VerificationError(msg, loc if loc is not None else (op.loc if op is not None else None))


def verify(kernel: Kernel, *, channels: bool = True) -> None:
    """Raise :class:`VerificationError` at the first rule the kernel breaks.

    ``channels=True`` also runs the static channel analysis (:mod:`.analysis`): every wait
    must be reachable by enough notifies on its exact channel and rank.
    """
    if kernel.world_size < 1:
        _err(f"world size {kernel.world_size}: need at least one rank", loc=kernel.loc)
    visible = {b.value.id for b in kernel.buffers} | {s.value.id for s in kernel.signals}
    names = [b.name for b in kernel.buffers]
    if len(set(names)) != len(names):
        _err(f"duplicate buffer names in {names}", loc=kernel.loc)
    for part in kernel.parts:
        if part.role not in ("compute", "comm"):
            _err(f"part '{part.name}' has unknown role {part.role!r}", loc=part.loc)
        if part.engine not in ("sm", "copy_engine", "compute"):
            _err(f"part '{part.name}' has unknown engine {part.engine!r}", loc=part.loc)
        if (part.engine == "compute") != bool(part.fused):
            _err(f"part '{part.name}': engine 'compute' is a comm part fused into the compute part, and only that",
                 loc=part.loc)
        if part.fused and sum(p.role == "compute" for p in kernel.parts) != 1:
            _err(f"part '{part.name}' is fused into the compute part, but the kernel has "
                 f"{sum(p.role == 'compute' for p in kernel.parts)} compute parts", loc=part.loc)
        if part.role == "compute" and part.engine != "sm":
            _err(f"compute part '{part.name}' must run on SMs", loc=part.loc)
        _verify_block(part.body, set(visible), part, kernel)
    _verify_signal_pairs(kernel)
    if channels:
        check_channels(kernel)


def _verify_block(block: Block, visible: set[int], part: Part, kernel: Kernel):
    for a in block.args:
        visible.add(a.id)
    for op in block.ops:
        if op.name not in OPS:
            _err(f"unknown op '{op.name}'", op)
        for v in op.operands:
            if v.id not in visible:
                _err(f"'{op.name}' uses a value that is not defined before it in this scope "
                     f"(was the op that made it deleted?)", op)
        _verify_op(op, part, kernel)
        for region in op.regions:
            _verify_block(region, set(visible), part, kernel)
        for r in op.results:
            visible.add(r.id)


def _verify_op(op: Op, part: Part, kernel: Kernel):
    name = op.name
    if part.engine == "copy_engine" and name not in COPY_ENGINE_OPS:
        _err(f"'{name}' cannot run on the copy engine: a copy-engine part holds only "
             "rank_copy_data, rank_notify, rank_wait, consumer_tile_wait and index arithmetic (part "
             f"'{part.name}' runs there by its engine='copy_engine', or without engine= by the communication "
             "schedule's; engine='sm' puts it on SMs)", op)
    if part.engine == "compute" and name not in COPY_ENGINE_OPS:
        _err(f"'{name}' in a part fused into the compute part: such a part holds only rank_copy_data, "
             "rank_notify, rank_wait, consumer_tile_wait and index arithmetic (the compute part stores what "
             "it loads)", op)
    if name == "rank_copy_data" and part.engine not in ("copy_engine", "compute"):
        _err("rank_copy_data runs on the copy engine: put it in a comm part with engine='copy_engine' "
             "(or use tile_push_data / tile_pull_data on SMs)", op)
    if name in NOTIFY_OPS or name in WAIT_OPS:
        sig = op.operands[0]
        if not isinstance(sig.type, SignalType):
            _err(f"{name}: first operand must be a signal", op)
        if sig.type.scope.value != SIGNAL_SCOPE[name]:
            _err(f"{name} needs a {SIGNAL_SCOPE[name]} signal, '{sig.hint}' is {sig.type.scope}", op)
        for v in op.operands[1:]:
            if not isinstance(v.type, ScalarType):
                _err(f"{name}: channel/rank/count must be scalars", op)
        if name in NOTIFY_OPS and op.attrs.get("scope") not in ("gpu", "sys"):
            _err(f"{name}: memory scope must be 'gpu' or 'sys'", op)
    elif name in ("tile_push_data", "tile_pull_data", "rank_copy_data"):
        src, srank, soffs, dst, drank, doffs, tile = data_operands(op)
        remote = [src] if name == "tile_pull_data" else [dst] if name == "tile_push_data" else []
        # the other side (a copy's either side) may be this rank's own (any) tensor
        remote += [b for b, r in ((src, srank), (dst, drank))
                   if b is not None and b not in remote and not (isinstance(r.owner, Op) and r.owner.name == "rank")]
        for buf in remote:
            if not (isinstance(buf.type, TensorType) and buf.type.space == MemSpace.SYMMETRIC):
                _err(f"{name} addresses '{buf.hint}' on another rank, but it is not a symmetric buffer", op)
    elif name in ("load", "store", "load_scalar", "load_rows", "add_rows"):
        t = op.operands[0].type
        if not isinstance(t, TensorType):
            _err(f"{name}: first operand must be a tensor", op)
    elif name in ("frag_read", "frag_write"):
        if not isinstance(op.operands[0].type, FragmentType):
            _err(f"{name}: first operand must be a fragment", op)
    elif name == "dot":
        a, b = (v.type for v in op.operands)
        if not (isinstance(a, TileType) and isinstance(b, TileType)) or a.shape[1] != b.shape[0]:
            _err("dot: operand shapes do not match", op)
    elif name == "for":
        if len(op.regions) != 1 or len(op.regions[0].args) != 1:
            _err("for: needs one body region with one induction variable", op)


def _verify_signal_pairs(kernel: Kernel):
    notifies: dict[int, set[str]] = {}
    waits: list[tuple[Op, int]] = []
    for _, op in kernel.walk():
        if op.name in NOTIFY_OPS:
            notifies.setdefault(op.operands[0].id, set()).add(op.name)
        elif op.name in WAIT_OPS:
            waits.append((op, op.operands[0].id))
    for op, sid in waits:
        need = _PAIR[op.name]
        have = notifies.get(sid, set())
        if need not in have:
            sig = op.operands[0].hint
            if have:
                _err(f"{op.name} on signal '{sig}', which only {', '.join(sorted(have))} writes; "
                     f"a {op.name} is satisfied by {need}", op)
            _err(f"{op.name} on signal '{sig}', but nothing notifies it: this wait would hang", op)
