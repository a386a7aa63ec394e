"""The strict-skip switch of conftest.py: under ``make test`` a skip outside the GPU tests fails."""
from types import SimpleNamespace

import conftest


def _report(outcome, reason="why", **extra):
    return SimpleNamespace(skipped=outcome == "skipped", longrepr=("f.py", 3, f"Skipped: {reason}"), **extra)


def test_strict_mode_refuses_skips_outside_the_gpu_tests(monkeypatch):
    monkeypatch.setattr(conftest, "STRICT", True)
    why = conftest.strict_failure(_report("skipped", "NVRTC missing"), is_gpu=False)
    assert why and "NVRTC missing" in why and "TLDSL_STRICT_SKIPS" in why
    assert conftest.strict_failure(_report("skipped"), is_gpu=True) is None             # no GPU: fine
    assert conftest.strict_failure(_report("passed"), is_gpu=False) is None
    assert conftest.strict_failure(_report("skipped", wasxfail="known"), is_gpu=False) is None


def test_without_the_switch_skips_stand(monkeypatch):
    monkeypatch.setattr(conftest, "STRICT", False)
    assert conftest.strict_failure(_report("skipped"), is_gpu=False) is None
