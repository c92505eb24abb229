#!/usr/bin/env bash
# Create (or reuse) .venv with pinned torch and the project installed in editable mode.
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.flatpool-bootstrap
want="torch==2.13.0 attrs==26.1.0 pytest==9.2.0 hypothesis==6.170.17 mypy==2.4.1 numpy==2.4.6 matplotlib==3.11.2"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check $want 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, attrs, pytest, hypothesis, flatpool" 
  echo "$want" > "$stamp"
fi
