"""How torch's async-TP ops lay out N-d operands, mapped onto the fused ops' 2-d row blocks.

``torch.ops.symm_mem.fused_all_gather_matmul(A_shard, Bs, gather_dim, ...)`` all-gathers
``A_shard`` along ``gather_dim`` and multiplies over its last dim; ``fused_matmul_reduce_scatter
(A, B, reduce_op, scatter_dim, ...)`` reduce-scatters ``A @ B`` along ``scatter_dim``. Any dim but
the last is a dim of rows: moved to the front and flattened with the others, every rank's block
is one contiguous run of rows — exactly the 2-d ops' row blocks (``AllGatherMatmul``,
``MatmulReduceScatter``) — and the results are viewed back as torch's own implementation views
them, so shapes and strides match its outputs. The last dim is K (a gather) or N (a scatter):
it holds no row blocks, and :mod:`tldsl.torch_ops` runs it unfused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InputError


def normalize_dim(dim, ndim: int, what: str) -> int:
    """``dim`` as a non-negative index of an ``ndim``-d tensor (torch's negative dims allowed)."""
    if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < ndim:
        raise InputError(f"{what}={dim!r}: a dim of the {ndim}-d A, in [{-ndim}, {ndim - 1}]")
    return dim % ndim


@dataclass(frozen=True)
class RowBlocks:
    """Where an N-d operand's rows come from: ``dim`` moved to the front, ``lead`` the dims before
    the last after that move (their product is the 2-d operand's row count)."""
    dim: int
    lead: tuple[int, ...]

    @property
    def rows(self) -> int:
        return math.prod(self.lead)


def as_row_blocks(t, dim: int):
    """``t`` (N-d, ``dim`` not its last) as a 2-d ``[rows, last]`` tensor whose rows are ``dim``
    first (a copy only when the move needs one), and the :class:`RowBlocks` to view results back."""
    moved = t.movedim(dim, 0)
    return moved.flatten(0, -2), RowBlocks(dim, tuple(moved.shape[:-1]))


def gathered(t2d, blocks: RowBlocks, world_size: int):
    """A 2-d result over the gathered rows (``[W * rows, X]``) viewed as torch's gather returns it:
    ``dim`` W times longer, back in its place."""
    first, *rest = blocks.lead
    return t2d.view(world_size * first, *rest, t2d.shape[-1]).movedim(0, blocks.dim)


def scattered(t2d, blocks: RowBlocks, world_size: int):
    """This rank's 2-d block of the reduced rows (``[rows / W, X]``) as torch's reduce-scatter
    returns it: ``dim`` W times shorter, back in its place, contiguous (torch's reduction writes
    a contiguous result)."""
    first, *rest = blocks.lead
    return t2d.view(first // world_size, *rest, t2d.shape[-1]).movedim(0, blocks.dim).contiguous()


def check_scatter_divides(a, scatter_dim: int, world_size: int) -> None:
    """The scattered dim must split evenly over the ranks, as torch's op requires."""
    if a.shape[scatter_dim] % world_size:
        raise InputError(f"fused_matmul_reduce_scatter: dim {scatter_dim} of A has {a.shape[scatter_dim]} entries, "
                         f"not divisible by the {world_size} ranks it is scattered over")
