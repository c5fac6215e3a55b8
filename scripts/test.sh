#!/usr/bin/env bash
# Install specserve with its test extras and run the default (fast) test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test,bench]'
bash scripts/install_helm.sh
bash scripts/install_prometheus.sh
python3 -m pytest "$@"
