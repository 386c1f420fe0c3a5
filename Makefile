# The two quick-start commands (see README.md), and the checks CI runs.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint unit bench

setup:
	bash scripts/setup.sh

demo: setup
	$(BIN)/shardvault demo

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

unit:
	$(BIN)/python -m pytest tests/unit -q

test: setup lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: setup
	$(BIN)/python bench/backup_vs_peers.py
