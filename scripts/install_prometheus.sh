#!/usr/bin/env bash
# Installs Prometheus and promtool from the Debian package `prometheus` (for tests/monitoring).
#
# The tests run the binary themselves on a temporary config and data directory, bound to 127.0.0.1
# on a random free port; nothing here starts the packaged system service or leaves a daemon behind:
# during the install a policy-rc.d that denies every service start is in place (Debian's standard
# hook for invoke-rc.d / deb-systemd-invoke), unless the machine already has one.
#
# Idempotent and fast: exits at once when both `prometheus` and `promtool` are on PATH.
# Usage: bash scripts/install_prometheus.sh     (root, or a user with sudo)
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "prometheus already installed: $(prometheus --version 2>&1 | head -n1)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_prometheus.sh: apt-get not found; install Prometheus (prometheus, promtool) yourself" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

POLICY=/usr/sbin/policy-rc.d
own_policy=0
cleanup() {
    if [ "$own_policy" = 1 ]; then
        $SUDO rm -f "$POLICY"
    fi
}
trap cleanup EXIT
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\n# install_prometheus.sh: no service starts during the install\nexit 101\n' \
        | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    own_policy=1
fi

export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get install -y --no-install-recommends prometheus; then
    # Package lists may be missing or stale on a fresh machine.
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends prometheus
fi

echo "installed $(prometheus --version 2>&1 | head -n1)"
