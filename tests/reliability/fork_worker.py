"""Fork cases run by ``test_fork.py``, each in a fresh interpreter: ``python fork_worker.py CASE``.

Each case forks with ``os.fork()`` while another thread is inside flatpool; the child checks
what it inherited and exits 0 only if all is well. The parent waits for it with a deadline (a
child blocked on an inherited lock is killed and reported as hung) and prints ``ok``.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable

import torch

import flatpool
import flatpool._fork as fork_hooks
from flatpool._gcpause import gc_paused, paused
from flatpool._interrupts import signals_guarded

CHILD_DEADLINE = 60.0  # seconds; a busy machine, but a blocked child never finishes at all


def _fork(child: Callable[[list[warnings.WarningMessage]], None]) -> int:
    """Fork; run ``child`` in the child (exit 0 if it returns, 3 if it raises); return the
    child's exit status in the parent, or -1 if it had to be killed as hung."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pid = os.fork()
        if pid == 0:
            try:
                child(seen)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(3)
            os._exit(0)
    deadline = time.monotonic() + CHILD_DEADLINE
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("child hung", flush=True)
    return -1


def _use(pool: flatpool.FlatPool, t: torch.Tensor, before: torch.Tensor) -> None:
    """Every kind of call on ``pool`` works in the child (each takes the pool's lock)."""
    assert pool.owns(t) and torch.equal(t, before), "the adopted tensor changed"
    s = pool.allocate((4,), torch.float32)
    s.tensor().fill_(2.0)
    pool.free(s)
    u = torch.arange(6.0)
    pool.adopt(u)
    assert pool.owns(u) and torch.equal(u, torch.arange(6.0)) and pool.is_valid()
    flatpool.census()


def _gc_runs_automatically() -> None:
    assert not paused(), "the other thread's gc pause survived the fork"
    assert gc.get_threshold()[0] > 0, f"automatic gc still paused: {gc.get_threshold()}"
    runs: list[str] = []
    gc.callbacks.append(lambda phase, info: runs.append(phase))
    junk = []
    for _ in range(50_000):  # cycles, so the allocation count triggers generation-0 passes
        a: list[object] = []
        a.append(a)
        junk.append(a)
    assert runs, "no automatic collection ran in the child"


def held_lock_and_gc_pause() -> None:
    """Another thread holds the pool's lock and a gc pause across the fork (longer than the
    fork waits): the child gets a fresh lock, a warning, and automatic gc back."""
    fork_hooks.FORK_WAIT = 0.2
    pool = flatpool.FlatPool(capacity=1 << 14, alignment=64, name="held")
    t = torch.arange(8.0)
    pool.adopt(t)
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with gc_paused(), pool.lock:
            inside.set()
            leave.wait()

    worker = threading.Thread(target=hold)
    worker.start()
    inside.wait()
    assert gc.get_threshold()[0] == 0 and paused()

    def child(seen: list[warnings.WarningMessage]) -> None:
        messages = [str(w.message) for w in seen if issubclass(w.category, flatpool.FlatPoolWarning)]
        assert any("'held'" in m and "forked" in m for m in messages), messages
        _use(pool, t, torch.arange(8.0))
        _gc_runs_automatically()

    code = _fork(child)
    leave.set()
    worker.join()
    assert code == 0, f"child exit {code}"
    assert not paused() and gc.get_threshold()[0] > 0  # the parent's pause ended as usual
    _use(pool, t, torch.arange(8.0))


def operation_finishes_first() -> None:
    """A thread inside a (short) pool operation: fork waits for it, and the child sees the
    operation's result, a consistent pool, no warning."""
    pool = flatpool.FlatPool(capacity=1 << 14, alignment=64, name="busy")
    t = torch.arange(8.0)
    pool.adopt(t)
    inside = threading.Event()
    made: list[flatpool.Slice] = []

    def operate() -> None:
        with pool.lock:
            inside.set()
            time.sleep(0.5)
            s = pool.allocate((16,), torch.float32)
            s.tensor().fill_(7.0)
            made.append(s)

    worker = threading.Thread(target=operate)
    worker.start()
    inside.wait()

    def child(seen: list[warnings.WarningMessage]) -> None:
        assert not [w for w in seen if issubclass(w.category, flatpool.FlatPoolWarning)]
        assert made and pool.is_live(made[0]), "fork did not wait for the operation"
        assert torch.equal(made[0].tensor(), torch.full((16,), 7.0))
        _use(pool, t, torch.arange(8.0))

    code = _fork(child)
    worker.join()
    assert code == 0, f"child exit {code}"


def signal_guard_of_main_thread() -> None:
    """The main thread is inside a signal guard (deferring, as while an operation lets go of
    its lock) when another thread forks: the child's signals reach their handlers."""
    fork_hooks.FORK_WAIT = 0.2
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    codes: list[int] = []
    with signals_guarded() as guard:
        guard.finishing()  # deferring: what the parent receives now waits for the guard's end

        def fork_from_thread() -> None:
            def child(seen: list[warnings.WarningMessage]) -> None:
                os.kill(os.getpid(), signal.SIGUSR1)
                for _ in range(100):  # the handler runs between bytecodes of this thread
                    if got:
                        break
                    time.sleep(0.01)
                assert got == [signal.SIGUSR1], "the child's signal was deferred forever"

            codes.append(_fork(child))

        worker = threading.Thread(target=fork_from_thread)
        worker.start()
        worker.join()
    signal.signal(signal.SIGUSR1, previous)
    assert codes == [0], f"child exit {codes}"


def pool_made_while_fork_waits() -> None:
    """Issue 32.9: while fork waits for one pool's lock, the thread holding it makes a second
    pool and starts an operation on it (it holds that lock across the fork). The child's first
    ``census()`` takes every live pool's lock: it returns (the new pool's lock is fresh), where
    it waited forever for a lock whose holder does not exist in the child."""
    first = flatpool.FlatPool(capacity=1 << 14, alignment=64, name="first")
    t = torch.arange(8.0)
    first.adopt(t)
    inside, leave = threading.Event(), threading.Event()
    made: list[flatpool.FlatPool] = []
    main = threading.main_thread().ident
    assert main is not None

    def fork_waits_for_first() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code is fork_hooks._before.__code__:
                return True
            frame = frame.f_back
        return False

    def operate() -> None:
        with first.lock:
            inside.set()
            while not fork_waits_for_first():  # the fork listed the live pools: only `first`
                time.sleep(0.001)
            second = flatpool.FlatPool(capacity=1 << 14, alignment=64, name="second")
            made.append(second)
            second.lock.acquire()  # an operation on it begins, and outlasts the fork
        leave.wait()
        second.lock.release()

    worker = threading.Thread(target=operate)
    worker.start()
    inside.wait()

    def child(seen: list[warnings.WarningMessage]) -> None:
        assert made, "the second pool was not made while the fork waited"
        flatpool.census()  # the first call: it takes every live pool's lock
        messages = [str(w.message) for w in seen if issubclass(w.category, flatpool.FlatPoolWarning)]
        assert any("'second'" in m and "forked" in m for m in messages), messages
        assert not any("'first'" in m for m in messages), messages  # its operation had ended
        _use(first, t, torch.arange(8.0))
        u = torch.arange(4.0)
        made[0].adopt(u)  # the second pool works too
        assert made[0].owns(u) and torch.equal(u, torch.arange(4.0))
        _use(made[0], u, torch.arange(4.0))

    code = _fork(child)
    leave.set()
    worker.join()
    assert code == 0, f"child exit {code}"


CASES = {f.__name__: f for f in (held_lock_and_gc_pause, operation_finishes_first,
                                 signal_guard_of_main_thread, pool_made_while_fork_waits)}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
    print("ok", flush=True)
