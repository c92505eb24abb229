"""``os.fork()`` while another thread is inside flatpool (issue 18.7).

Each case runs in a fresh interpreter (``fork_worker.py``): a child that inherits a held pool
lock blocks forever, so the worker's parent waits for it with a deadline and kills it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fork_worker.py")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.mark.parametrize(
    "case", ["held_lock_and_gc_pause", "operation_finishes_first", "signal_guard_of_main_thread",
             "pool_made_while_fork_waits"]
)
def test_fork_while_another_thread_is_inside_flatpool(case: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore::DeprecationWarning")
    proc = subprocess.run(
        [sys.executable, str(WORKER), case], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
