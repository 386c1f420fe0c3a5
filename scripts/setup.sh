#!/usr/bin/env bash
# Installs what ShardVault's demo and tests need on a Debian machine, idempotently and quickly
# when everything is already there: PostgreSQL 15 (Debian's packages), the pinned MinIO (built
# with go install), and a Python venv with the pinned requirements.
set -euo pipefail
cd "$(dirname "$0")/.."

MINIO_MODULE="github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"
VENV="${VENV:-.venv}"
step() { printf '[setup] %s\n' "$*"; }
timed() { local t0=$SECONDS; "$@"; step "  done in $((SECONDS - t0)) s"; }

apt_updated=""
apt_install() {
  if [ "$(id -u)" != 0 ]; then
    echo "[setup] need root (or sudo) to apt-get install $*" >&2
    exit 1
  fi
  if [ -z "$apt_updated" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# PostgreSQL server (tests and the postgres demo run real instances).
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  step "installing PostgreSQL 15 from Debian's packages"
  timed apt_install postgresql-15 postgresql-contrib-15
fi
command -v runuser >/dev/null || apt_install util-linux

# MinIO: the pinned build, the store with real S3 checksum semantics.
minio_bin() {
  if [ -n "${SHARDVAULT_MINIO_BIN:-}" ] && [ -x "$SHARDVAULT_MINIO_BIN" ]; then echo "$SHARDVAULT_MINIO_BIN"; return; fi
  if command -v minio >/dev/null; then command -v minio; return; fi
  if command -v go >/dev/null && [ -x "$(go env GOPATH)/bin/minio" ]; then echo "$(go env GOPATH)/bin/minio"; return; fi
  if [ -x "$HOME/go/bin/minio" ]; then echo "$HOME/go/bin/minio"; fi
}
if [ -z "${SHARDVAULT_SKIP_MINIO:-}" ] && [ -z "$(minio_bin)" ]; then
  if ! command -v go >/dev/null; then
    step "installing Go from Debian's packages"
    apt_install golang-go
  fi
  step "building MinIO ($MINIO_MODULE) with go install: about 5 minutes, once"
  timed env GOFLAGS=-mod=mod go install "$MINIO_MODULE"
fi

# Python: a venv with the pinned requirements, the core package and the agent.
if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  python3 -m venv "$VENV"
fi
stamp="$VENV/.shardvault-setup"
want=$(cat requirements*.txt agents/requirements.txt pyproject.toml agents/pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  step "installing Python packages into $VENV"
  timed "$VENV/bin/pip" install -q --disable-pip-version-check -r requirements-dev.txt -e . -e agents
  echo "$want" > "$stamp"
fi
step "ready: PostgreSQL $(ls /usr/lib/postgresql | sort -n | tail -1), MinIO ${SHARDVAULT_SKIP_MINIO:+skipped}$(minio_bin), $($VENV/bin/python --version)"
