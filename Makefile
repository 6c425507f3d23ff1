# Every target sets up what it needs: a fresh clone runs `make demo` or `make test` directly.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Reinstall when the declared dependencies change.
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

# The oldest supported PyTorch, for its own test run (PyTorch tests only).
RANGE_VENV ?= .venv-torch2.9
RANGE_PY := $(RANGE_VENV)/bin/python
RANGE_REQUIREMENTS := requirements/torch-oldest.txt
RANGE_STAMP := $(RANGE_VENV)/.installed-$(shell cat pyproject.toml $(RANGE_REQUIREMENTS) | cksum | cut -d' ' -f1)

# torchtitan, for the recipe in examples/torchtitan (optional; not part of `make test`).
TITAN_VENV ?= .venv-torchtitan
TITAN_PY := $(TITAN_VENV)/bin/python
TITAN_REQUIREMENTS := requirements/torchtitan.txt
TITAN_STAMP := $(TITAN_VENV)/.installed-$(shell cat pyproject.toml $(TITAN_REQUIREMENTS) | cksum | cut -d' ' -f1)

# Test processes (pytest-xdist), each running whole files: the distributed tests' module
# fixtures start their process groups once. Two fit this machine's two cores.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile

# The trainers recomp plugs into (Megatron-Core, DeepSpeed, Lightning, TRL), for
# tests/trainers (optional; not part of `make test`).
TRAINERS_VENV ?= .venv-trainers
TRAINERS_PY := $(TRAINERS_VENV)/bin/python
TRAINERS_REQUIREMENTS := requirements/trainers.txt
TRAINERS_STAMP := $(TRAINERS_VENV)/.installed-$(shell cat pyproject.toml $(TRAINERS_REQUIREMENTS) | cksum | cut -d' ' -f1)

# The documentation site (MkDocs), in its own environment: no framework needed, the
# reference is read from the sources.
DOCS_VENV ?= .venv-docs
DOCS_PY := $(DOCS_VENV)/bin/python
DOCS_REQUIREMENTS := requirements/docs.txt
DOCS_STAMP := $(DOCS_VENV)/.installed-$(shell cat pyproject.toml $(DOCS_REQUIREMENTS) | cksum | cut -d' ' -f1)
SCREENSHOT ?= out/site-front.png

.PHONY: docs docs-check browser demo test test-system test-all dev-env torch-range-env test-torch-range test-torchtitan trainers-env test-trainers lint typecheck unit clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $@

$(RANGE_STAMP): pyproject.toml $(RANGE_REQUIREMENTS)
	test -x $(RANGE_PY) || $(PYTHON) -m venv $(RANGE_VENV)
	$(RANGE_PY) -m pip install --quiet --disable-pip-version-check -e ".[torch]" -r $(RANGE_REQUIREMENTS)
	rm -f $(RANGE_VENV)/.installed-* && touch $@

$(TITAN_STAMP): pyproject.toml $(TITAN_REQUIREMENTS)
	test -x $(TITAN_PY) || $(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_PY) -m pip install --quiet --disable-pip-version-check -e ".[torch]" -r $(TITAN_REQUIREMENTS)
	rm -f $(TITAN_VENV)/.installed-* && touch $@

$(TRAINERS_STAMP): pyproject.toml $(TRAINERS_REQUIREMENTS)
	test -x $(TRAINERS_PY) || $(PYTHON) -m venv $(TRAINERS_VENV)
	$(TRAINERS_PY) -m pip install --quiet --disable-pip-version-check --ignore-requires-python -e ".[torch]" -r $(TRAINERS_REQUIREMENTS)
	rm -f $(TRAINERS_VENV)/.installed-* && touch $@

$(DOCS_STAMP): pyproject.toml $(DOCS_REQUIREMENTS)
	test -x $(DOCS_PY) || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_PY) -m pip install --quiet --disable-pip-version-check -r $(DOCS_REQUIREMENTS)
	$(DOCS_PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	rm -f $(DOCS_VENV)/.installed-* && touch $@

## The documentation site, built into site/ with --strict: a broken link or anchor, a page
## outside the navigation or a docstring reference that does not resolve fails it.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_PY) -m mkdocs build --strict --site-dir site

## The built site as a user sees it: front page, a guide, the reference and
## Troubleshooting in headless Chromium (Debian's chromium, chromium-driver); fails on
## console errors, images that do not load and public names missing from the reference.
docs-check: docs browser
	$(DOCS_PY) tools/docs/check_site.py --site site --screenshot $(SCREENSHOT)

## Debian's Chromium and its driver, installed when missing (as root, or through sudo).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; }

## The main job: a short benchmark of the strategies on both frameworks (table + plot).
demo: $(STAMP)
	$(PY) -m recomp bench --framework all --json out/bench.json --plot out/bench.png

## What to run before every commit: lint, types, and the tests except the system-level ones.
test: lint typecheck unit

## The system-level tests (marked `system`): whole commands, several processes, compiler
## backends, long soaks. CI runs them after `make test`.
test-system: $(STAMP)
	RECOMP_TEST_REQUIRE=torch,mindspore $(PY) -m pytest -q $(PYTEST_PARALLEL) -m system

## Everything CI checks, in the dev set.
test-all: test test-system

lint: $(STAMP)
	$(PY) -m ruff check src tests examples tools benchmarks

typecheck: $(STAMP)
	$(PY) -m mypy

unit: $(STAMP)
	RECOMP_TEST_REQUIRE=torch,mindspore $(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not system"

## The development environment alone (what every target above sets up first).
dev-env: $(STAMP)

## The oldest supported PyTorch's environment (about 7 GB downloaded: .ci/run builds it
## while the dev set's tests run).
torch-range-env: $(RANGE_STAMP)

## The PyTorch tests on the oldest supported PyTorch (2.9.1), in their own environment:
## those `make test` runs (RANGE_MARKERS= runs the system-level ones too). The MindSpore
## tests skip there (MindSpore 2.10 needs numpy<2; the dev set runs them).
RANGE_MARKERS ?= not system
test-torch-range: $(RANGE_STAMP)
	RECOMP_TEST_REQUIRE=torch $(RANGE_PY) -m pytest -q $(PYTEST_PARALLEL) $(if $(RANGE_MARKERS),-m "$(RANGE_MARKERS)")

## The torchtitan recipe (examples/torchtitan) on torchtitan's llama3 debug model, in its
## own environment (torchtitan wants numpy 2). Optional: `make test` does not need it.
test-torchtitan: $(TITAN_STAMP)
	PYTHONPATH=examples/torchtitan $(TITAN_PY) -m pytest -q -p no:cacheprovider examples/torchtitan

## The trainers' environment alone (about 6 GB).
trainers-env: $(TRAINERS_STAMP)

## recomp inside Megatron-Core, DeepSpeed, Lightning and TRL (tests/trainers), in their own
## environment, several processes on gloo. Optional: `make test` skips these files.
test-trainers: $(TRAINERS_STAMP)
	RECOMP_TEST_REQUIRE=torch,megatron.core,deepspeed,lightning,trl $(TRAINERS_PY) -m pytest -q $(PYTEST_PARALLEL) tests/trainers

clean:
	rm -rf $(VENV) $(RANGE_VENV) $(TITAN_VENV) $(TRAINERS_VENV) $(DOCS_VENV) site out .pytest_cache .mypy_cache .ruff_cache .hypothesis
