"""Planning: from a recipe's match and the schedules to its configuration and kernel ABI
(tiles, stages, shared memory, parameters, TMA descriptors)."""
