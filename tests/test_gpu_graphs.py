"""The fused ops captured in CUDA graphs and replayed 100 times on two GPUs (``tldsl.checks.graph_check``
under torchrun; skipped unless torch sees at least 2 sm_90 GPUs). The same protocol on two
simulated ranks, with its mutants: tests/test_dist_graphs.py.

Run on a GPU host with: ``python -m pytest -q -m gpu tests/test_gpu_graphs.py``.
"""
from __future__ import annotations

import pytest

from test_gpu_dist import _gpus, _torchrun

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more sm_90 GPUs with torch and cuda-python")]


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_every_variant_replays_100_times(op, tmp_path):
    """Every variant of dist_check: capture once, 100 replays with fresh inputs, each output right
    (torchrun's exit status says; the log, kept under tmp_path, has one line per variant)."""
    _torchrun(["--ops", op, "--replays", "100"], tmp_path, f"graphs_{op}", timeout=1200,
              module="tldsl.checks.graph_check")
