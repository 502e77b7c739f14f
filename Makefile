# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv with the CPU build of torch 2.13.0 (from local disk here)
# and installs rayfree in editable mode with its test extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rayfree-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rayfree demo

test: $(STAMP)
	$(PY) -m pytest -n auto

bench: $(STAMP)
	$(PY) bench/transport.py
	$(PY) bench/rpc.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
