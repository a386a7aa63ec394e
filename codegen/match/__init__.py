"""Matching: each recipe's recogniser turns a part's IR into a match (the buffers, loops and
hooks it found) or raises a LoweringError at the op that does not fit. Shared pieces live
here: :mod:`.affine` (affine forms of index expressions), :mod:`.per_row` (what the grouped
GEMM and combine matchers ask of per-row index expressions)."""
