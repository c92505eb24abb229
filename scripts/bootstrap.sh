#!/usr/bin/env bash
# Create (or reuse) .venv with pinned torch and the project installed in editable mode.
# Idempotent: a second run only checks that everything is in place (silently).
# A cold install takes a few minutes; each step says what it is doing, and a failing step
# prints pip's output and stops instead of being swallowed.
#
# What it downloads: torch 2.13.0 comes from pip's configured index unless
# FLATPOOL_TORCH_INDEX_URL names another. The CPU wheel is about 200 MB; where it is not at hand
# (not cached or mirrored), PyPI serves Linux x86_64 the CUDA build instead: torch plus its
# nvidia-* and triton wheels, about 3 GB to download and 5 GB in .venv (it runs on the CPU too).
# For the CPU wheel from PyTorch's own index:
#   FLATPOOL_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu ./scripts/bootstrap.sh
# The other packages (numpy, attrs, test tools: a few tens of MB) come from pip's index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==2.13.0"
RUNTIME="attrs==26.1.0 numpy==2.4.6"
TOOLS="pytest==9.2.0 hypothesis==6.170.17 mypy==2.4.1 setuptools>=77 matplotlib==3.11.2"
stamp=.venv/.flatpool-bootstrap
want="$TORCH $RUNTIME $TOOLS"

say() { echo "bootstrap: $*" >&2; }

pip_install() {  # pip_install WHAT ARGS...: quiet on success, pip's whole output on failure
  local what=$1 log
  shift
  log=$(mktemp)
  local t0=$SECONDS
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2 || true
    rm -f "$log"
    say "FAILED installing $what (see pip's output above)"
    exit 1
  fi
  rm -f "$log"
  say "  done ($((SECONDS - t0)) s)"
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/python ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
# numpy goes in right after torch: torch imports it at start-up (in every spawned rank too) and
# warns "Failed to initialize NumPy" in each process where it is missing or broken.
if [ -n "${FLATPOOL_TORCH_INDEX_URL:-}" ]; then
  say "installing $TORCH from $FLATPOOL_TORCH_INDEX_URL (the longest step, 1-3 minutes)"
  pip_install torch "$TORCH" --index-url "$FLATPOOL_TORCH_INDEX_URL"
else
  say "installing $TORCH (the longest step: 1-3 minutes for the ~200 MB CPU wheel; where that is"
  say "  not at hand, pip's index serves the ~3 GB CUDA build; FLATPOOL_TORCH_INDEX_URL=URL picks"
  say "  an index, e.g. https://download.pytorch.org/whl/cpu)"
  pip_install torch "$TORCH"
fi
say "installing ${RUNTIME// /, }"
pip_install runtime $RUNTIME
say "installing test tools: ${TOOLS// /, }"
pip_install "test tools" $TOOLS
say "installing flatpool (editable, from $(pwd))"
pip_install flatpool --no-deps -e .
say "checking imports"
# -W error: a broken stack (torch's "Failed to initialize NumPy", ...) stops here, not in the demo.
if ! .venv/bin/python -W error::UserWarning -c "import torch, numpy, attrs, pytest, hypothesis, flatpool"; then
  say "FAILED: the installed packages do not import cleanly (see above); remove .venv and rerun"
  exit 1
fi
echo "$want" > "$stamp"
say "ready: .venv/bin/python ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
