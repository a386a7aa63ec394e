"""Routing tables the library did not build — a caller's ``router``, or ``tables`` handed to
:class:`~.moe_ops.MoEReduceScatter` — checked before anything is enqueued.

The MoE kernels trust their tables: a row tile the staged gather never visits leaves the grouped
GEMM waiting until its timeout, a combine counting more producers than notify it waits as long,
one counting fewer reads rows before they are written, and a routed row past its tile's valid
rows is stored as zero. So where the op checks ``topk_ids`` on the device (``validate_ids=True``,
one read back), it checks a foreign routing's tables too: every table the op reads, against
``topk_ids`` where the tables say where each routed row went, all conditions reduced on the
device and read back at once (one more read). The tables
:class:`~..gpu.moe_routing.MoERoutingBuilder` builds (a :class:`~..gpu.moe_routing.RoutingTables`)
are the library's own and are not checked again: trusted by their type (a caller who edits them
takes that on)."""
from __future__ import annotations

from ...errors import InputError


def table_shapes(num_tokens: int, topk: int, num_experts: int, block_m: int, num_tiles: int) -> dict:
    """The shape of every table a MoE kernel reads, by name, for ``num_tokens`` tokens routed top-``topk``
    into row tiles of ``block_m`` (``num_tiles`` of them): what any router returns (the GPU builder's
    :meth:`~..gpu.moe_routing.RoutingSizes.shapes` among its own buffers)."""
    T, BM, NT = int(num_tokens), int(block_m), int(num_tiles)
    TT = -(-T // BM)
    return {"tile_expert": (NT,), "tile_valid_rows": (NT,), "tile_tokens": (NT, 2), "tile_visit": (NT,),
            "sorted_token_ids": (NT * BM,), "token_pos": (int(topk) * T,), "tile_token_tiles": (NT, min(BM, TT)),
            "tile_num_token_tiles": (NT,), "token_tile_producers": (TT,)}


def check_routing_tables(tables: dict, names, topk_ids, *, num_experts: int, block_m: int, num_tiles: int) -> None:
    """Raise :class:`InputError` naming the first table of ``names`` (plus ``token_pos`` and
    ``sorted_token_ids`` where present) that a kernel could not run safely and correctly on for
    ``topk_ids [T, topk]``: shapes and dtypes on the host, then values on the device, every
    condition reduced there and read back at once."""
    import torch
    T, topk = (int(s) for s in topk_ids.shape)
    E, BM, NT = int(num_experts), int(block_m), int(num_tiles)
    R, TT = NT * BM, -(-T // BM)
    shapes = table_shapes(T, topk, E, BM, NT)
    names = [n for n in shapes if n in set(names) | ({"token_pos", "sorted_token_ids"} & set(tables))]
    t = {}
    for n in names:
        v = tables[n]
        if not isinstance(v, torch.Tensor) or v.dtype != torch.int32 or tuple(v.shape) != shapes[n] \
                or v.device != topk_ids.device:
            got = (f"{type(v).__name__}" if not isinstance(v, torch.Tensor)
                   else f"{v.dtype} {list(v.shape)} on {v.device}")
            raise InputError(f"routing table '{n}': an int32 tensor {list(shapes[n])} on {topk_ids.device}, got {got}")
        t[n] = v.long()
    bad: list[tuple] = []    # (what is wrong, a device bool tensor: where it is, naming an index of it or None)

    def entry(n):
        """Names index ``i`` of the mask as table ``n``'s entry, with its value."""
        return lambda i: f"{n}{list(i)} = {int(t[n][i])}"

    def routed(i):
        k, tok = divmod(i[0], T)
        return f"token {tok}'s routed row {k}: token_pos[{i[0]}] = {int(t['token_pos'][i])}"

    def outside(n, lo, hi, what):
        bad.append((f"'{n}' holds values outside [{lo}, {hi}) ({what})", (t[n] < lo) | (t[n] >= hi), entry(n)))

    if "tile_expert" in t:
        outside("tile_expert", -1, E, f"an expert of {E}, or -1 for an unused tile")
    if "tile_valid_rows" in t:
        outside("tile_valid_rows", 0, BM + 1, f"rows of a tile of {BM}")
    if "sorted_token_ids" in t:
        outside("sorted_token_ids", -1, T, f"a token of {T}, or -1 for padding")
    if "tile_visit" in t:
        visits = torch.sort(t["tile_visit"]).values
        bad.append(("'tile_visit' is not a permutation of the row tiles (a tile left out is never staged, and the "
                    "grouped GEMM would wait for it until its timeout)",
                    visits != torch.arange(NT, device=visits.device),
                    lambda i: f"sorted, it has {int(visits[i])} where row tile {i[0]} belongs"))
    if "tile_tokens" in t:
        lo, hi = t["tile_tokens"][:, 0], t["tile_tokens"][:, 1]
        bad.append((f"'tile_tokens' holds a range not within [0, {T}]", (lo < 0) | (lo > hi) | (hi > T),
                    lambda i: f"tile_tokens[{i[0]}] = {t['tile_tokens'][i[0]].tolist()}"))
        if "sorted_token_ids" in t:
            ids = t["sorted_token_ids"].view(NT, BM)
            bad.append(("a tile's rows hold tokens outside its 'tile_tokens' range (read before they are gathered)",
                        (ids >= 0) & ((ids < lo[:, None]) | (ids >= hi[:, None])),
                        lambda i: f"row {i[1]} of tile {i[0]} holds token {int(ids[i])}, its range is "
                                  f"{t['tile_tokens'][i[0]].tolist()}"))
    if "token_pos" in t:
        pos = t["token_pos"]
        outside("token_pos", 0, R, f"a row of the {R} expert-sorted rows")
        p = pos.clamp(0, R - 1)
        order = torch.sort(p)
        twice = torch.zeros_like(p, dtype=torch.bool)
        twice[order.indices[1:]] = order.values.diff() == 0
        bad.append(("'token_pos' sends two routed rows to one row", twice, routed))
        token = torch.arange(T, device=pos.device).repeat(topk)            # k-major: entry k * T + t
        if "tile_expert" in t:
            want = topk_ids.t().reshape(-1).long()
            bad.append(("'token_pos' puts a token's routed row in a tile of another expert than topk_ids gives it",
                        t["tile_expert"][p // BM] != want, routed))
        if "tile_valid_rows" in t:
            bad.append(("'token_pos' points past its tile's valid rows (stored as zeros)",
                        p % BM >= t["tile_valid_rows"][p // BM], routed))
        if "sorted_token_ids" in t:
            bad.append(("'sorted_token_ids' disagrees with 'token_pos' on which token a row holds",
                        t["sorted_token_ids"][p] != token, routed))
    if {"sorted_token_ids", "tile_expert", "tile_valid_rows"} <= set(t):
        # every (token, expert) of topk_ids once among the valid rows of the used tiles, nothing else there
        # (both sides sorted, fixed lengths: the rows beyond topk * T must then be none)
        rows = torch.arange(R, device=topk_ids.device)
        e = t["tile_expert"][rows // BM]
        valid = (e >= 0) & (rows % BM < t["tile_valid_rows"][rows // BM]) & (t["sorted_token_ids"] >= 0)
        none = T * max(E, 1)
        have = torch.sort(torch.where(valid, t["sorted_token_ids"] * E + e, none)).values
        want = torch.sort(torch.arange(T, device=rows.device).repeat_interleave(topk) * E
                          + topk_ids.reshape(-1).long()).values
        n = min(R, T * topk)
        short = torch.full((1,), R < T * topk, dtype=torch.bool, device=rows.device)   # (a fill, not a copy)
        bad.append(("the valid rows of the used tiles ('sorted_token_ids', 'tile_expert', 'tile_valid_rows') do "
                    "not hold each (token, expert) of topk_ids once",
                    torch.cat([have[:n] != want[:n], have[n:] != none, short]), None))
    if "tile_num_token_tiles" in t:
        outside("tile_num_token_tiles", 0, min(BM, TT) + 1, "token tiles a row tile notifies")
    if {"tile_token_tiles", "tile_num_token_tiles", "tile_expert"} <= set(t):
        num = t["tile_num_token_tiles"].clamp(0, min(BM, TT))
        s = torch.arange(min(BM, TT), device=num.device)
        used = (s[None, :] < num[:, None]) & (t["tile_expert"][:, None] >= 0)
        j = t["tile_token_tiles"]
        bad.append((f"'tile_token_tiles' names a token tile outside [0, {TT})", used & ((j < 0) | (j >= TT)),
                    entry("tile_token_tiles")))
        notified = torch.where(used, j.clamp(0, TT - 1), TT)
        if "token_tile_producers" in t:          # (scatter_add, not bincount: no read back of its bounds)
            count = torch.zeros(TT + 1, dtype=torch.long, device=num.device).scatter_add_(
                0, notified.reshape(-1), torch.ones(notified.numel(), dtype=torch.long, device=num.device))[:TT]
            bad.append(("'token_tile_producers' is not the number of row tiles notifying each token tile (the "
                        "combine would wait for notifies that never come, or read rows not yet written)",
                        count != t["token_tile_producers"],
                        lambda i: f"token tile {i[0]}: {int(t['token_tile_producers'][i])}, notified by "
                                  f"{int(count[i])}"))
        if "token_pos" in t:                     # (a sorted search, not isin: no read back)
            tile_ids = torch.arange(NT, device=num.device)[:, None].expand_as(notified)
            notifies = torch.sort((tile_ids * (TT + 1) + notified).reshape(-1)).values
            reads = (p // BM) * (TT + 1) + token // BM
            found = notifies[torch.searchsorted(notifies, reads).clamp(max=notifies.numel() - 1)]
            bad.append(("a routed row's tile does not notify the token tile that reads it ('tile_token_tiles')",
                        found != reads, routed))
    if not bad:
        return
    found = torch.stack([m.any() for _, m, _ in bad]).tolist()       # the one read back
    for (what, mask, where), is_bad in zip(bad, found):
        if is_bad:
            at = f" (first: {where(tuple(int(x) for x in mask.nonzero()[0].tolist()))})" if where else ""
            raise InputError(f"the routing tables cannot be run: {what}{at}")
