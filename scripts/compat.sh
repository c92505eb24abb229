#!/usr/bin/env bash
# Run the test suite against one torch release in a throwaway venv; print a one-line verdict.
#
#   scripts/compat.sh TORCH_VERSION [PYTHON]
#
#   TORCH_VERSION  exact release, e.g. 2.7.1 (installed as torch==TORCH_VERSION)
#   PYTHON         interpreter: a command or path (python3, /usr/bin/python3.12) or a version
#                  that pyenv knows (3.10, 3.10.13). Default: python3.
#
# Environment:
#   KEEP=1         keep the venv afterwards; a later run with the same torch and Python reuses
#                  it (only the editable flatpool install is refreshed), so reruns skip the
#                  multi-GB download. Without KEEP the venv is deleted, also on failure.
#                  A kept venv whose pins differ from this script's is rebuilt from scratch.
#   COMPAT_ROOT    where venvs and logs go (default /tmp/flatpool-compat).
#   PYTEST_ARGS    extra pytest arguments (e.g. "tests/integrations -x"); default: whole suite.
#   MIN_FREE_GB    refuse to create a venv with less free disk than this (default 10).
#   SUITE_TIMEOUT  seconds before a hung suite is killed (default 1800).
#
# Old torch releases come from the package index only as CUDA builds (torch plus nvidia-*
# wheels, several GB); they run on CPU. The full log is kept in COMPAT_ROOT (path printed on
# failure). Exit status: 0 suite passed, 1 tests failed, 2 setup failed (bad version, no disk,
# install error).
#
# Test tools are pinned as in scripts/bootstrap.sh; mypy and pyright are left out, so
# test_static_typing is skipped. hypothesis >= 6.169, numpy >= 2.3 and matplotlib >= 3.11 need Python >= 3.11: on
# 3.10 the newest releases that support it are used (hypothesis 6.168.5, numpy 2.2.6,
# matplotlib 3.10.9).
set -uo pipefail
{  # parsed whole before it runs: editing this file during a run cannot derail the run

die() { echo "compat: $*" >&2; exit 2; }

[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: scripts/compat.sh TORCH_VERSION [PYTHON]   (KEEP=1 keeps the venv)"
TORCH_VERSION=$1
PY_ARG=${2:-python3}
[[ $TORCH_VERSION =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?([.+a-z0-9]*)$ ]] || die "not a torch version: $TORCH_VERSION"

REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${COMPAT_ROOT:-/tmp/flatpool-compat}
KEEP=${KEEP:-0}
MIN_FREE_GB=${MIN_FREE_GB:-10}

# -- resolve the interpreter -------------------------------------------------------------
resolve_python() {
  local arg=$1
  if [[ $arg =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
    local root
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    local cand
    # exact match first (3.10.13), else the newest patch of that minor (3.10 -> 3.10.x)
    for cand in "$root/versions/$arg" $(ls -d "$root/versions/$arg".* 2>/dev/null | sort -V -r); do
      if [ -x "$cand/bin/python" ]; then echo "$cand/bin/python"; return 0; fi
    done
    command -v "python$arg" 2>/dev/null && return 0
    return 1
  fi
  command -v "$arg" 2>/dev/null
}
PY=$(resolve_python "$PY_ARG") || die "no Python interpreter for '$PY_ARG' (try: pyenv versions)"
PYVER=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])') || die "$PY does not run"
PYMINOR=$("$PY" -c 'import sys; print(sys.version_info[1])')

if [ "$PYMINOR" -ge 11 ]; then  # = scripts/bootstrap.sh
  TOOLS="attrs==26.1.0 pytest==9.2.0 hypothesis==6.170.17 numpy==2.4.6 matplotlib==3.11.2"
else  # the newest releases of these that still support Python 3.10
  TOOLS="attrs==26.1.0 pytest==9.2.0 hypothesis==6.168.5 numpy==2.2.6 matplotlib==3.10.9"
fi
TOOLS="$TOOLS setuptools>=77"  # test_packaging builds the wheel (PEP 639 license field)
WANT="torch==$TORCH_VERSION $TOOLS"

VENV="$ROOT/torch-$TORCH_VERSION-py$PYVER"
LOG="$ROOT/torch-$TORCH_VERSION-py$PYVER.log"
mkdir -p "$ROOT" || die "cannot create $ROOT"
: >"$LOG"

cleanup() {
  if [ "$KEEP" != 1 ] && [ -n "${VENV:-}" ] && [ -d "$VENV" ]; then rm -rf "$VENV"; fi
}
trap cleanup EXIT
trap 'echo "compat: interrupted" >&2; exit 2' INT TERM

pip_q() {  # quiet pip; its output goes to the log
  "$VENV/bin/python" -m pip install --no-cache-dir --disable-pip-version-check --no-input \
    --progress-bar off "$@" >>"$LOG" 2>&1
}

# -- build (or reuse) the venv ------------------------------------------------------------
t0=$(date +%s)
stamp="$VENV/.flatpool-compat"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  reused=" (reused venv)"
else
  reused=""
  rm -rf "$VENV"
  free_gb=$(df -Pk "$ROOT" | awk 'NR==2 {print int($4 / 1048576)}')
  [ "$free_gb" -ge "$MIN_FREE_GB" ] || die "only ${free_gb} GB free under $ROOT (need $MIN_FREE_GB; MIN_FREE_GB overrides)"
  "$PY" -m venv "$VENV" >>"$LOG" 2>&1 || die "venv creation failed with $PY (log: $LOG)"
  # shellcheck disable=SC2086  # $TOOLS is a word list on purpose
  if ! pip_q "torch==$TORCH_VERSION" $TOOLS; then
    echo "compat: torch $TORCH_VERSION py$PYVER: SETUP FAILED (pip install; log: $LOG)" >&2
    grep -v '^WARNING: Location' "$LOG" | tail -n 5 | cut -c1-300 >&2
    exit 2
  fi
  echo "$WANT" >"$stamp"
fi
# flatpool itself: editable, from this checkout (flatpool.integrations is mapped from
# integrations/ by pyproject's package-dir; an editable install honours that mapping).
if ! pip_q --no-deps -e "$REPO"; then
  echo "compat: torch $TORCH_VERSION py$PYVER: SETUP FAILED (flatpool install; log: $LOG)" >&2
  exit 2
fi
got=$("$VENV/bin/python" - 2>>"$LOG" <<EOF
import importlib.util, os, torch, flatpool
# locate flatpool.integrations.hsdp without running it: an import error there is a test result
h = importlib.util.find_spec("flatpool.integrations.hsdp")
repo = os.path.realpath("$REPO")
files = [flatpool.__file__, h.origin if h else "flatpool.integrations.hsdp: not found"]
bad = [f for f in files if not os.path.realpath(f).startswith(repo + os.sep)]
print("outside:" + ",".join(bad) if bad else torch.__version__)
EOF
) || { echo "compat: torch $TORCH_VERSION py$PYVER: IMPORT FAILED (log: $LOG)" >&2; tail -n 5 "$LOG" | cut -c1-300 >&2; exit 2; }
[[ $got != outside:* ]] || die "flatpool imported from outside $REPO: ${got#outside:}"
t1=$(date +%s)

# -- run the suite ------------------------------------------------------------------------
# --continue-on-collection-errors: a module that fails at import (an old torch lacking an API)
# is reported as one error instead of hiding every other module's result.
cd "$REPO" || die "cannot cd $REPO"
# shellcheck disable=SC2086
timeout --kill-after=30 "${SUITE_TIMEOUT:-1800}" \
  "$VENV/bin/python" -X faulthandler -m pytest -q -p no:cacheprovider \
  --continue-on-collection-errors ${PYTEST_ARGS:-} >>"$LOG" 2>&1
rc=$?
[ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || echo "compat: suite killed after ${SUITE_TIMEOUT:-1800} s" >>"$LOG"
t2=$(date +%s)

summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected|xfailed|xpassed|warnings?)' "$LOG" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
[ -n "$summary" ] || summary="no pytest summary (crash or timeout: exit $rc)"
times="install $((t1 - t0))s$reused, tests $((t2 - t1))s"
# Skips other than the expected ones (slow tests, mypy not installed, no GPU on this machine,
# a property-test cell that does not apply) may hide a torch incompatibility: count them in
# the verdict and list them.
odd_skips=$(grep -E '^SKIPPED ' "$LOG" | grep -v -e 'slow test: run with --slow' \
  -e "could not import 'mypy'" -e "could not import 'pyright'" -e 'needs an accelerator' -e 'no CUDA or NPU device' \
  -e 'does not apply to plain parameter')
n_odd=$(printf '%s' "$odd_skips" | grep -c . || true)
note=""
[ "$n_odd" -eq 0 ] || note=" ($n_odd other skip reason(s), listed below)"
if [ "$rc" -eq 0 ]; then
  echo "compat: torch $got py$PYVER: PASS $summary$note [$times]"
else
  echo "compat: torch $got py$PYVER: FAIL $summary$note [$times] (log: $LOG)"
  grep -E '^(FAILED|ERROR) ' "$LOG" | sed 's/^/  /' | cut -c1-300 | head -n 40
fi
[ "$n_odd" -eq 0 ] || printf '%s\n' "$odd_skips" | sed 's/^/  /' | cut -c1-300
[ "$rc" -eq 0 ] && exit 0
exit 1
}
