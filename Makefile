# The two set-up commands of the README. Each creates .venv when missing and installs into it.
PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch; on a GPU machine use e.g. `make TORCH_SPEC=torch quickstart`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install quickstart test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(VENV)/bin/doremi pipeline experiments/configs/quickstart.yaml

test: install lint
	$(PY) -m pytest -q -x --timeout=900 tests

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) runs
