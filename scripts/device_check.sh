#!/usr/bin/env bash
# The prepared device check: flatpool on one GPU machine in under 8 minutes, or --dry-run on CPU.
#
#   bash scripts/device_check.sh             # full: every step on cuda (needs a CUDA torch)
#   bash scripts/device_check.sh --dry-run   # the same steps on CPU, tiny sizes (CI runs this)
#   bash scripts/device_check.sh --out DIR --only adopt,optim
#
# Uses the machine's own interpreter (python3, or FLATPOOL_DEVICE_PYTHON) with the torch, pytest,
# attrs and numpy it already has (matplotlib for the pictures): nothing is installed or
# downloaded, flatpool is taken from this working tree. Results: device-results.md / .json in
# --out, else $OUT, else device-check-results/ (see scripts/device_check.py). A copy without git
# history names its commit with FLATPOOL_DEVICE_COMMIT=<sha>.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${FLATPOOL_DEVICE_PYTHON:-python3}
limit=480                       # the issue's 8 minutes; the Python keeps itself well inside them
case " $* " in *" --dry-run "*) limit=180 ;; esac
limit=${FLATPOOL_DEVICE_TIMEOUT:-$limit}
if command -v timeout >/dev/null; then
  # A last resort only: SIGTERM lets the check stop its running step and keep its results.
  exec timeout --kill-after=20 "$limit" "$PY" -u scripts/device_check.py "$@"
fi
exec "$PY" -u scripts/device_check.py "$@"
