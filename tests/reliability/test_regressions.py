"""Regression tests for bugs the reliability fuzzing found (one test each).

Others are rows of the bad-input catalogue (``overflow-*``, ``unallocatable``,
``local-not-shard``, ``meta-held-by-graph``) and ``test_faults.py::test_regression_*``.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch import nn

from flatpool import FlatPool, PoolExhaustedError, live_pools


def test_free_forgets_bindings_of_released_tensors() -> None:
    """Freeing a slice whose adopted tensors had died left their (dead) bindings in the
    registry; the next readopt() looked the freed slice up and died with a KeyError."""
    pool = FlatPool(alignment=64, capacity=1024)
    t = torch.arange(4.0)
    slc = pool.adopt(t).slices[0]
    u = torch.arange(3.0)
    pool.adopt(u)
    del t
    pool.free(slc)
    u.data = u.data.clone() + 1
    pool.readopt()
    assert pool.owns(u) and torch.equal(u, torch.arange(3.0) + 1)


def test_failed_transaction_does_not_pin_the_pool_while_its_exception_lives() -> None:
    """A rolled-back transaction kept its pool snapshot (the storage tensor) alive through the
    exception's traceback, so grow() -- what PoolExhaustedError suggests -- called in the
    except block failed with PinnedStorageError."""
    pool = FlatPool(alignment=64)
    with torch.device("meta"):
        first = nn.Linear(2, 2)
        second = nn.Linear(8, 8)
    pool.materialize_into([first.weight, first.bias])  # fixes the capacity
    try:
        pool.materialize_into([second.weight, second.bias])
    except PoolExhaustedError as exc:
        pool.grow(pool.capacity + 2 * exc.requested + 1024)
        pool.materialize_into([second.weight, second.bias])
    else:
        pytest.fail("the second materialization should not have fitted")
    assert pool.slice_of(second.weight) is not None and pool.is_valid()


def test_live_pools_while_other_threads_create_pools() -> None:
    """live_pools() (walked by every adopt() and census()) raised "Set changed size during
    iteration" when another thread created a pool meanwhile."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def make() -> None:
        while not stop.is_set():
            pools = [FlatPool() for _ in range(20)]
            del pools

    def walk() -> None:
        try:
            for _ in range(5000):
                live_pools()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        maker, walker = threading.Thread(target=make), threading.Thread(target=walk)
        maker.start()
        walker.start()
        walker.join()
        stop.set()
        maker.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors


def test_a_journal_left_open_by_an_interrupted_exit_is_ended_by_the_rollback() -> None:
    """An interrupt that lands in a journaled block's exit (it was contextlib's generator
    machinery) skipped the cleanup: the allocator still believed a change was in progress, so
    the next journaled block took itself for a nested one and undid nothing when it failed
    (found by the SIGALRM fuzz: "allocator state changed", 11 of 26 seeds of 1,000 landings).
    Every rollback restores the allocator, which now also ends such a journal."""
    from flatpool._allocator import RangeAllocator

    alloc = RangeAllocator(1024, alignment=1)
    before = alloc.snapshot()
    left_open = alloc.journaled()  # alive, as the interrupt's traceback keeps it
    left_open.__enter__()  # and its exit never ran: the interrupt landed there
    alloc.take(0, 64)
    alloc.restore(before)  # what the operation's rollback does
    with pytest.raises(RuntimeError):
        with alloc.journaled():
            alloc.take(0, 128)
            raise RuntimeError("a later change fails half-way")
    assert alloc.free_ranges() == [(0, 1024)]
    del left_open
