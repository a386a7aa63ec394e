"""The generated attention kernel beside torch's default attention on one GPU (issue 20's rows).

    python -m tldsl.bench attention [--seqs 4096,8192,16384,32768] [--ranks 2,4] [--dtypes bfloat16,float16]
                                    [--masks full,causal] [--heads 32/32,32/8] [--softmax fold,plain]
                                    [--order row_major,swizzled:8] [--iters 10]

One row per (dtype, S per rank, W, mask, heads): this GPU plays the last rank of ``W``, its
``S`` queries against the ``W * S`` gathered keys (d = 128), every signal the kernel waits on
already set — the kernel alone, as it runs once communication has delivered every key. The peer
is ``torch.nn.functional.scaled_dot_product_attention`` with its default backend choice (cuDNN on
Hopper) on the same tensors; causal rows use torch's lower-right mask (``causal_lower_right``:
the last rank's queries see every earlier key, and their own causally — the global causal mask).
Each row is checked against SDPA first (max error over the RMS), then both are timed
interleaved (CUDA events, median). TFLOP/s count the attended (query, key) pairs only. With several
``--softmax`` variants (the kernel's ``softmax`` option) or ``--order`` tile orders (the compute
schedule's over the attention part's grid of (heads, query blocks): ``row_major``, the default, one
head's query blocks after another's; ``swizzled:G``, groups of G heads walked query block by query
block) each row times every variant and SDPA in the same interleaved rounds, one table line per
variant.
"""
from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass

from . import timing

D = 128
#: max |ours - SDPA| over SDPA's RMS allowed before a row is timed (bf16 / fp16 outputs)
CHECK_TOL = 0.05


@dataclass(frozen=True)
class Row:
    dtype: str
    seq: int            # queries (and keys) per rank
    ranks: int          # W: keys = W * seq
    causal: bool
    heads: int
    kv_heads: int

    @property
    def keys(self) -> int:
        return self.ranks * self.seq

    def pairs(self) -> int:
        """(query, key) pairs attended: every pair, or (causal, the last rank's queries) every
        earlier rank's keys plus a lower triangle of its own."""
        if not self.causal:
            return self.seq * self.keys
        return self.seq * (self.keys - self.seq) + self.seq * (self.seq + 1) // 2

    def flops(self) -> int:
        return 4 * self.pairs() * D * self.heads

    def label(self) -> str:
        return (f"{self.dtype} S={self.seq} W={self.ranks} keys={self.keys} {'causal' if self.causal else 'full'} "
                f"{self.heads}/{self.kv_heads}")


def rows(seqs, ranks, dtypes, masks, heads) -> list[Row]:
    return [Row(dt, s, w, m == "causal", hq, hkv) for dt in dtypes for s in seqs for w in ranks for m in masks
            for hq, hkv in heads]


#: a kernel variant: ``(softmax, order)``, each None for the lowering's / schedule's default
DEFAULT_VARIANT = (None, None)


def schedule_order(order: str | None) -> dict:
    """``ComputeSchedule`` keywords of a ``--order`` entry: ``row_major`` or ``swizzled:G`` (groups
    of ``G`` heads, query block by query block inside a group); None: the schedule's default.
    Raises ValueError on anything else."""
    if order is None:
        return {}
    name, colon, group = order.partition(":")
    if name not in ("row_major", "swizzled") or (colon and (name != "swizzled" or not group.isdecimal()
                                                             or int(group) < 1)):
        raise ValueError(f"row_major or swizzled[:G] (G heads a group), got {order!r}")
    return {"order": name, **({"group_m": int(group)} if group else {})}


def variant_label(variant) -> str:
    sm, order = variant
    return f"{sm or 'default'}, {order or 'row_major'}"


@functools.lru_cache(maxsize=None)
def _lowered(row: Row, tile, stages, softmax=None, order=None):
    """The traced ``sp_attention`` for ``row`` and its lowered attention part (once per row and
    variant: the compile batch and the timed row share it)."""
    import tldsl as tl
    from tldsl.codegen import lower_attention
    from tldsl.ops.sp_attention import sp_attention
    dt = tl.ir.dtype_of(row.dtype)
    q, kv = tl.TensorSpec((row.seq, row.heads * D), dt), tl.TensorSpec((row.seq, row.kv_heads * D), dt)
    k = sp_attention.trace(row.ranks, q, kv, kv, q, heads=row.heads,
                           kv_heads=row.kv_heads if row.kv_heads != row.heads else None, causal=row.causal,
                           compute=tl.ComputeSchedule(tile=tile, stages=stages, **schedule_order(order)),
                           comm=tl.CommSchedule(tile_m=128, mode="pull"))
    return k, lower_attention(k, softmax=softmax)


def _kernel(row: Row, tile, stages, compiled=None, variant=DEFAULT_VARIANT):
    """The lowered attention part of ``sp_attention`` for ``row`` and its launcher."""
    from tldsl.runtime.gpu.attention import AttentionKernel
    k, lowered = _lowered(row, tile, stages, *variant)
    return k, lowered, AttentionKernel(lowered, compiled=compiled)


def compile_rows(todo: list[Row], tile, stages, variants=(DEFAULT_VARIANT,)) -> dict:
    """Every row's kernel (one per variant ``(softmax, order)``; keys ``row`` for the default
    variant, else ``(row, variant)``) compiled at once (one NVRTC process per core): each row's
    shapes are compile-time constants, so the grid's 64 rows are 64 kernels, minutes one after another."""
    from tldsl.codegen.toolchain.compiler import compile_many
    from tldsl.errors import CompilationError
    keys = [row if v == DEFAULT_VARIANT else (row, v) for row in todo for v in variants]
    jobs = [_lowered(row, tile, stages, *v)[1].job() for row in todo for v in variants]
    try:
        return dict(zip(keys, compile_many(jobs, progress=False)))
    except CompilationError:        # each row compiles on its own, so the failing one is reported in its row
        return {}


def bench_row(row: Row, iters: int, tile=(128, 128, 64), stages: int = 3, compiled=None, softmax=None,
              order=None) -> dict:
    """Check, then time, one row (``softmax``, ``order``: the variant, None for the defaults):
    ``{ms, torch_ms, tflops, torch_tflops, ratio, err}``."""
    return bench_variants(row, iters, tile, stages, {(softmax, order): compiled})[(softmax, order)]


def bench_variants(row: Row, iters: int, tile, stages, compiled: dict) -> dict:
    """Check each variant ``(softmax, order)`` of ``row``'s kernel (``compiled``: variant -> cubin
    or None), then time them all and SDPA in the same interleaved rounds: variant -> the row's figures."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    from .timing import interleaved_ms
    kerns = {v: _kernel(row, tile, stages, cub, v) for v, cub in compiled.items()}
    k, lowered, _ = next(iter(kerns.values()))
    t = getattr(torch, row.dtype)
    g = torch.Generator(device="cuda").manual_seed(row.seq + row.ranks)
    q = torch.randn(row.seq, row.heads * D, device="cuda", dtype=t, generator=g)
    k_all = torch.randn(row.keys, row.kv_heads * D, device="cuda", dtype=t, generator=g)
    v_all = torch.randn(row.keys, row.kv_heads * D, device="cuda", dtype=t, generator=g)
    o = torch.full_like(q, float("nan"))
    signals = {s.name: torch.ones(s.type.slots, device="cuda", dtype=torch.int64)
               for s in k.signals if s.name in lowered.signals}
    bufs = {"q": q, "k_gathered": k_all, "v_gathered": v_all, "o": o}
    rank = row.ranks - 1
    # torch's layout: [1, heads, tokens, D], contiguous (what a model hands SDPA)
    qh = q.view(row.seq, row.heads, D).transpose(0, 1).unsqueeze(0).contiguous()
    kh = k_all.view(row.keys, row.kv_heads, D).transpose(0, 1).unsqueeze(0).contiguous()
    vh = v_all.view(row.keys, row.kv_heads, D).transpose(0, 1).unsqueeze(0).contiguous()
    mask = causal_lower_right(row.seq, row.keys) if row.causal else None
    gqa = row.heads != row.kv_heads

    def ours(kern):
        return lambda: kern(bufs, signals=signals, rank=rank)

    def theirs():
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    want = theirs()[0].transpose(0, 1).reshape(row.seq, row.heads * D).float()
    errs = {}
    for v, (_, _, kern) in kerns.items():
        o.fill_(float("nan"))
        ours(kern)()
        torch.cuda.synchronize()
        err = float((o.float() - want).abs().max()) / (float(want.pow(2).mean().sqrt()) or 1.0)
        if not err <= CHECK_TOL:
            raise RuntimeError(f"{row.label()}: the generated kernel (softmax, order: {variant_label(v)}) differs "
                               f"from SDPA by {err:.3g} x RMS (tolerance {CHECK_TOL}); not timed")
        errs[v] = err
    *mss, torch_ms = interleaved_ms([ours(kern) for _, _, kern in kerns.values()] + [theirs], iters=iters)
    f = row.flops()
    return {v: dict(ms=ms, torch_ms=torch_ms, tflops=f / ms / 1e9, torch_tflops=f / torch_ms / 1e9,
                    ratio=torch_ms / ms, err=errs[v]) for v, ms in zip(kerns, mss)}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None


def _heads(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            hq, hkv = (int(x) for x in part.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"Q/KV pairs such as 32/32,32/8, got {part!r}") from None
        if hq < 1 or hkv < 1 or hq % hkv:
            raise argparse.ArgumentTypeError(f"{part}: KV heads must divide the query heads")
        out.append((hq, hkv))
    return out


def _names(allowed):
    def parse(text: str) -> list[str]:
        got = [x for x in text.split(",") if x]
        bad = [x for x in got if x not in allowed]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}, got {text!r}")
        return got
    return parse


def _orders(text: str) -> list[str]:
    got = [x for x in text.split(",") if x]
    for o in got:
        try:
            schedule_order(o)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if not got:
        raise argparse.ArgumentTypeError("at least one tile order")
    if len(set(got)) < len(got):
        raise argparse.ArgumentTypeError(f"each tile order once, got {text!r}")
    return got


def parse_args(argv):
    from tldsl.codegen.plan.attention import SOFTMAX
    ap = argparse.ArgumentParser(prog="python -m tldsl.bench attention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=_ints, default=[4096, 8192, 16384, 32768], help="queries per rank")
    ap.add_argument("--ranks", type=_ints, default=[2, 4], help="W: keys = W x queries")
    ap.add_argument("--dtypes", type=_names(("bfloat16", "float16")), default=["bfloat16", "float16"])
    ap.add_argument("--masks", type=_names(("full", "causal")), default=["full", "causal"])
    ap.add_argument("--heads", type=_heads, default=[(32, 32), (32, 8)], help="query/KV heads: MHA 32/32, GQA 32/8")
    ap.add_argument("--tile", type=_ints, default=[128, 128, 64], help="BM,BN,BK of the compute schedule")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--softmax", type=_names(SOFTMAX), default=None,
                    help="the kernel's softmax variants, timed side by side (default: the lowering's default)")
    ap.add_argument("--order", type=_orders, default=None,
                    help="tile orders of the compute schedule (row_major, swizzled:G), timed side by side "
                         "(default: the schedule's default)")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if len(args.tile) != 3:
        ap.error(f"--tile: three integers BM,BN,BK, got {args.tile}")
    return args


def main(argv, out=sys.stdout) -> int:
    args = parse_args(argv)
    todo = rows(args.seqs, args.ranks, args.dtypes, args.masks, args.heads)
    print(f"# attention forward, d={D}, this GPU{timing.on_device()} as the last of W ranks; ms (median of "
          f"{args.iters}, interleaved)", file=out)
    variants = [(sm, od) for sm in args.softmax or [None] for od in args.order or [None]]
    many = variants != [DEFAULT_VARIANT]
    print(f"| row |{' softmax, order |' if many else ''} tldsl ms | TFLOP/s | SDPA ms | TFLOP/s | tldsl / SDPA speed | "
          f"max err / RMS |\n|---|{'---|' if many else ''}---|---|---|---|---|---|", file=out, flush=True)
    compiled = compile_rows(todo, tuple(args.tile), args.stages, variants)
    failed = 0
    for row in todo:
        try:
            got = bench_variants(row, args.iters, tuple(args.tile), args.stages,
                                 {v: compiled.get(row if v == DEFAULT_VARIANT else (row, v)) for v in variants})
        except Exception as e:      # noqa: BLE001 - one row's failure is reported, the rest still run
            failed += 1
            print(f"| {row.label()} |{' |' if many else ''} failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160]} | | | | | |", file=out, flush=True)
            continue
        for v, r in got.items():
            print(f"| {row.label()} |{f' {variant_label(v)} |' if many else ''} {r['ms']:.3f} | {r['tflops']:.0f} | "
                  f"{r['torch_ms']:.3f} | {r['torch_tflops']:.0f} | {r['ratio']:.2f} | {r['err']:.1e} |",
                  file=out, flush=True)
    return 1 if failed else 0
