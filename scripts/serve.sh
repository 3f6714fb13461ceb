#!/usr/bin/env bash
# Set up the host (idempotent) and run the agentenv server in the foreground.
# All arguments are passed to `agentenv serve`; configuration comes from AGENTENV_* env vars
# (AGENTENV_DATA_DIR, AGENTENV_HOST, AGENTENV_PORT, AGENTENV_BOOTSTRAP_API_KEY, ...).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
cd "$REPO_ROOT"
bash scripts/setup.sh
exec "$REPO_ROOT/.venv/bin/agentenv" serve "$@"
