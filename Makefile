# Two commands do all the set-up (see README): `make run` and `make test` (which also builds the docs site).
# torch is pinned to 2.13.0 so that pip takes the CPU build instead of a multi-GB CUDA wheel;
# GPU users install their own torch first (README, "GPU").
PYTHON ?= python3.11
TORCH ?= torch==2.13.0
# main stack: Lightning 2.6 (pytorch_lightning and lightning.pytorch), finetuning-scheduler, transformers + peft
VENV ?= .venv
BIN := $(VENV)/bin
# Flash stack: pytorch-lightning 1.9.5 + lightning-flash 0.8.2 (cannot share an environment with 2.x)
FLASH_VENV ?= .venv-flash
FLASH_BIN := $(FLASH_VENV)/bin

.PHONY: run demo test test-main test-flash lint typecheck docs docs-generate docs-serve bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) -e ".[lightning,fts,hf,demo,dev,docs]"
	touch $@

$(FLASH_BIN)/.installed: pyproject.toml requirements/flash.txt requirements/flash-constraints.txt
	$(PYTHON) -m venv $(FLASH_VENV)
	$(FLASH_BIN)/pip install --quiet $(TORCH)
	$(FLASH_BIN)/pip install --quiet -r requirements/flash.txt
	$(FLASH_BIN)/pip install --quiet --no-deps -e .
	touch $@

run: $(BIN)/.installed
	$(BIN)/retune demo

lint: $(BIN)/.installed
	$(BIN)/ruff check retune tests examples docs/hooks
	$(BIN)/ruff format --check retune

typecheck: $(BIN)/.installed
	$(BIN)/mypy retune

test-main: $(BIN)/.installed
	mkdir -p build
	$(BIN)/python -m pytest --junitxml=build/junit-main.xml
	$(BIN)/python .ci/count_tests.py build/junit-main.xml "main stack (Lightning 2.6)"

test-flash: $(FLASH_BIN)/.installed
	mkdir -p build
	$(FLASH_BIN)/python -m pytest -p no:cacheprovider --junitxml=build/junit-flash.xml
	$(FLASH_BIN)/python .ci/count_tests.py build/junit-flash.xml "flash stack (Lightning 1.9.5 + Flash 0.8.2)"

# The docs site (mkdocs.yml, docs/): --strict fails on a broken link, an unknown anchor, a page left
# out of the nav or a docstring reference that does not resolve.
docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The reference pages' generated sections (schedule fields, CLI help), committed so GitHub shows them too;
# tests/project/test_docs.py fails while they lag the code.
docs-generate: $(BIN)/.installed
	$(BIN)/python docs/hooks/generated.py --write

docs-serve: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test: docs lint typecheck test-main test-flash

bench: $(BIN)/.installed
	$(BIN)/python -m tests.benchmarks.run

clean:
	rm -rf $(VENV) $(FLASH_VENV) build site .mypy_cache .ruff_cache .pytest_cache
