"""An interrupt while the threaded copy runs never frees memory a worker still writes into.

A batch of many small tensors (2,000 of 24 KiB here) copies in worker threads on the general
adoption path (``on_pinned="force"`` takes it; the lean path copies in the calling thread). A
``KeyboardInterrupt`` landing in the calling thread while it waits for them started the
rollback, which freed the new pool storage while the workers still wrote into it: SIGSEGV or
heap corruption. The subprocess pins the timing down: the first worker to copy sends SIGINT to
the main thread and takes 0.3 s over its copy (its copy call sleeps first), so the interrupt
lands while the calling thread waits for it (the join). The rule checked: when the rollback
starts, no worker is inside a copy; and memory freed by the rollback, reused by churn tensors,
is never written afterwards.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import signal, threading, time
import torch
import flatpool
import flatpool.ownership._transaction
from flatpool import FlatPool
from flatpool import _torch_compat as tc

signal.signal(signal.SIGINT, signal.default_int_handler)  # a background process ignores it
torch.set_num_threads(4)
N = 2000
tensors = [torch.full((6144,), float(i % 251)) for i in range(N)]  # 24 KiB each
keys = [t.untyped_storage()._cdata for t in tensors]

real = tc.foreach_copy
fired, copying, at_rollback = [], [], []

def copy_late(dst, src):
    """The first worker thread's copy: interrupt the caller, then copy 0.3 s later."""
    copying.append(True)
    try:
        if threading.current_thread() is not threading.main_thread() and not fired:
            fired.append(True)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.3)
        return real(dst, src)
    finally:
        copying.pop()

rollback = flatpool.ownership._transaction.Transaction.rollback

def watched(txn):
    at_rollback.append(len(copying))
    return rollback(txn)

flatpool.ownership._transaction.Transaction.rollback = watched
tc.foreach_copy = copy_late
pool = FlatPool()
interrupted = False
try:
    pool.adopt(tensors, on_pinned="force")  # the general path, whose small copies are threaded
except KeyboardInterrupt:
    interrupted = True
assert fired and interrupted, (fired, interrupted)
assert at_rollback and at_rollback[0] == 0, f"the rollback started with {at_rollback[0]} copies running"
churn = [torch.full((1 << 20,), 7.0) for _ in range(64)]  # reuses what the rollback freed
time.sleep(0.6)  # a worker that outlived the rollback has written by now
assert all(float(c.min()) == 7.0 == float(c.max()) for c in churn), "freed memory was written"
assert pool.slices() == () and not any(pool.owns(t) for t in tensors)
assert [t.untyped_storage()._cdata for t in tensors] == keys
assert all(float(t[0]) == float(i % 251) == float(t[-1]) for i, t in enumerate(tensors))
tc.foreach_copy = real
report = pool.adopt(tensors)  # and it then succeeds
assert report.all_released and all(pool.owns(t) for t in tensors)
assert all(float(t[0]) == float(i % 251) == float(t[-1]) for i, t in enumerate(tensors))
print("all ok")
'''


def test_interrupt_at_the_join_of_the_threaded_copy() -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(SCRIPT)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("all ok"), (
        f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
