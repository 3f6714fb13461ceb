#!/usr/bin/env bash
# Install agentenv on this host as systemd services (Debian/Ubuntu, as root). Idempotent.
#
#   bash deploy/install.sh                      # single node: agentenv.service (`agentenv serve`)
#   bash deploy/install.sh --role node          # a cluster node agent
#   bash deploy/install.sh --role gateway --role scheduler --database-url postgresql://...
#
# Options:
#   --role R             all (default; single node) | node | gateway | scheduler; repeatable
#   --database-url URL   AGENTENV_DATABASE_URL (cluster roles: the shared PostgreSQL)
#   --scheduler-url URL  AGENTENV_SCHEDULER_URL (gateway -> scheduler)
#   --node-url URL       AGENTENV_NODE_URL (how the other roles reach this node)
#   --port N             AGENTENV_PORT (default 3000)
#   --prefix DIR         write config and units below DIR instead of / (packaging, tests); implies --no-start
#   --no-start           install the units but do not enable/start them
#   --skip-setup         do not run scripts/setup.sh (dependencies already installed)
#
# What it does:
#   1. scripts/setup.sh: system packages (runsc, nftables, ...) and the virtualenv in this checkout;
#   2. /etc/agentenv/agentenv.env (mode 0600), created once: a generated API key
#      (AGENTENV_BOOTSTRAP_API_KEY) and cluster token (AGENTENV_CLUSTER_TOKEN), plus the options
#      above; an existing file is kept, only options given now are updated;
#   3. /etc/systemd/system/agentenv*.service for the roles, then `systemctl enable --now`.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
ROLES=()
PREFIX=""
START=1
SETUP=1
declare -A SET=()

die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }
log() { printf '[install] %s\n' "$*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --role) [ $# -ge 2 ] || die "--role needs a value"; ROLES+=("$2"); shift 2 ;;
    --database-url) [ $# -ge 2 ] || die "$1 needs a value"; SET[AGENTENV_DATABASE_URL]="$2"; shift 2 ;;
    --scheduler-url) [ $# -ge 2 ] || die "$1 needs a value"; SET[AGENTENV_SCHEDULER_URL]="$2"; shift 2 ;;
    --node-url) [ $# -ge 2 ] || die "$1 needs a value"; SET[AGENTENV_NODE_URL]="$2"; shift 2 ;;
    --port) [ $# -ge 2 ] || die "$1 needs a value"; SET[AGENTENV_PORT]="$2"; shift 2 ;;
    --prefix) [ $# -ge 2 ] || die "$1 needs a value"; PREFIX="$(readlink -m "$2")"; START=0; shift 2 ;;
    --no-start) START=0; shift ;;
    --skip-setup) SETUP=0; shift ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[ "${#ROLES[@]}" -gt 0 ] || ROLES=(all)

UNITS=()
for r in "${ROLES[@]}"; do
  case "$r" in
    all) UNITS+=(agentenv.service) ;;
    node|gateway|scheduler) UNITS+=("agentenv-$r.service") ;;
    *) die "unknown role '$r' (all, node, gateway, scheduler)" ;;
  esac
done
if [ -z "$PREFIX" ] && [ "$(id -u)" -ne 0 ]; then
  die "run as root (or use --prefix DIR to only write the files)"
fi

if [ "$SETUP" -eq 1 ]; then
  log "host setup (scripts/setup.sh)"
  bash "$REPO_ROOT/scripts/setup.sh"
fi
BIN="$REPO_ROOT/.venv/bin/agentenv"
[ -x "$BIN" ] || die "$BIN not found: run without --skip-setup"

# --- configuration -------------------------------------------------------------
ETC="$PREFIX/etc/agentenv"
ENV_FILE="$ETC/agentenv.env"
install -d -m 0755 "$ETC"
random_hex() { od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'; }
if [ ! -f "$ENV_FILE" ]; then
  log "creating $ENV_FILE (API key and cluster token generated)"
  umask 077
  cat > "$ENV_FILE" <<EOF
# agentenv settings (AGENTENV_*; see docs/configuration.md). Read by every agentenv unit.
# The data dir is set per unit (systemctl edit agentenv.service to change it).
AGENTENV_HOST=0.0.0.0
AGENTENV_PORT=3000
# The first API key (team "default"); more with: agentenv keys create
AGENTENV_BOOTSTRAP_API_KEY=e2b_$(random_hex 20)
# Shared secret of the cluster roles (node, gateway, scheduler): copy it to every host.
AGENTENV_CLUSTER_TOKEN=$(random_hex 32)
EOF
  umask 022
fi
chmod 0600 "$ENV_FILE"
for key in "${!SET[@]}"; do
  value="${SET[$key]}"
  if grep -q "^$key=" "$ENV_FILE"; then
    tmp="$(mktemp "$ETC/.env.XXXXXX")"
    awk -v k="$key" -v v="$value" 'BEGIN{FS=OFS="="} $1==k {print k "=" v; next} {print}' "$ENV_FILE" > "$tmp"
    chmod 0600 "$tmp"
    mv "$tmp" "$ENV_FILE"
  else
    printf '%s=%s\n' "$key" "$value" >> "$ENV_FILE"
  fi
done

# --- systemd units -------------------------------------------------------------
UNIT_DIR="$PREFIX/etc/systemd/system"
install -d -m 0755 "$UNIT_DIR"
for unit in "${UNITS[@]}"; do
  sed -e "s|@AGENTENV_BIN@|$BIN|g" -e "s|@ENV_FILE@|/etc/agentenv/agentenv.env|g" -e "s|@REPO@|$REPO_ROOT|g" \
    "$REPO_ROOT/deploy/systemd/$unit" > "$UNIT_DIR/$unit.tmp"
  chmod 0644 "$UNIT_DIR/$unit.tmp"
  mv "$UNIT_DIR/$unit.tmp" "$UNIT_DIR/$unit"
  log "wrote $UNIT_DIR/$unit"
done

if [ "$START" -eq 1 ]; then
  systemctl daemon-reload
  systemctl enable --now "${UNITS[@]}"
  log "started: ${UNITS[*]} (logs: journalctl -u ${UNITS[0]} -f)"
fi

API_KEY="$(sed -n 's/^AGENTENV_BOOTSTRAP_API_KEY=//p' "$ENV_FILE")"
PORT="$(sed -n 's/^AGENTENV_PORT=//p' "$ENV_FILE")"
cat <<EOF

agentenv installed (${ROLES[*]}). Point the E2B SDKs at it:
  export E2B_API_URL=http://$(hostname -f 2>/dev/null || hostname):${PORT:-3000}
  export E2B_SANDBOX_URL=\$E2B_API_URL
  export E2B_API_KEY=$API_KEY
EOF
