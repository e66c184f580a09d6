# Two commands do all the set-up (see README): `make run` and `make test`.
# torch is pinned to 2.13.0 so that pip takes the CPU build instead of a multi-GB CUDA wheel;
# GPU users install their own torch first (README, "GPU").
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: run test lint typecheck unit clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) -e ".[lightning,fts,dev]"
	touch $@

run: $(BIN)/.installed
	$(BIN)/retune validate schedules/*

lint: $(BIN)/.installed
	$(BIN)/ruff check retune tests examples
	$(BIN)/ruff format --check retune

typecheck: $(BIN)/.installed
	$(BIN)/mypy retune

unit: $(BIN)/.installed
	$(BIN)/python -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
