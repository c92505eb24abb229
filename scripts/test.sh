#!/usr/bin/env bash
# Set up the venv if needed, then run the test suite (quick mode) under faulthandler.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/python -X faulthandler -m pytest -q "$@"
