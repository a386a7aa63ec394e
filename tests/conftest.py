"""Shared pytest configuration.

``TLDSL_STRICT_SKIPS=1`` (set by ``make test``, which CI runs) turns every skip outside the GPU
tests into a failure: everything else needs only what ``make install`` installs (torch, the
NVRTC and CUTLASS wheels, nbformat ...), so a skip there means a broken environment, which must
not pass as green. GPU tests (marker ``gpu``, files ``test_gpu_*``) still skip without a GPU.
``TLDSL_REQUIRE_GPU=1`` (``make gpu-test``) makes a missing GPU, torch or cuda-python an error
instead of a run where every GPU test skips.
"""
import os

import pytest

STRICT = os.environ.get("TLDSL_STRICT_SKIPS") == "1"


def pytest_configure(config):
    if os.environ.get("TLDSL_REQUIRE_GPU") == "1":      # make gpu-test: no GPU is an error, not 70 skips
        why = _no_gpu_reason()
        if why:
            raise pytest.UsageError(f"TLDSL_REQUIRE_GPU=1 but the GPU tests cannot run here: {why}")
    config.addinivalue_line(
        "markers",
        "nvrtc: compiles CUDA with NVRTC from the pip wheels (no GPU needed); skipped, with the reason, "
        "only where those wheels are missing (a failure under TLDSL_STRICT_SKIPS=1)")


def _no_gpu_reason() -> str | None:
    """Why the GPU tests would skip here (None: they can run)."""
    try:
        from tldsl.runtime.gpu.device import require_gpu
        require_gpu()
        import torch
    except Exception as e:  # noqa: BLE001 - any missing piece is the answer
        return f"{type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def _skip_reason(report) -> str:
    lr = report.longrepr
    return lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)


def strict_failure(report, is_gpu: bool):
    """The failure text for a skip that strict mode refuses, or None where the skip may stand."""
    if not STRICT or not report.skipped or is_gpu or hasattr(report, "wasxfail"):
        return None
    return (f"skipped outside the GPU tests under TLDSL_STRICT_SKIPS=1 (a dependency — what `make install` "
            f"provides, or the system's g++ — is missing or broken): {_skip_reason(report)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    why = strict_failure(report, item.get_closest_marker("gpu") is not None)
    if why:
        report.outcome, report.longrepr = "failed", why


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    why = strict_failure(report, os.path.basename(str(collector.path)).startswith("test_gpu_"))
    if why:
        report.outcome, report.longrepr = "failed", why
