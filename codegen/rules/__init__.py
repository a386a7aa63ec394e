"""Rules: the C++ of one IR op each, shared by every recipe.

* :mod:`.scalars` — index code (``const``, ``program_id``, ``rank``, ``arith``, ``select``,
  ``load_scalar``) and the structured ``for`` / ``if`` around it;
* :mod:`.primitives` — the TileLink primitives (waits, notifies, data movement), each
  primitive's C++ written in exactly one function;
* :mod:`.sync` — the emitter the recipes' wait / notify hooks share: index code plus the
  signal primitives, on the signal parameters :mod:`..abi` names.

The rules ask the IR the same questions the matchers and planners do (:mod:`..ir_queries`);
they depend on no stage before them.
"""
