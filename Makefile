# The two quick-start commands (see README.md), and the checks CI runs.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint docs unit bench wheels grants

setup:
	bash scripts/setup.sh

demo: setup
	$(BIN)/shardvault demo

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

# The documentation site (mkdocs.yml) built in strict mode: broken links and anchors fail.
docs:
	VENV=$(VENV) bash scripts/check_docs.sh

unit:
	$(BIN)/python -m pytest tests/unit -q

# Two runs, two workers each (pytest-xdist; a file's tests stay on one worker). The integration
# tests share a session stack whose moto runs in the worker's process; a unit test's mock_aws
# resets that process's moto, so the two never share a worker. Both run even if one fails.
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile
# The integration tests record every AWS call the local stack authorized or refused
# (shardvault/local/iam); the report fails the run on a refusal no test asked for.
IAM_RECORD := .cache/iam-calls
test: setup lint docs
	rm -rf $(IAM_RECORD)
	SHARDVAULT_IAM_RECORD=$(IAM_RECORD) $(PYTEST) --durations=25 tests/integration; \
	integration=$$?; \
	$(BIN)/python -m shardvault.local.iam.report $(IAM_RECORD); iam=$$?; \
	$(PYTEST) --durations=10 tests/infra tests/local tests/unit; rest=$$?; \
	exit $$((integration | iam | rest))

# The grants the local stack enforces, exported from the synthesized template (after any change
# to infra/: tests/infra fails until they agree).
grants:
	JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION=1 $(BIN)/python -m shardvault.local.iam.template

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
