# The two quick-start commands (see README.md), and the checks CI runs.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint unit bench wheels

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
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25

bench: setup
	$(BIN)/python bench/backup_vs_peers.py

# Wheels of both packages and of every dependency at its pinned version, for hosts that install
# the agent without a checkout: pip install --no-index --find-links dist shardvault-agent
# Needs only python3 and the package index (not the test setup: no PostgreSQL, no MinIO).
wheels:
	rm -rf dist
	python3 -m venv .cache/wheels-venv
	.cache/wheels-venv/bin/pip wheel --quiet --wheel-dir dist \
		-r requirements.txt -r agents/requirements.txt ./ ./agents
	# The packages' build backend: installing from a checkout with --no-index builds them.
	.cache/wheels-venv/bin/pip wheel --quiet --wheel-dir dist "setuptools>=68"
