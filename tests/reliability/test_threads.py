"""Concurrency: pools used from several threads at once keep their invariants.

Worker threads share pools and, each in a loop, allocate, write a thread-specific pattern,
verify it, free; adopt fresh tensors (and release them); take a census; describe the pool; and
create and drop pools of their own (``live_pools()`` is walked by every adoption). Afterwards
no worker raised anything but ``PoolExhaustedError``, the layout invariants hold and no bytes of
one thread's slice were touched by another.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest
import torch

from flatpool import FlatPool, PoolExhaustedError, census

from .state import check_layout


def _run(workers: list[Callable[[], None]]) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(len(workers))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                start.wait()
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
        return body

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: races show up within a few loops
    try:
        # daemon threads: a worker stuck for good fails the test below instead of keeping the
        # interpreter from exiting (a suite that printed its summary and never returned)
        threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    stuck = [t for t in threads if t.is_alive()]
    if stuck:
        errors.append(AssertionError(
            f"{len(stuck)} worker(s) still running after 120 s; pool locks held now (owner = "
            f"thread ident; main is {threading.main_thread().ident}): {_held_locks()}"))
    return errors


def _held_locks() -> list[str]:
    from flatpool import live_pools

    return [f"{p.name}: {p.lock!r}" for p in live_pools() if "owner=0 " not in repr(p.lock)]


def _worker(pools: list[FlatPool], me: int, rounds: int) -> Callable[[], None]:
    def work() -> None:
        gen = torch.Generator().manual_seed(me)
        mine: list[tuple[FlatPool, object, torch.Tensor]] = []
        adopted: list[tuple[FlatPool, torch.Tensor, torch.Tensor]] = []
        check: torch.Tensor | None = None
        roots: list[torch.Tensor] | None = None
        t: torch.Tensor | None = None
        for r in range(rounds):
            pool = pools[r % len(pools)]
            op = r % 6
            if op in (0, 1):
                n = int(torch.randint(1, 40, (1,), generator=gen))
                try:
                    slc = pool.allocate(n, torch.int32)
                except PoolExhaustedError:
                    continue
                value = torch.full((n,), me * 1000 + r, dtype=torch.int32)
                slc.tensor().copy_(value)
                mine.append((pool, slc, value))
            elif op == 2 and mine:
                p, slc, value = mine.pop(0)
                assert torch.equal(slc.tensor(), value)  # type: ignore[attr-defined]
                p.free(slc)  # type: ignore[arg-type]
            elif op == 3:
                t = torch.full((int(torch.randint(1, 30, (1,), generator=gen)),), float(me))
                try:
                    pool.adopt(t)
                except PoolExhaustedError:
                    continue
                adopted.append((pool, t, t.clone()))
                if len(adopted) > 3:  # release the oldest: drop it, free its slice
                    p, old, _ = adopted.pop(0)
                    slc = p.slice_of(old)
                    assert slc is not None
                    old = t = check = roots = None  # nothing of ours may keep it bound
                    p.free(slc)
            elif op == 4:
                roots = [t for _, t, _ in adopted]
                if roots:
                    c = census(*roots, pools=pools)
                    assert not c.stale
                pool.describe()
                repr(pool)
            else:
                own = FlatPool(alignment=8, name=f"t{me}-{r}")
                own.adopt(torch.ones(3))
                del own
            for p, slc, value in mine:
                assert torch.equal(slc.tensor(), value)  # type: ignore[attr-defined]
            for p, check, value in adopted:
                assert p.owns(check) and torch.equal(check, value)
            check = roots = t = None
        for p, slc, _ in mine:
            p.free(slc)  # type: ignore[arg-type]

    return work


def _check(pools: list[FlatPool], errors: list[BaseException]) -> None:
    assert not errors, f"{len(errors)} worker error(s); first: {errors[0]!r}"
    for p in pools:
        check_layout(p)
        assert p.is_valid()


def test_threads_share_pools() -> None:
    pools = [FlatPool(alignment=64, capacity=1 << 14, name=f"shared{i}") for i in range(2)]
    for p in pools:
        p.materialize()
    errors = _run([_worker(pools, me, 120) for me in range(4)])
    _check(pools, errors)


@pytest.mark.slow
def test_threads_share_pools_long() -> None:
    pools = [FlatPool(alignment=64, capacity=1 << 15, name=f"shared{i}") for i in range(2)]
    errors = _run([_worker(pools, me, 3000) for me in range(8)])
    _check(pools, errors)
