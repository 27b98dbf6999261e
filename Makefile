# Developer entry points. `make check` is the one test command: README and .ci/run call it.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: check lint test venv fakenvml bench clean

check: lint test

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: venv fakenvml
	$(PY) -m pytest

fakenvml:
	$(MAKE) -C tests/fakenvml

bench: venv fakenvml
	$(PY) bench/holder_scan.py
	$(PY) bench/gate.py

clean:
	rm -rf $(VENV) tests/fakenvml/build .pytest_cache .mypy_cache .ruff_cache
