"""Readers in one thread while another relocates: every answer is the pool before or after a
move, never a mix, and no reader makes the writer fail.

The writer loops over ``grow``, ``compact`` and a re-adoption (a framework re-materializes one
tensor and ``readopt`` brings it back; both steps under ``pool.lock``, as docs/threading.md
advises, so readers see neither half alone). The reader loops over ``owns``, ``is_valid``,
``slice_of``, ``free_bytes`` and, every few rounds, ``census``. Every adopted tensor lives in the
pool at every instant a reader can observe, so each of those answers has exactly one right value.
Before the fix readers saw spurious ``False``/``None`` and censuses pinned the old storage so that
``grow`` failed with ``PinnedStorageError``.

Also here: the gc pause of concurrent adoptions, and ``free_bytes`` during concurrent planning.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch
from attrs import define, field

from flatpool import FlatPool, census
from flatpool._gcpause import gc_paused
from flatpool.testing import set_fault_hook

from .state import check_layout

TENSORS = 8
ELEMENTS = 16
ALIGNMENT = 64
USED = TENSORS * ELEMENTS * 4


@define
class Outcome:
    iterations: int
    seconds: float = 0.0
    reads: int = 0
    censuses: int = 0
    wrong: dict[str, int] = field(factory=lambda: dict.fromkeys(
        ("owns", "is_valid", "slice_of", "free_bytes", "census"), 0))
    reader_errors: list[str] = field(factory=list)
    writer_failures: list[str] = field(factory=list)


def _race(*targets: Callable[[], None], timeout: float) -> None:
    """Run ``targets`` in threads of their own until all return (or ``timeout`` s each), with a
    thread switch every few bytecodes so that races show up at once."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=t) for t in targets]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout)
    finally:
        sys.setswitchinterval(old)


def stress(iterations: int) -> Outcome:
    """Run the writer for ``iterations`` operations with the reader alongside; count."""
    pool = FlatPool(alignment=ALIGNMENT, capacity=1 << 14, name="relocating")
    ts = [torch.arange(float(ELEMENTS)) + 100 * i for i in range(TENSORS)]
    pool.adopt(ts)
    out = Outcome(iterations)
    done = threading.Event()

    def writer() -> None:
        try:
            for k in range(iterations):
                try:
                    if k % 3 == 0:
                        pool.grow(pool.capacity + 4096)
                    elif k % 3 == 1:
                        pool.compact()
                    else:
                        t = ts[k % TENSORS]
                        with pool.lock:
                            t.data = t.data.clone()
                            pool.readopt()
                except Exception as exc:  # noqa: BLE001 - counted, the loop goes on
                    out.writer_failures.append(f"{k}: {type(exc).__name__}: {exc}"[:300])
        finally:
            done.set()

    def reader() -> None:
        i = 0
        while not done.is_set():
            t = ts[i % TENSORS]
            try:
                if not pool.owns(t):
                    out.wrong["owns"] += 1
                if not pool.is_valid():
                    out.wrong["is_valid"] += 1
                slc = pool.slice_of(t)
                if slc is None or slc.nbytes != ELEMENTS * 4 or slc.pool is not pool:
                    out.wrong["slice_of"] += 1
                free = pool.free_bytes
                if free < 0 or (free + USED) % ALIGNMENT or free + USED < USED:
                    out.wrong["free_bytes"] += 1
                if i % 25 == 0:
                    c = census(*ts, pools=[pool])
                    out.censuses += 1
                    if c.stale or {r.pool for r in c.records} != {pool.name}:
                        out.wrong["census"] += 1
            except Exception as exc:  # noqa: BLE001 - counted
                out.reader_errors.append(f"{type(exc).__name__}: {exc}"[:300])
            del t
            i += 1
        out.reads = i

    start = time.perf_counter()
    _race(reader, writer, timeout=600)
    out.seconds = time.perf_counter() - start
    check_layout(pool)
    assert pool.is_valid() and all(pool.owns(t) for t in ts)
    for i, t in enumerate(ts):
        assert torch.equal(t, torch.arange(float(ELEMENTS)) + 100 * i)
    return out


def _check(out: Outcome) -> None:
    print(f"\n{out}")  # the numbers, with -s
    assert out.reads > 0 and out.censuses > 0
    assert out.wrong == dict.fromkeys(out.wrong, 0), out
    assert not out.reader_errors, out.reader_errors[:3]
    assert not out.writer_failures, out.writer_failures[:3]


def test_readers_during_relocation() -> None:
    _check(stress(300))


@pytest.mark.slow
def test_readers_during_relocation_long() -> None:
    _check(stress(10_000))


# -- the gc pause ----------------------------------------------------------------------------
def _automatic_gc() -> bool:
    return gc.isenabled() and gc.get_threshold()[0] > 0


def test_overlapping_pauses_stay_paused_until_the_last_ends() -> None:
    """Two threads' pauses overlap; the first to end must not switch collection back on under the
    second (it did: each pause restored what it had seen at its start)."""
    entered, release_a, a_done, release_b = (threading.Event() for _ in range(4))
    seen: dict[str, bool] = {}

    def a() -> None:
        with gc_paused():
            entered.set()
            release_a.wait(10)
        a_done.set()

    def b() -> None:
        entered.wait(10)
        with gc_paused():
            release_a.set()
            a_done.wait(10)
            seen["after A ended, inside B"] = _automatic_gc()
            release_b.wait(10)

    assert _automatic_gc()
    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for th in threads:
        th.start()
    a_done.wait(10)
    release_b.set()
    for th in threads:
        th.join(10)
    assert seen == {"after A ended, inside B": False}
    assert _automatic_gc()


@pytest.mark.parametrize("user_enabled", [True, False])
def test_a_users_gc_setting_survives_concurrent_adoptions(user_enabled: bool) -> None:
    """Two adoptions overlap in two threads; the user flips gc while both are inside. Afterwards
    gc.isenabled() is what the user set: the pause never touches it (an ending pause switched a
    user's gc.disable() back on before)."""
    pool = FlatPool(alignment=64, capacity=1 << 16)
    inside, flipped = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold(step: str) -> None:
        if step == "rebind" and not inside.is_set():
            inside.set()  # one adoption is mid-way: the other starts, the user flips
            flipped.wait(10)

    def adopt() -> None:
        try:
            pool.adopt([torch.ones(64) for _ in range(20)])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    was = gc.isenabled()
    gc.disable() if user_enabled else gc.enable()  # the user changes it, not keeps it
    set_fault_hook(hold)
    try:
        first = threading.Thread(target=adopt)
        first.start()
        assert inside.wait(10)
        second = threading.Thread(target=adopt)  # blocks on the pool lock, paused too
        second.start()
        if user_enabled:
            gc.enable()
        else:
            gc.disable()
        flipped.set()
        first.join(60)
        second.join(60)
        assert not errors, errors
        assert gc.isenabled() is user_enabled
        assert gc.get_threshold()[0] > 0  # the last pause ended and restored the threshold
    finally:
        set_fault_hook(None)
        gc.enable() if was else gc.disable()


def test_free_bytes_never_negative_while_another_thread_plans() -> None:
    """A planned pool grows with every allocation: capacity and used bytes read in two steps
    went negative (free_bytes) when an allocation landed between them."""
    pool = FlatPool(alignment=64)
    done = threading.Event()
    bad: list[int] = []

    def plan() -> None:
        for _ in range(3000):
            s = pool.allocate(100, torch.float32)
            if len(pool.slices()) > 50:
                pool.free(pool.slices()[0])
            del s
        done.set()

    def read() -> None:
        while not done.is_set():
            free = pool.free_bytes
            if free < 0 or pool.largest_free_bytes < 0:
                bad.append(free)

    _race(plan, read, timeout=120)
    assert not bad, bad[:5]


def test_process_wide_census_never_makes_an_adoption_fail() -> None:
    """``census()`` without roots walks every tensor of the process, originals being adopted in
    another thread included: the storage objects it made pinned them (PinnedStorageError)."""
    pool = FlatPool(alignment=64, capacity=1 << 20)
    done = threading.Event()
    failures: list[str] = []
    scans = [0]

    def adopt() -> None:
        try:
            for _ in range(10):
                batch = [torch.full((32,), 1.0) for _ in range(8)]
                report = pool.adopt(batch)
                if not report.all_released:
                    failures.append("not released")
                for slc in report.slices:
                    pool.disown(slc)
                    pool.free(slc)
                del batch, report
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            done.set()

    def scan() -> None:
        while not done.is_set():
            census()
            scans[0] += 1

    _race(scan, adopt, timeout=120)
    assert scans[0] > 0
    assert not failures, failures[:3]
