# Every target sets up what it needs: a fresh clone runs `make demo` or `make test` directly.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Reinstall when the declared dependencies change.
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: demo test lint typecheck unit clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $@

## The main job: a short benchmark of the strategies on both frameworks (table + plot).
demo: $(STAMP)
	$(PY) -m recomp bench --framework all --json out/bench.json --plot out/bench.png

## Everything CI checks: lint, types, and the whole test suite.
test: lint typecheck unit

lint: $(STAMP)
	$(PY) -m ruff check src tests examples tools

typecheck: $(STAMP)
	$(PY) -m mypy

unit: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache .hypothesis
