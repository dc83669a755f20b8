# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv and installs
# what it needs (the CPU build of PyTorch when there is no GPU, vLLM's CPU build on x86-64 Linux) before running.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lmrl-installed

.PHONY: setup demo test lint docs docs-serve figures bench clean

$(STAMP): pyproject.toml scripts/install_torch.sh scripts/install_vllm.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[dev,docs,agents]'
	bash scripts/install_vllm.sh $(PY)
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/lmrl train

test: setup
	bash scripts/install_chromium.sh
	$(PY) -m ruff check lmrl tests benchmarks scripts
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder  # files in the order tests/conftest.py sets: the longest first

docs: setup  # the site into site/, offline; strict: a warning (a broken link, a bad docstring) fails the build
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: setup  # the site at http://127.0.0.1:8000, rebuilt on every change
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

figures: setup  # the pages' figure tables, rendered again from benchmarks/results/*.json (a benchmark's --record)
	$(PY) scripts/figures.py

lint: setup
	$(PY) -m ruff check lmrl tests benchmarks scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
