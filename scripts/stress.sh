#!/usr/bin/env bash
# Run the quick suite (./scripts/test.sh) with N busy CPU hogs beside it: the suite must pass on
# a loaded machine (CI, a shared box), not only on an idle one.
#
#   ./scripts/stress.sh 6                       # the whole quick suite beside 6 hogs
#   ./scripts/stress.sh 6 tests/integrations/test_launch.py   # extra arguments go to pytest
#
# Each hog is one process spinning at 100% of a core. They are stopped when the suite ends,
# fails or is interrupted; the exit code is the suite's.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
    echo "usage: $0 N [pytest arguments...]   (N: how many busy CPU hogs to run beside the suite)" >&2
    exit 2
fi
hogs=$1
shift

pids=()
stop_hogs() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
trap stop_hogs EXIT INT TERM

for _ in $(seq 1 "$hogs"); do
    ( while :; do :; done ) &
    pids+=("$!")
done
echo "stress: $hogs CPU hog(s) running beside the suite (pids ${pids[*]:-none})"

start=$(date +%s)
status=0
./scripts/test.sh "$@" || status=$?
echo "stress: suite exit code $status after $(( $(date +%s) - start )) s beside $hogs hog(s)"
exit "$status"
