"""SIGALRM landing anywhere inside flatpool's operations never leaves a half-done state.

The fuzz runs in a subprocess (a real signal handler, a fresh interpreter): see
``sigalrm_fuzz.py``. The default run lands 40 interrupts inside flatpool; ``--slow`` lands 300+.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _fuzz(target: int, seed: int) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "reliability.sigalrm_fuzz", str(target), str(seed)],
        cwd=TESTS, capture_output=True, text=True, timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_sigalrm_inside_operations_leaves_consistent_states() -> None:
    r = _fuzz(40, seed=1)
    assert r["inconsistent"] == [], "\n\n".join(r["inconsistent"])  # type: ignore[arg-type]
    assert r["inside"] >= 40, r


@pytest.mark.slow
def test_sigalrm_fuzz_300_landings() -> None:
    r = _fuzz(320, seed=2)
    print(f"SIGALRM fuzz: {r['rounds']} rounds, {r['inside']} landings inside flatpool, "
          f"{r['outside']} outside, {len(r['inconsistent'])} inconsistent")  # type: ignore[arg-type]
    assert r["inconsistent"] == [], "\n\n".join(r["inconsistent"])  # type: ignore[arg-type]
    assert r["inside"] >= 300, r
