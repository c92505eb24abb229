"""The live-slice index with batches as columns (flatpool/_slice_index.py, issue 20).

A batch's slice handles are made only when read, and then always the same objects; frees of
run members, singles placed into the gaps they leave, snapshots and restores all read exactly
as a plain dict-and-sorted-list index would.
"""

from __future__ import annotations

from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatpool import FlatPool, Slice
from flatpool._slice_index import SliceIndex, SliceRun


def _model_floor(live: dict[int, Slice], offset: int) -> Slice | None:
    below = [s for s in live.values() if s.offset <= offset]
    return max(below, key=lambda s: s.offset) if below else None


@settings(max_examples=150, deadline=None)
@given(
    runs=st.lists(st.integers(1, 12), min_size=0, max_size=4),
    ops=st.lists(st.tuples(st.sampled_from("fsxcr"), st.integers(0, 1 << 20)), max_size=60),
)
def test_the_index_reads_like_a_dict_of_handles(runs: list[int], ops: list[tuple[str, int]]) -> None:
    """Runs (consecutive ids, ascending offsets past everything before) and singles placed in
    the gaps their freed members leave: get, floor, len, order and copies agree with a model."""
    pool = FlatPool(alignment=1)
    index = SliceIndex()
    live: dict[int, Slice] = {}
    next_id, pos = 0, 0
    for n in runs:
        starts = array("q", range(pos, pos + 16 * n, 16))  # 8-byte slices, 8-byte gaps
        run = SliceRun(pool, next_id, starts, [(2,)] * n, [torch.float32] * n)
        index.add_run(run)
        for i in range(n):
            live[next_id + i] = run[i]
        next_id, pos = next_id + n, pos + 16 * n
    saved: list[tuple[SliceIndex, dict[int, Slice]]] = []
    holes = [s.offset for s in live.values()]  # offsets a freed member leaves free
    for op, k in ops:
        if op == "f" and live:  # free one
            slc = sorted(live.values(), key=lambda s: s.slice_id)[k % len(live)]
            index.remove(slc)
            del live[slc.slice_id]
        elif op == "s":  # a single into a free 8-byte hole, or past the end
            taken = {s.offset for s in live.values()}
            free = [o for o in holes if o not in taken]
            offset = free[k % len(free)] if free and k % 3 else pos
            if offset == pos:
                pos += 16
                holes.append(offset)
            slc = Slice(pool, next_id, offset, (2,), torch.float32)
            next_id += 1
            index.insert(slc)
            live[slc.slice_id] = slc
        elif op == "x" and live:  # an interrupted remove, repaired by its absolute undo
            slc = sorted(live.values(), key=lambda s: s.slice_id)[k % len(live)]
            index.remove(slc)
            index.reindex(slc)
            index.reindex(slc)  # idempotent
        elif op == "c":
            saved.append((index.copy(), dict(live)))
        elif op == "r" and saved:
            index, live = saved.pop()
            index, live = index.copy(), dict(live)
        assert index.consistent() and index.gone_are_members() and len(index) == len(live)
        for sid, slc in live.items():
            assert index.get(sid) is slc  # the same object on every read
            assert index.floor(slc.offset) is slc and index.floor(slc.offset + 7) is slc
        for probe in (0, 4, 8, 12, pos - 1, pos + 100, k % (pos + 1)):
            assert index.floor(probe) == _model_floor(live, probe)
        assert index.ordered() == sorted(live.values(), key=lambda s: s.offset)
        assert index.used_bytes() == 8 * len(live)
        assert index.get(next_id + 5) is None
    for _, model in saved:  # copies taken earlier were not changed by later edits
        assert all(s.slice_id in model for s in model.values())


def test_a_batch_s_handles_are_one_set_of_objects() -> None:
    """A batch's slices are placed as one run; every reader gets the same handle objects: the
    report, the pool and ``slice_of``."""
    ts = [torch.randn(10) for _ in range(1000)]
    pool = FlatPool()
    report = pool.adopt(ts)
    assert report.all_released
    slices = report.slices
    assert len(slices) == 1000 and len({id(s) for s in slices}) == 1000
    assert pool.slices() == slices
    for t, s in zip(ts[::97], slices[::97]):
        assert pool.slice_of(t) is s and pool.live_slice(s.slice_id) is s and s.is_live
    assert report.slices == slices


def test_a_freed_run_member_s_gap_takes_a_single_and_lookups_stay_exact() -> None:
    pool = FlatPool(alignment=64)
    ts = [torch.full((16,), float(i)) for i in range(100)]  # 64 B each: no padding
    report = pool.adopt(ts)
    victim = report.slices[40]
    pool.disown(victim)
    pool.free(victim)
    assert not victim.is_live and pool.live_slice(victim.slice_id) is None
    fresh = pool.allocate((16,), torch.float32)
    assert fresh.offset == victim.offset and fresh.slice_id != victim.slice_id
    assert pool.slice_of(fresh.tensor()) == fresh
    assert pool.slice_of(ts[39]) is report.slices[39] and pool.slice_of(ts[41]) is report.slices[41]
    assert [s.offset for s in pool.slices()] == sorted(s.offset for s in pool.slices())
    assert len(pool.slices()) == 100
    with pytest.raises(Exception, match="freed or relocated"):
        pool.view(victim)


def test_a_failed_operation_restores_the_run_and_its_handles() -> None:
    """A rollback puts the index back: the run's members freed inside the operation are live
    again, as the same handle objects."""
    pool = FlatPool(alignment=64)
    ts = [torch.full((16,), float(i)) for i in range(100)]
    report = pool.adopt(ts)
    handles = list(report.slices)
    snap = pool._state.capture()
    for s in handles[10:20]:
        pool.disown(s)
    pool._state._drop(handles[10])
    pool._state.restore(snap)
    pool._state.forget(snap)
    assert pool.live_slice(handles[10].slice_id) is handles[10]
    assert pool.slices() == tuple(handles)
