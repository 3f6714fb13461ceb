#!/usr/bin/env bash
# Compare the "newest release" E2B SDK pins with what PyPI and npm publish now.
#
#   bash scripts/sdk-latest.sh          # report; exit 1 when a newer e2b release exists
#   bash scripts/sdk-latest.sh --bump   # move the pins to the newest releases (then run setup.sh --test
#                                       # and tests/e2e/test_e2e_sdk_versions.py, and commit)
#
# Pins: tests/sdk-latest/requirements.txt (Python, installed into .venv-sdk-latest) and the
# `e2b-latest` npm alias in tests/js/package.json. The suite's own pins (pyproject.toml, tests/js `e2b`)
# are not touched. See docs/cli.md ("Two pinned SDK pairs").
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
cd "$REPO_ROOT"

BUMP=0
case "${1:-}" in
  --bump) BUMP=1 ;;
  "") ;;
  *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

REQ=tests/sdk-latest/requirements.txt
have_py="$(sed -n 's/^e2b==\([^ ]*\)$/\1/p' "$REQ")"
have_js="$(sed -n 's/.*"e2b-latest": "npm:e2b@\([^"]*\)".*/\1/p' tests/js/package.json)"
new_py="$(.venv/bin/python -m pip index versions e2b 2>/dev/null | sed -n 's/^e2b (\(.*\))$/\1/p')"
new_js="$(npm view e2b version 2>/dev/null)"
[ -n "$new_py" ] && [ -n "$new_js" ] || { echo "sdk-latest: could not ask PyPI/npm for e2b's newest release" >&2; exit 2; }

echo "python e2b: pinned-latest $have_py, newest on PyPI $new_py"
echo "npm    e2b: pinned-latest $have_js, newest on npm  $new_js"
if [ "$have_py" = "$new_py" ] && [ "$have_js" = "$new_js" ]; then
  echo "sdk-latest: up to date"
  exit 0
fi
if [ "$BUMP" -eq 0 ]; then
  echo "sdk-latest: newer releases exist; run: bash scripts/sdk-latest.sh --bump" >&2
  exit 1
fi
sed -i "s/^e2b==.*/e2b==$new_py/" "$REQ"
(cd tests/js && npm install --save-exact --no-audit --no-fund --loglevel=error "e2b-latest@npm:e2b@$new_js")
echo "sdk-latest: pins moved; now: bash scripts/setup.sh --test && .venv/bin/python -m pytest tests/e2e/test_e2e_sdk_versions.py"
