"""The fused distributed ops on two or more GPUs: ``tldsl.checks.dist_check`` under torchrun, in a
subprocess (skipped unless torch sees at least 2 sm_90 GPUs).

Run on a GPU host with: ``python -m pytest -q -m gpu tests/test_gpu_dist.py``. Each check prints
one summary line; on failure the whole log is shown, with any stuck wait decoded
(``dist_check.explain_log``). The logs are kept under pytest's tmp_path.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tldsl.runtime.gpu import gpu_available

ROOT = Path(__file__).resolve().parent.parent


def _gpus() -> int:
    if not gpu_available():
        return 0
    import torch
    return torch.cuda.device_count()


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more sm_90 GPUs with torch and cuda-python")]


def _torchrun(args, tmp_path: Path, name: str, timeout: int, module: str = "tldsl.checks.dist_check"):
    from tldsl.checks.dist_check import explain_log, summarize_log
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", module, *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        log, rc = r.stdout + "\n" + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        log += "\n" + ((e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        rc = "timeout"
    (tmp_path / f"{name}.log").write_text(log)
    summary, passed = summarize_log(log)
    if rc != 0:
        hints = explain_log(log)
        pytest.fail(f"{' '.join(cmd)} -> {rc}\n" + "\n".join(summary) + "\n--- decoded ---\n" + "\n".join(hints)
                    + f"\n--- log tail ({tmp_path / (name + '.log')}) ---\n" + log[-12000:])
    return summary, passed


@pytest.mark.parametrize("op", ["gemm_rs", "ag_gemm"])
def test_dist_check(op, tmp_path):
    """Odd M with noisy workspaces, stragglers, 1000 back-to-back launches, launches alternating
    between streams; every variant."""
    summary, passed = _torchrun([op, "--timeout", "120"], tmp_path, op, timeout=900)
    assert passed, "\n".join(summary)


def test_dist_check_debug_build(tmp_path):
    """The debug build (waits that time out and trap) runs correctly when nothing is stuck."""
    summary, _ = _torchrun(["gemm_rs", "--variants", "sm-push", "--checks", "odd_m", "--iters", "2",
                            "--debug-timeout-ns", "20000000000", "--timeout", "120"], tmp_path, "debug", timeout=600)
    assert any("gemm_rs/sm-push odd_m: PASS" in line for line in summary), "\n".join(summary)


def test_torch_ops_beside_async_tp(tmp_path):
    """torch.ops.tldsl.* in bf16 and fp16 (dense, strided and unaligned inputs; "sum" and "avg"),
    eager and under torch.compile, against NCCL + fp32 matmul and shaped as torch async-TP's."""
    _, _ = _torchrun(["--iters", "3"], tmp_path, "torch_ops", timeout=600, module="tldsl.checks.torch_ops_check")
    log = (tmp_path / "torch_ops.log").read_text()
    assert "torch_ops_check: all passed" in log and ": FAIL" not in log, log[-6000:]


def test_ranks_that_build_differently_all_raise(tmp_path):
    """Mismatched dtypes, one rank's invalid K, mismatched K, a call after close(): an InputError
    on every rank, no hang."""
    _torchrun([], tmp_path, "build", timeout=300, module="tldsl.checks.build_check")
    log = (tmp_path / "build.log").read_text()
    assert "build_check: all passed" in log and ": FAIL" not in log, log[-6000:]


def test_symmetric_memory_is_freed_only_at_collective_points(tmp_path):
    """Each op and engine: close() gives its symmetric memory back to the driver at once; an op
    dropped without close() keeps it through garbage collection, until release_unclosed()."""
    _torchrun([], tmp_path, "lifetime", timeout=400, module="tldsl.checks.lifetime_check")
    log = (tmp_path / "lifetime.log").read_text()
    assert "lifetime_check: all passed" in log and ": FAIL" not in log, log[-6000:]
