#!/usr/bin/env bash
# Set up the host with test dependencies, build/cache the sandbox images and run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/e2e -k files -x`.
# Environment:
#   AGENTENV_TEST_DATA_DIR   data dir for the test server (default /var/tmp/agentenv-test);
#                            images are cached there across runs.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
cd "$REPO_ROOT"

bash scripts/setup.sh --test

export AGENTENV_TEST_DATA_DIR="${AGENTENV_TEST_DATA_DIR:-/var/tmp/agentenv-test}"
export AGENTENV_DATA_DIR="$AGENTENV_TEST_DATA_DIR"
mkdir -p "$AGENTENV_DATA_DIR"

echo "[test] agentenv image build (data dir $AGENTENV_DATA_DIR)" >&2
"$REPO_ROOT/.venv/bin/agentenv" image build

echo "[test] pytest" >&2
set +e
# With a test path among the arguments, run just that (`bash scripts/test.sh tests/e2e -x`); else all.
TARGETS=(tests)
for a in "$@"; do
  case "$a" in tests/*|tests) TARGETS=() ;; esac
done
"$REPO_ROOT/.venv/bin/python" -m pytest "${TARGETS[@]}" -q -rs "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] ERROR: pytest collected no tests (exit 5)" >&2
fi
exit "$rc"
