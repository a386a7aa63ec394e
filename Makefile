# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

# The install: tldsl[test,cpu] (the suite; NVRTC and the headers, README "Install") and a CPU
# build of torch (enough for the distributed runtime's host-side tests), then `pip check`.
# pip's own output goes to $(LOG) (this machine's package indexes make pip warn about each
# package one of them lacks); a step that fails prints the whole log.
LOG    := $(VENV)/install.log
QUIET   = >>$(LOG) 2>&1 || { cat $(LOG); echo "pip failed: the log above is $(LOG)"; exit 1; }

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@: > $(LOG)
	@echo "pip install --upgrade pip"
	@$(PY) -m pip install --upgrade pip $(QUIET)
	@echo "pip install -e '.[test,cpu]' torch==2.13.0   (pip's log: $(LOG))"
	@$(PY) -m pip install -e '.[test,cpu]' torch==2.13.0 $(QUIET)
	$(PY) -m pip check
	touch $@

.PHONY: install demo test mutants gpu-test gpu-test-parallel
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m tldsl.demo

# The suite on two pytest-xdist workers per core (tests/conftest.py keeps tests sharing a module fixture
# together): a worker spends much of its time waiting on the NVRTC, g++, cuobjdump and Python
# processes it starts, so one worker per core left a third of the cores idle (2-core machine, cold
# kernel cache: 382 s with 2 workers, 357 s with 3, 322 s with 4; the same CPU seconds each time).
# The tests that bound their own CPU seconds (marker `timed`) run after the rest, alone: beside
# three other workers on two cores a simulation's CPU seconds grow (they share caches and memory).
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(2 * len(os.sched_getaffinity(0)))")
test: $(VENV)/.installed
	TLDSL_STRICT_SKIPS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not timed"
	TLDSL_STRICT_SKIPS=1 $(PY) -m pytest -q -m timed
	$(PY) -m tldsl.testing.mutants

mutants: $(VENV)/.installed
	$(PY) -m tldsl.testing.mutants

# On a GPU host (torch + cuda-python + an H200): the GPU tests, with the Python tldsl[gpu] was
# installed into (`make gpu-test PYTHON=.venv/bin/python` for this checkout's virtualenv). A test
# still running after 150 s has every thread's stack printed (pytest's faulthandler), so a stall
# names its place.
gpu-test:
	TLDSL_REQUIRE_GPU=1 $(PYTHON) -m pytest -q -rs -m gpu -o faulthandler_timeout=150 tests

# The same in GPU_WORKERS processes sharing the GPU (pytest-xdist), then the `gpu_alone` tests by
# themselves: with other processes' kernels on the GPU, a trapped kernel's error reached the host only
# after the hang tests' 92 s deadline in two of five such runs (BENCHMARKS.md, fifty-second session).
GPU_WORKERS ?= 14
gpu-test-parallel:
	TLDSL_REQUIRE_GPU=1 $(PYTHON) -m pytest -q -rs -m "gpu and not gpu_alone" -n $(GPU_WORKERS) -o faulthandler_timeout=200 tests
	TLDSL_REQUIRE_GPU=1 $(PYTHON) -m pytest -q -rs -m gpu_alone -o faulthandler_timeout=200 tests
