#!/usr/bin/env bash
# The README's host install, as written: wheels built from the checkout (make wheels), then
# installed into a fresh virtualenv from those wheels alone (--no-index: no package index is
# asked, so no one else's package named "shardvault" can be installed), and both programs start.
set -euo pipefail
cd "$(dirname "$0")/.."
make wheels
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --no-index --find-links dist shardvault-agent
"$venv/bin/shardvault-agent" --version
"$venv/bin/shardvault" --version
"$venv/bin/shardvault-agent" --help >/dev/null
"$venv/bin/shardvault" --help >/dev/null
"$venv/bin/python" -c "import shardvault_agent.daemon, shardvault_agent.restore"
echo "host install from wheels: ok"

# The README's install from a checkout, at the tested versions (constraints.txt); the
# dependencies come from the wheels just built, so this asks no index either.
checkout=$(mktemp -d)
trap 'rm -rf "$venv" "$checkout"' EXIT
python3 -m venv "$checkout"
"$checkout/bin/pip" install --quiet --no-index --find-links dist -c constraints.txt ./ ./agents
"$checkout/bin/shardvault" --help >/dev/null
"$checkout/bin/shardvault-agent" --help >/dev/null
"$checkout/bin/shardvault-agent" init --help >/dev/null
echo "install from the checkout with constraints.txt: ok"
