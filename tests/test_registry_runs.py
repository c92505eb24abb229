"""A lean batch binds its tensors as one run of columns (issue 20): every registry accessor
must answer as it does for the per-slice records the general path binds, through unbinding,
re-binding, freeing, snapshots and rollback."""

from __future__ import annotations

import gc

import pytest
import torch

from flatpool import AdoptSpec, FlatPool
from flatpool.errors import PinnedStorageError
from flatpool.registry import RUN_MIN, current


N = RUN_MIN + 6


def _pair(
    n: int = N, capacity: int | None = None
) -> tuple[FlatPool, list[torch.Tensor], FlatPool, list[torch.Tensor]]:
    lean = [torch.randn(i % 7 + 1, 3) for i in range(n)]
    general = [t.clone() for t in lean]
    p1, p2 = FlatPool(capacity=capacity), FlatPool(capacity=capacity)
    p1.adopt(lean)  # bare tensors: one run
    p2.adopt([AdoptSpec(t, views=[t.view(t.shape)]) for t in general])  # per-slice records
    return p1, lean, p2, general


def _view(pool: FlatPool) -> list[tuple[int, tuple[object, ...]]]:
    """The registry as (slice id, records without their refs, bound object ids)."""
    return sorted((sid, tuple((r[1:], id(current(r))) for r in recs))
                  for sid, recs in pool.registry.items())


def test_a_lean_batch_is_one_run_and_reads_like_records() -> None:
    p1, lean, p2, general = _pair()
    reg = p1.registry
    assert reg._runs and not reg._records  # no record made yet
    assert len(reg) == len(p2.registry) == N
    ids = [s.slice_id for s in p1.slices()]
    for sid, t in zip(ids, lean):
        (rec,) = reg.records(sid)
        assert current(rec) is t and rec[1:] == (0, tuple(t.shape), t.stride(), t.dtype,
                                                 None, None, False, True)
        assert reg.records(sid)[0] is rec  # built once, then the same record
        assert reg.holds(sid) and reg.bindings(sid)[0].current() is t
    assert [r[1:] for _, recs in reg.items() for r in recs] == [
        r[1:] for s in p1.slices() for r in reg.records(s.slice_id)]
    assert reg.records(10**9) == () and not reg.holds(10**9)


def test_unbind_rebind_free_and_dead_tensors_in_a_run() -> None:
    p1, lean, _, _ = _pair()
    reg = p1.registry
    slices = p1.slices()
    p1.disown(slices[1])  # unbinds one id of the run
    assert not reg.holds(slices[1].slice_id) and reg.records(slices[1].slice_id) == ()
    assert len(reg) == N - 1 and slices[1].slice_id not in {sid for sid, _ in reg.items()}
    p1.free(slices[1])
    with pytest.raises(Exception):
        p1.free(slices[2])  # still backs a tensor of the run
    del lean[2]
    gc.collect()
    assert not reg.holds(slices[2].slice_id)
    p1.free(slices[2])  # its tensor died: the binding goes with the slice
    assert len(reg) == N - 2 and p1.is_valid()
    version = reg.version
    reg.bind(slices[0].slice_id, list(reg.records(slices[0].slice_id)))  # bound anew
    assert reg.version > version and len(reg) == N - 2
    assert [sid for sid, _ in reg.items()].count(slices[0].slice_id) == 1


def test_a_failed_second_adoption_restores_the_run() -> None:
    p1, lean, _, _ = _pair(capacity=1 << 16)  # room for a second batch (placed one by one)
    before = _view(p1)
    pinned = torch.randn(4)
    keep = pinned.view(2, 2)  # a view the adoption is not told about pins the original
    with pytest.raises(PinnedStorageError):
        p1.adopt([torch.randn(3), pinned])
    assert _view(p1) == before and len(p1.registry) == N
    del keep
    p1.adopt([torch.randn(3), pinned])
    assert len(p1.registry) == N + 2 and p1.is_valid()


def test_relocation_keeps_a_runs_bindings() -> None:
    p1, lean, p2, general = _pair()
    values = [t.clone() for t in lean]
    p1.disown(p1.slices()[0])
    p1.free(p1.slices()[0])
    lean, values = lean[1:], values[1:]
    p1.compact()  # new handles: the bindings move to plain records of the new ids
    assert len(p1.registry) == N - 1 and p1.is_valid()
    for t, v in zip(lean, values):
        assert torch.equal(t, v) and p1.slice_of(t) is not None


def test_small_batches_bind_plain_records_and_many_runs_are_found() -> None:
    pool = FlatPool(capacity=1 << 22)
    small = [torch.randn(3) for _ in range(RUN_MIN - 1)]
    pool.adopt(small)
    assert not pool.registry._runs and len(pool.registry._records) == RUN_MIN - 1
    batches = [[torch.randn(2) for _ in range(RUN_MIN)] for _ in range(5)]
    for batch in batches:
        pool.adopt(batch)
    reg = pool.registry
    assert len(reg._runs) == 5 and len(reg) == RUN_MIN - 1 + 5 * RUN_MIN
    for s, t in zip(pool.slices(), [*small, *(t for b in batches for t in b)]):
        assert current(reg.records(s.slice_id)[0]) is t


@pytest.mark.parametrize("kind", ["parameters", "tensors"])
def test_a_dropped_member_taken_out_of_a_run_does_not_pin_a_relocation(kind: str) -> None:
    """``disown`` + ``free`` of one member of a lean batch, its owner then drops it: the run
    must have let go of it, or ``compact()`` finds the old storage held by the run's record
    (it raised ``PinnedStorageError``, "held by: a ParamRef object", for parameters)."""
    make = torch.nn.Parameter if kind == "parameters" else (lambda t: t)
    ts = [make(torch.randn(3)) for _ in range(N)]
    pool = FlatPool()
    pool.adopt(ts)
    first = pool.slices()[0]
    pool.disown(first)
    pool.free(first)
    ts = ts[1:]  # the only other holder of the first member lets go
    gc.collect()
    values = [t.detach().clone() for t in ts]
    pool.compact()
    assert pool.is_valid() and len(pool.registry) == N - 1
    assert all(torch.equal(t.detach(), v) and pool.owns(t) for t, v in zip(ts, values))


def test_a_plain_tensor_of_a_run_is_not_weakly_referenced_and_can_be_swapped() -> None:
    """Issue 20: the run holds its tensors in a column and a record's reference is a
    ``TensorRef``; ``swap_tensors`` refuses a tensor with a weak reference, and works here."""
    import weakref

    ts = [torch.randn(4) for _ in range(N)]
    pool = FlatPool()
    pool.adopt(ts)
    assert weakref.getweakrefcount(ts[5]) == 0
    other = torch.zeros(4)
    torch.utils.swap_tensors(ts[5], other)
    assert not pool.is_valid()  # the swapped-out tensor no longer aliases its slice
