"""The numbers of the compute schedule's tile order as the C++ templates read them
(``tldsl/tile_order.hpp``: ``comm_aligned_start``, ``tile_at``).

The schedule takes any Python int for a part's ``align_shift`` and any positive int for
``group_m``; the templates take C++ ``int`` literals. Rendered as given, ``align_shift=10**12``
would be narrowed to another int (and ``group_m=2**40`` to 0), so both are reduced on the host
to the value that walks the same order (:meth:`~tldsl.ir.schedule.ComputeSchedule.tile_slots`):
the shift modulo the world size (Python's ``%``, never negative), the group at most ``INT_MAX``
(``tile_at`` bounds it by the rows it walks: a group of those rows or more is every row)."""
from __future__ import annotations

#: the largest C++ ``int``: what the templates' order arithmetic is written in
INT_MAX = 2**31 - 1


def order_align_shift(align_shift, world_size: int) -> int:
    """``align_shift`` reduced to ``[0, world_size)``: the rank whose rows the ``comm_aligned``
    order starts on is ``(rank + align_shift) % world_size`` in Python, the same for any shift
    congruent to it."""
    return int(align_shift or 0) % max(1, int(world_size))


def order_group_m(group_m: int) -> int:
    """``group_m`` as the templates read it: at most ``INT_MAX``. ``tile_at`` bounds a group by the
    rows it walks itself (a group of those rows or more is every row, one group), so any larger
    group walks the same order as ``INT_MAX`` rows, and ``group_m * gn`` cannot overflow there."""
    return min(int(group_m), INT_MAX)
