"""Rendering what both WGMMA GEMM templates (plain and grouped) read: the head of their
``struct Cfg``."""
from __future__ import annotations

from ..dtypes import c_type
from ..plan.tile_order import order_group_m
from ..plan.wgmma import ORDERS, GemmConfig


def gemm_cfg_fields(cfg: GemmConfig, gmma: str, world_size: int, align_shift: int,
                    dot_mk: str = "", part_mk: str = "") -> list[str]:
    """The opening of the ``struct Cfg`` every WGMMA GEMM template (plain and grouped) reads:
    element types, GMMA atom, tile, pipeline, tile order and register split."""
    return [
        "struct Cfg {",
        f"  using ElemAB = {c_type(cfg.in_dtype)};",
        f"  using ElemC = {c_type(cfg.out_dtype)};",
        f"  using Gmma = {gmma};{dot_mk}",
        f"  static constexpr int BM = {cfg.BM}, BN = {cfg.BN}, BK = {cfg.BK};{part_mk}",
        f"  static constexpr int kStages = {cfg.stages}, kConsumerWGs = {cfg.consumer_wgs}, "
        f"kEpiBuffers = {cfg.epi_buffers};",
        f"  static constexpr int kOrder = {ORDERS[cfg.order]}, kGroupM = {order_group_m(cfg.group_m)}, "
        f"kWorldSize = {world_size}, kAlignShift = {align_shift};",
        f"  static constexpr int kProducerRegs = {cfg.producer_regs}, kConsumerRegs = {cfg.consumer_regs};",
        f"  static constexpr int kClusterM = {cfg.cluster[0]};",
        f"  static constexpr int kNotifySlots = {cfg.notify_slots};",
        f"  static constexpr bool kSplitN = {'true' if cfg.split_n else 'false'};"
        f"{'   // the consumer warpgroups split the columns of a tile' if cfg.split_n else ''}",
        f"  static constexpr bool kPingPong = {'true' if cfg.pingpong else 'false'};"
        f"{'   // each consumer warpgroup owns whole tiles, in turns' if cfg.pingpong else ''}",
    ]


def gemm_cfg_options(cfg: GemmConfig) -> list[str]:
    """The ``struct Cfg`` lines both templates read only where set (their traits default to false):
    B stored [N, K], a tile's C held in registers and stored during the next K loop."""
    return ([*(["  static constexpr bool kBKMajor = true;   // B stored [N, K]: its stages chunked along K, as A's"]
               if cfg.b_k_major else []),
             *(["  static constexpr bool kOverlapStore = true;   // a tile's C stored during the next tile's K loop"]
               if cfg.overlap_store else [])])
