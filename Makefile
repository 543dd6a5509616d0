# The two set-up commands of the README. Each creates .venv when missing and installs into it.
PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch; on a GPU machine use e.g. `make TORCH_SPEC=torch quickstart`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

# `make test` runs the whole suite, as CI does (.ci/run), over TEST_WORKERS pytest-xdist workers
# (default: one per core), each test file whole on one worker; `make test-fast` is the edit-run
# loop: the same without the files marked slow (tests/conftest.py SLOW), a few minutes.
TEST_WORKERS ?= $(shell OMP_NUM_THREADS= OMP_THREAD_LIMIT= nproc 2>/dev/null || echo 2)
PYTEST := $(PY) -m pytest -q -x --timeout=900 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install quickstart test test-fast lint clean FORCE

# The torch build in the venv follows TORCH_SPEC: a changed spec reinstalls torch (pip alone
# keeps an installed torch that satisfies the new spec, e.g. the CPU build for `torch`). The
# stamp is rewritten only when the spec changes, so the package is not reinstalled otherwise.
$(VENV)/.torch-spec: FORCE
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ "$$(cat $@ 2>/dev/null)" != "$(TORCH_SPEC)" ]; then \
		echo "installing $(TORCH_SPEC) (the venv had: $$(cat $@ 2>/dev/null || echo no recorded spec))"; \
		$(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q --force-reinstall --no-deps "$(TORCH_SPEC)" && \
		$(PY) -m pip install -q "$(TORCH_SPEC)" && echo "$(TORCH_SPEC)" > $@; \
	fi

$(VENV)/.installed: pyproject.toml $(VENV)/.torch-spec
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(VENV)/bin/doremi pipeline experiments/configs/quickstart.yaml

test: install lint
	$(PYTEST) tests

test-fast: install
	$(PYTEST) -m "not slow" tests

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) runs
