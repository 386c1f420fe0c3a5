#!/usr/bin/env bash
# Prepares a machine for ShardVault's tests and local stack:
#
#   * PostgreSQL 15 server programs and pgBackRest, MariaDB 10.11 (server, client and
#     mariabackup; no service) (Debian packages),
#   * a Python venv (.venv) with requirements-dev.txt and the two packages (editable),
#     installed by uv (requirements-setup.txt; pip where uv cannot be installed),
#   * MinIO, built from source at a pinned version with `go install` (Go from Debian if absent),
#   * fake-gcs-server (Google Cloud Storage for the tests), built the same way.
#
# Idempotent: each step checks first and does nothing when its result is already there, so a
# second run takes about a second. Installing packages needs root on Debian 12; as another
# user the script works as long as nothing has to be installed.
#
# Environment:
#   SHARDVAULT_SKIP_MINIO=1   do not build MinIO nor fake-gcs-server (nor install Go)
#   SHARDVAULT_MINIO_BIN      a minio binary to use instead of building one
#   SHARDVAULT_FAKE_GCS_BIN   a fake-gcs-server binary to use instead of building one
#   PYTHON                    interpreter for a new venv (default: python3)
#   VENV                      the venv (default: .venv, as in the Makefile)
#
# Command output goes to .cache/setup/<step>.log; the terminal gets one line per step.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PG_MAJOR=15
PG_BIN="/usr/lib/postgresql/$PG_MAJOR/bin"
MINIO_MODULE="github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"
MINIO_GO_MIN="1.24"   # the `go` line of that MinIO version's go.mod
FAKE_GCS_MODULE="github.com/fsouza/fake-gcs-server@v1.56.1"
FAKE_GCS_GO_MIN="1.26" # the `go` line of that version's go.mod
GO_TOOLCHAIN_MIN="1.21" # from this version on, Go fetches a newer toolchain by itself
VENV="${VENV:-.venv}"
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
STAMP="$VENV/.shardvault-setup.sha256"
LOGS="$ROOT/.cache/setup"
mkdir -p "$LOGS"

# --- reporting ------------------------------------------------------------------------------
STEP="" STEP_LOG="/dev/null" STEP_START=0
now_us() { echo "${EPOCHREALTIME//[!0-9]/}"; } # EPOCHREALTIME's decimal point is locale-dependent

begin() {
    STEP=$1
    STEP_LOG="$LOGS/$1.log"
    : >"$STEP_LOG"
    STEP_START=$(now_us)
}

finish() {
    local us=$(($(now_us) - STEP_START))
    printf '[setup] %-12s %-58s %4d.%01ds\n' "$STEP" "$1" $((us / 1000000)) $((us / 100000 % 10))
}

die() {
    printf '[setup] %-12s FAILED: %s\n' "$STEP" "$1" >&2
    if [ -s "$STEP_LOG" ]; then
        echo "--- last lines of $STEP_LOG:" >&2
        tail -n 20 "$STEP_LOG" >&2
    fi
    exit 1
}

# --- apt ------------------------------------------------------------------------------------
APT_UPDATED=0

apt_install() {
    [ "$(id -u)" -eq 0 ] || die "need root to install $* (run: sudo $0)"
    command -v apt-get >/dev/null || die "no apt-get: install $* by hand"
    export DEBIAN_FRONTEND=noninteractive
    if [ "$APT_UPDATED" -eq 0 ]; then # once per run, and only because something is missing
        apt-get update -q >>"$STEP_LOG" 2>&1 || die "apt-get update failed"
        APT_UPDATED=1
    fi
    apt-get install -y -q --no-install-recommends "$@" >>"$STEP_LOG" 2>&1 ||
        die "apt-get install $* failed"
}

# --- steps ----------------------------------------------------------------------------------
step_postgres() {
    begin postgres
    local missing=()
    [ -x "$PG_BIN/initdb" ] || missing+=("postgresql-$PG_MAJOR" "postgresql-contrib-$PG_MAJOR")
    command -v pgbackrest >/dev/null || missing+=(pgbackrest)
    # runuser runs the servers as the postgres user when we are root (initdb refuses root).
    command -v runuser >/dev/null || missing+=(util-linux)
    if [ ${#missing[@]} -eq 0 ]; then
        finish "PostgreSQL $PG_MAJOR and pgBackRest present"
        return
    fi
    if [ ! -x "$PG_BIN/initdb" ]; then
        # The package would create and start a 'main' cluster on port 5432 that nothing
        # uses (tests run their own instances): switch that off before installing the server.
        dpkg -s postgresql-common >/dev/null 2>&1 || apt_install postgresql-common
        local conf=/etc/postgresql-common/createcluster.conf
        if [ -f "$conf" ] && ! grep -Eq '^[[:space:]]*create_main_cluster' "$conf"; then
            echo "create_main_cluster = false" >>"$conf"
        fi
    fi
    apt_install "${missing[@]}"
    [ -x "$PG_BIN/initdb" ] || die "$PG_BIN/initdb still missing after apt-get install"
    finish "installed ${missing[*]}"
}

step_mariadb() {
    begin mariadb
    # The server, client and backup programs only: not the mariadb-server package, whose
    # service would start a server on port 3306 that nothing uses (tests run their own).
    local missing=()
    command -v mariadbd >/dev/null || [ -x /usr/sbin/mariadbd ] || missing+=(mariadb-server-core)
    command -v mariadb-admin >/dev/null || missing+=(mariadb-client)
    command -v mariabackup >/dev/null || missing+=(mariadb-backup)
    if [ ${#missing[@]} -gt 0 ]; then
        apt_install "${missing[@]}"
    fi
    # Servers run as the mysql OS user when we are root (mariadbd refuses root otherwise);
    # the mariadb-server package would create it.
    if [ "$(id -u)" -eq 0 ] && ! id mysql >/dev/null 2>&1; then
        useradd --system --no-create-home --shell /usr/sbin/nologin mysql >>"$STEP_LOG" 2>&1 ||
            die "could not create the mysql user"
    fi
    if [ ${#missing[@]} -eq 0 ]; then
        finish "MariaDB and mariabackup present"
    else
        finish "installed ${missing[*]}"
    fi
}

step_systemd() {
    begin systemd
    # The tests check the agent's unit (agents/systemd/) with systemd-analyze.
    if command -v systemd-analyze >/dev/null; then
        finish "systemd-analyze present"
        return
    fi
    apt_install systemd
    finish "installed systemd (for systemd-analyze)"
}

step_venv() {
    begin venv
    if [ -x "$VENV/bin/python" ]; then
        finish "${VENV#"$ROOT"/} present ($("$VENV/bin/python" -V 2>&1))"
        return
    fi
    local python=${PYTHON:-python3}
    if ! command -v "$python" >/dev/null; then
        apt_install python3 python3-venv
        python=python3
    fi
    # Debian splits venv's pip bootstrap into python3-venv; without it `-m venv` fails late.
    if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        apt_install python3-venv
    fi
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        die "$("$python" -V 2>&1) is too old: ShardVault needs Python >= 3.11 (set PYTHON)"
    "$python" -m venv "$VENV" >>"$STEP_LOG" 2>&1 || die "$python -m venv failed"
    finish "created ${VENV#"$ROOT"/} ($("$VENV/bin/python" -V 2>&1))"
}

# requirement files and those they include (-r), relative to the including file
requirement_files() {
    local file=$1 dir inc
    [ -f "$file" ] || return 0
    echo "$file"
    dir=$(dirname "$file")
    sed -nE 's/^[[:space:]]*(-r|--requirement)[[:space:]=]+([^[:space:]#]+).*/\2/p' "$file" |
        while read -r inc; do requirement_files "$dir/$inc"; done
}

step_pip() {
    begin pip
    local files=() editable=() f
    mapfile -t files < <(requirement_files requirements-setup.txt; requirement_files requirements-dev.txt)
    [ -f pyproject.toml ] && files+=(pyproject.toml) && editable+=(-e .)
    [ -f agents/pyproject.toml ] && files+=(agents/pyproject.toml) && editable+=(-e agents)
    # The stamp covers every input of the install, the interpreter included.
    local hash
    hash=$(
        {
            "$VENV/bin/python" -VV
            for f in "${files[@]}"; do
                echo "== $f"
                cat "$f"
            done
        } | sha256sum | cut -d' ' -f1
    )
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$hash" ]; then
        finish "packages up to date (stamp matches ${#files[@]} files)"
        return
    fi
    rm -f "$STAMP"
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check) install how
    # uv (requirements-setup.txt) installs the same pins as pip in seconds, not minutes; pip
    # stays the way where uv has no wheel for this platform. No bytecode is compiled up front
    # (pip compiled every file of every package): Python compiles what it imports, once.
    if "${pip[@]}" install -r requirements-setup.txt >>"$STEP_LOG" 2>&1; then
        install=("$VENV/bin/uv" pip install --python "$VENV/bin/python") how=uv
    else
        echo "uv could not be installed (see above): installing with pip" >>"$STEP_LOG"
        install=("${pip[@]}" install) how=pip
    fi
    "${install[@]}" -r requirements-dev.txt "${editable[@]}" >>"$STEP_LOG" 2>&1 ||
        die "$how install -r requirements-dev.txt ${editable[*]} failed"
    echo "$hash" >"$STAMP"
    finish "installed requirements-dev.txt ${editable[*]} ($how)"
}

# the binary shardvault.local.minio would use, or nothing
minio_binary() {
    "$VENV/bin/python" -c '
from shardvault.local.minio import find_minio_binary
print(find_minio_binary() or "")'
}

version_at_least() { # version_at_least HAVE NEED
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

step_go() { # step_go NEED: a Go that builds a module whose go.mod says NEED
    local need=$1
    begin go
    if ! command -v go >/dev/null; then
        # Go's own tarball installs here without touching PATH.
        [ -x /usr/local/go/bin/go ] && export PATH="/usr/local/go/bin:$PATH"
    fi
    if ! command -v go >/dev/null; then
        apt_install golang-go ca-certificates git
    fi
    local version
    version=$(go env GOVERSION)
    version=${version#go}
    if version_at_least "$version" "$need"; then
        finish "go $version at $(command -v go)"
    elif version_at_least "$version" "$GO_TOOLCHAIN_MIN"; then
        # Go fetches go$need+ as a module (golang.org/toolchain) from the module proxy.
        export GOTOOLCHAIN=auto
        finish "go $version; the build fetches a newer toolchain (GOTOOLCHAIN=auto)"
    else
        die "go $version ($(command -v go)) is too old for a go.mod that needs go >= $need, \
and Go < $GO_TOOLCHAIN_MIN cannot fetch a newer toolchain (Debian 12's golang-go \
is 1.19). Fix: install Go >= $GO_TOOLCHAIN_MIN (bookworm-backports) or >= $need (go.dev) \
first on PATH, or set SHARDVAULT_MINIO_BIN and SHARDVAULT_FAKE_GCS_BIN to built binaries."
    fi
}

step_minio() {
    begin minio
    if [ "${SHARDVAULT_SKIP_MINIO:-0}" = 1 ]; then
        finish "skipped (SHARDVAULT_SKIP_MINIO=1)"
        return
    fi
    local found
    found=$(minio_binary)
    if [ -n "$found" ]; then
        finish "present: $found"
        return
    fi
    [ -z "${SHARDVAULT_MINIO_BIN:-}" ] ||
        die "SHARDVAULT_MINIO_BIN=$SHARDVAULT_MINIO_BIN is not an executable file"
    step_go "$MINIO_GO_MIN"
    begin minio
    # -mod=mod: build MinIO's own module graph, whatever GOFLAGS this machine sets.
    GOFLAGS=-mod=mod go install "$MINIO_MODULE" >>"$STEP_LOG" 2>&1 ||
        die "go install $MINIO_MODULE failed"
    found=$(minio_binary)
    [ -n "$found" ] || die "go install succeeded but no minio was found (check GOBIN/GOPATH)"
    finish "built $found"
}

# the binary shardvault.local.fakegcs would use, or nothing
fake_gcs_binary() {
    "$VENV/bin/python" -c '
from shardvault.local.fakegcs import find_fake_gcs_binary
print(find_fake_gcs_binary() or "")'
}

step_fake_gcs() {
    begin fake-gcs
    if [ "${SHARDVAULT_SKIP_MINIO:-0}" = 1 ]; then
        finish "skipped (SHARDVAULT_SKIP_MINIO=1)"
        return
    fi
    local found
    found=$(fake_gcs_binary)
    if [ -n "$found" ]; then
        finish "present: $found"
        return
    fi
    [ -z "${SHARDVAULT_FAKE_GCS_BIN:-}" ] ||
        die "SHARDVAULT_FAKE_GCS_BIN=$SHARDVAULT_FAKE_GCS_BIN is not an executable file"
    step_go "$FAKE_GCS_GO_MIN"
    begin fake-gcs
    GOFLAGS=-mod=mod go install "$FAKE_GCS_MODULE" >>"$STEP_LOG" 2>&1 ||
        die "go install $FAKE_GCS_MODULE failed"
    found=$(fake_gcs_binary)
    [ -n "$found" ] || die "go install succeeded but no fake-gcs-server was found (check GOBIN/GOPATH)"
    finish "built $found"
}

step_postgres
step_mariadb
step_systemd
step_venv
step_pip
step_minio
step_fake_gcs
