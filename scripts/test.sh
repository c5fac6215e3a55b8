#!/usr/bin/env bash
# Install specserve with its test extras, lint and type-check, and run the default (fast) test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test,bench]'
bash scripts/install_helm.sh
bash scripts/install_prometheus.sh
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy engine
python3 -m pytest "$@"
