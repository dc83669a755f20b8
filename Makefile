# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv and installs
# what it needs (the CPU build of PyTorch when there is no GPU, vLLM's CPU build on x86-64 Linux) before running.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lmrl-installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml scripts/install_torch.sh scripts/install_vllm.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	bash scripts/install_vllm.sh $(PY)
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/lmrl train

test: setup
	bash scripts/install_chromium.sh
	$(PY) -m ruff check lmrl tests benchmarks scripts
	$(PY) -m pytest -q -n auto --dist loadfile

lint: setup
	$(PY) -m ruff check lmrl tests benchmarks scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
