# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,nvrtc]'
	$(PY) -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
	# torch (a CPU build is enough) lets the distributed runtime's host-side tests run without a GPU
	$(PY) -m pip install -q torch==2.13.0
	touch $@

.PHONY: install demo test mutants gpu-test
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m tldsl.demo

test: $(VENV)/.installed
	TLDSL_STRICT_SKIPS=1 $(PY) -m pytest -q
	$(PY) -m tldsl.testing.mutants

mutants: $(VENV)/.installed
	$(PY) -m tldsl.testing.mutants

# On a GPU host (torch + cuda-python + an H200): the GPU tests, then the GEMM benchmark.
gpu-test:
	TLDSL_REQUIRE_GPU=1 python3 -m pytest -q -rs -m gpu tests
