"""Testing support: how an op describes itself to the tests (:mod:`.opspec`), hypothesis
strategies (:mod:`.strategies`, random whole tile programs among them), the mutation check
(:mod:`.mutants`) and the differential fuzzer (:mod:`.fuzz`, its programs made by
:mod:`.program_families`). The library's ops register in :data:`tldsl.ops.OPS`.

Users property-test their own kernels with the same strategies (``tldsl.testing.strategies``).
"""
from .opspec import OpCase, OpSpec, check_case, describe

__all__ = ["OpCase", "OpSpec", "check_case", "describe"]
