#!/usr/bin/env bash
# Set up the venv if needed, then run the main demo (CPU, 2 gloo ranks by default).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/python -m examples.demo "$@"
