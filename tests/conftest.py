"""Shared pytest configuration.

``TLDSL_STRICT_SKIPS=1`` (set by ``make test``, which CI runs) turns every skip outside the GPU
tests into a failure: everything else needs only what ``make install`` installs (torch, the
NVRTC and CUTLASS wheels, nbformat ...), so a skip there means a broken environment, which must
not pass as green. GPU tests (marker ``gpu``, files ``test_gpu_*``) still skip without a GPU.
``TLDSL_REQUIRE_GPU=1`` (``make gpu-test``) makes a missing GPU, torch or cuda-python an error
instead of a run where every GPU test skips.

``make test`` runs the suite on two workers per core (pytest-xdist, ``-n <2 x cores> --dist loadgroup``;
the workers wait on the compilers and subprocesses they start much of the time): tests go
to the workers one at a time, except that the tests of a module sharing a module- or class-scoped
fixture go to one worker together (:func:`pytest_collection_modifyitems`), so the fixture is
built once. Without a GPU, the GPU tests' skips are summarised in one line. The tests that bound
their own CPU seconds (marker ``timed``) are left out of that run and run after it, alone
(``-m timed``): beside other workers, a process's CPU seconds grow with theirs.

The g++ builds of the host programs tests run (generated kernels on CPU threads) go to one folder
per run that every worker shares, each distinct program built once (tests/host_build.py). After
collection and after every test, the objects still alive are frozen out of the garbage
collector's scans (:func:`freeze_survivors`). Each worker compiles CUDA on one NVRTC process
(``TLDSL_COMPILE_WORKERS=1`` unless set) and runs its BLAS on one thread
(:func:`one_blas_thread_per_worker`).
"""
import gc
import os

import pytest

import host_build

STRICT = os.environ.get("TLDSL_STRICT_SKIPS") == "1"


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" in os.environ:
        # the workers already fill the cores: one NVRTC process each, so that an include family's
        # precompiled header (3-10 s to make) is made once per worker, not once per pool process
        os.environ.setdefault("TLDSL_COMPILE_WORKERS", "1")
        one_blas_thread_per_worker()
    if os.environ.get("TLDSL_REQUIRE_GPU") == "1":      # make gpu-test: no GPU is an error, not 70 skips
        why = _no_gpu_reason()
        if why:
            raise pytest.UsageError(f"TLDSL_REQUIRE_GPU=1 but the GPU tests cannot run here: {why}")
    config.addinivalue_line(
        "markers",
        "nvrtc: compiles CUDA with NVRTC from the pip wheels (no GPU needed); skipped, with the reason, "
        "only where those wheels are missing (a failure under TLDSL_STRICT_SKIPS=1)")


def one_blas_thread_per_worker() -> None:
    """Each worker's BLAS on one thread: the workers already fill the cores, and numpy's OpenBLAS
    starts a thread per core in every one of them. The GPU tests' numpy references (MoE products of
    a few GFLOP, seconds on one thread) took 150-195 s each under 14 workers on a 16-core host, their
    stacks in those products (BENCHMARKS.md, thirty-seventh session, call 7). A threaded product
    splits its output among threads, never a sum: no result changes. The variables cover a BLAS
    loaded later, threadpoolctl one already loaded."""
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=1, user_api="blas")


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


def freeze_survivors() -> None:
    """Collect, then move every object still alive into the garbage collector's permanent
    generation, which full collections skip. The symmetric-memory ledger collects at every op's
    close() (runtime/dist/symmetric.py): over the whole heap of a worker (torch, the collected
    tests, what earlier tests left: 300 000 objects and more) that took 0.2 s and more each time,
    minutes of the suite; this way it scans only what the running test made."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    freeze_survivors()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    freeze_survivors()


@pytest.fixture(autouse=True)
def _no_ambient_wait_report(request, monkeypatch):
    """The CPU tests see the options a plain build gets: TLDSL_WAIT_TIMEOUT_NS (debugging a hang)
    adds the report flag to every timed build. The GPU tests keep it, for whoever debugs one."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.delenv("TLDSL_WAIT_TIMEOUT_NS", raising=False)


@pytest.fixture(scope="session", autouse=True)
def _host_builds_shared_by_the_workers(tmp_path_factory):
    """One folder of g++ builds (tests/host_build.py) for every xdist worker of the run: the
    workers' base temporary folders are subfolders of the run's."""
    base = tmp_path_factory.getbasetemp()
    host_build.configure((base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "host-builds")


@pytest.hookimpl(tryfirst=True)        # before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = info is not None and any(
            d.scope in ("module", "class", "package") for defs in info.name2fixturedefs.values() for d in defs)
        if shared and item.get_closest_marker("xdist_group") is None:
            module = getattr(item, "module", None)
            item.add_marker(pytest.mark.xdist_group(module.__name__ if module is not None else item.nodeid))


#: The one line every GPU test skipped for want of a GPU is summarised under.
GPU_SKIP = ("tests/test_gpu_*.py", None,
            "Skipped: GPU tests: no usable sm_90 GPU with torch and cuda-python here (`make gpu-test` on a GPU host)")


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
    is_gpu = item.get_closest_marker("gpu") is not None
    why = strict_failure(report, is_gpu)
    if why:
        report.outcome, report.longrepr = "failed", why
    elif (is_gpu and report.skipped and not hasattr(report, "wasxfail") and "GPU" in _skip_reason(report)
          and os.environ.get("TLDSL_REQUIRE_GPU") != "1"):
        # -ra: one line for all of them, not one per test function — where a GPU is required, each
        # skip keeps its own reason (a test needing two GPUs on a one-GPU host says so)
        report.longrepr = GPU_SKIP


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    why = strict_failure(report, os.path.basename(str(collector.path)).startswith("test_gpu_"))
    if why:
        report.outcome, report.longrepr = "failed", why
