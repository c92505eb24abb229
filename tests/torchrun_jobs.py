"""Run a 2-rank ``torchrun --standalone`` job from a test, the way a user starts one.

One failure is retried once: a rank aborting *at interpreter exit*, after its work is done and
its output printed, with ``terminate called without an active exception``. That is a torch bug
(pytorch/pytorch#190489, open), not flatpool's: a core dump of such a rank (torch 2.13, gloo)
shows a gloo worker thread (``ProcessGroupGloo::runLoop``) dropping the last reference to a
finished collective issued inside ``backward()``; its ``ThreadLocalState`` holds the
``contextvars.Context`` that ``torch.autograd`` stashes for the backward, whose ``decref``
takes the GIL while the main thread is already in ``Py_FinalizeEx``, so CPython ends the
worker thread (``pthread_exit``) inside a ``noexcept`` destructor and ``std::terminate`` runs.
It needs the worker to be descheduled from the end of the last backward to the exit: about 1
run in 8 to 1 in 30 on the loaded 2-core machine, plain FSDP2 without flatpool included
(docs/compatibility.md, "A rank that aborts at exit on gloo"). Each retry is reported as a
``TorchExitAbortRetried`` warning (pytest's warnings summary counts them); any other failure,
or the same abort twice in a row, fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

EXIT_ABORT = "terminate called without an active exception"


class TorchExitAbortRetried(UserWarning):
    """A torchrun job was run a second time after a rank hit torch's exit-time abort."""


def run_torchrun(args: Sequence[str], *, cwd: Path, timeout: float = 300
                 ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and EXIT_ABORT in proc.stderr:
        warnings.warn(f"a rank of the torchrun job {' '.join(args)} aborted at exit "
                      f"({EXIT_ABORT!r}, pytorch/pytorch#190489); ran it once more",
                      TorchExitAbortRetried, stacklevel=2)
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    return proc
