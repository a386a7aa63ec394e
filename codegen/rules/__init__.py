"""Rules: the C++ of one IR op each, shared by every recipe.

* :mod:`.scalars` — index code (``const``, ``program_id``, ``rank``, ``arith``, ``select``,
  ``load_scalar``) and the structured ``for`` / ``if`` around it;
* :mod:`.primitives` — the TileLink primitives (waits, notifies, data movement), each
  primitive's C++ written in exactly one function.
"""
