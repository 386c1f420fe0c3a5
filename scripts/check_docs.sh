#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml, docs/) in strict mode: any warning fails, and
# mkdocs.yml's validation settings make a warning of every broken link, missing anchor and
# page left out of the nav. Uses the venv in $VENV (default .venv), into which
# requirements-docs.txt has been installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
site="${TMPDIR:-/tmp}/shardvault-site"
if [ ! -x "$VENV/bin/mkdocs" ]; then
    echo "check_docs: $VENV/bin/mkdocs not found; install it: $VENV/bin/pip install -r requirements-docs.txt" >&2
    exit 1
fi
"$VENV/bin/mkdocs" build --strict --clean --site-dir "$site"
echo "docs: ok ($site)"
