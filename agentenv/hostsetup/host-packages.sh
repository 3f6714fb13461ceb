#!/usr/bin/env bash
# agentenv's host packages (Debian/Ubuntu, as root): runsc (gVisor >= 20240729), debootstrap, nftables,
# QEMU, Node.js/npm, ...; packages already installed are skipped, so a second run is a no-op.
#
#   bash host-packages.sh [--test] [--check]
#     --test    also what the test suite needs (chromium, postgresql, openssl, musl-tools, gcc, ...)
#     --check   install nothing: list the missing packages and exit 1 if there are any
#
# Shipped inside the wheel (agentenv/hostsetup/) and run by `agentenv setup`; scripts/setup.sh in a
# checkout sources it, so a bare-metal install, the container image and a pip install share one list.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
CHECK_ONLY=0

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
MISSING_PKGS=()
apt_install() {
  # Install the given packages that are not installed yet; no-op when all are present.
  local missing=() p
  for p in "$@"; do
    pkg_installed "$p" || missing+=("$p")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  if [ "$CHECK_ONLY" -eq 1 ]; then
    MISSING_PKGS+=("${missing[@]}")
    return 0
  fi
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


agentenv_host_packages() {
  # $1: 1 to add what the tests need
  local WITH_TEST="${1:-0}" have
  SYSTEM_PKGS=(debootstrap iproute2 nftables util-linux procps psmisc ca-certificates)
  # haproxy: the data plane (sandbox traffic, HTTPS; docs/proxy.md). Debian's package enables a
  # systemd unit whose default configuration listens nowhere; agentenv runs its own instance.
  SYSTEM_PKGS+=(haproxy)
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
    # shellcheck disable=SC1091  # the host's file, not ours
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
      if [ "$CHECK_ONLY" -eq 1 ]; then
        MISSING_PKGS+=("runsc(>=$RUNSC_MIN)")
      else
        agentenv_runsc_source
      fi
      if [ "$CHECK_ONLY" -eq 1 ]; then
        :
      elif pkg_installed runsc; then
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
    # dnsmasq-base: the wildcard DNS of tests/proxy/test_proxy_https.py (the binary only: no system
    # service that would take port 53).
    SYSTEM_PKGS+=(dnsmasq-base)
    SYSTEM_PKGS+=(openssl)
    # musl-tools + busybox-static: tests/templates builds a musl/BusyBox (Alpine-like) OCI image offline.
    SYSTEM_PKGS+=(musl-tools busybox-static file)
    # gcc + libc6-dev: C test programs (the Firecracker test guest, musl-gcc's driver, benchmarks/).
    SYSTEM_PKGS+=(gcc libc6-dev)
    # podman + runc: tests/packaging builds the server image from the Dockerfile and runs it (runc:
    # Debian 12's crun refuses hosts with cgroup v1 + v2 controllers, "hybrid mode").
    SYSTEM_PKGS+=(podman runc)
  fi
  apt_install "${SYSTEM_PKGS[@]}"
  [ "$CHECK_ONLY" -eq 0 ] || return 0
  command -v runsc >/dev/null 2>&1 || die "runsc (gVisor) is not installed and could not be installed"
  have="$(runsc_date "$(command -v runsc)" || true)"
  if [ -z "$have" ] || [ "$have" -lt "$RUNSC_MIN" ]; then
    log "WARNING: runsc $(command -v runsc) is release ${have:-unknown}; agentenv needs $RUNSC_MIN or newer" \
        "(install gVisor's release, or enable your distribution's newer runsc); 'agentenv doctor' says more"
  fi
}

# Run directly (not sourced by scripts/setup.sh): parse the arguments and install.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  WITH_TEST=0
  for arg in "$@"; do
    case "$arg" in
      --test) WITH_TEST=1 ;;
      --check) CHECK_ONLY=1 ;;
      -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) echo "host-packages.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
  done
  agentenv_host_packages "$WITH_TEST"
  if [ "$CHECK_ONLY" -eq 1 ]; then
    if [ "${#MISSING_PKGS[@]}" -gt 0 ]; then
      printf 'missing: %s\n' "${MISSING_PKGS[*]}"
      exit 1
    fi
    echo "all host packages are installed"
  else
    log "host packages done"
  fi
fi
