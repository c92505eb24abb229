"""Property tests: random allocate/free/materialize sequences keep the pool's layout invariants.

After every step: live slices never overlap and lie inside the capacity, every start is aligned
to ``max(alignment, itemsize)``, ``used_bytes + free_bytes == capacity``; a refused allocation
really had no room (checked against a brute-force scan of the gaps) and changed nothing; a
freed range takes the same request again at once; bytes written to one slice survive writes to
every other.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flatpool import FlatPool, FreedSliceError, PoolExhaustedError, Slice
from tests.reliability.state import check_layout

DTYPES = [
    torch.uint8,
    torch.bool,
    torch.int16,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int64,
    torch.float64,
    torch.complex128,
    torch.float8_e4m3fn,
]
ALIGNMENTS = [1, 2, 4, 8, 16, 64, 512]

shapes = st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple)
alloc_op = st.tuples(st.just("alloc"), st.sampled_from(DTYPES), shapes)
free_op = st.tuples(st.just("free"), st.integers(0, 1 << 16), st.booleans())
materialize_op = st.tuples(st.just("materialize"))


def ops(max_size: int) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    return st.lists(
        st.one_of(alloc_op, alloc_op, free_op, materialize_op), min_size=1, max_size=max_size
    )


def fits_somewhere(pool: FlatPool, nbytes: int, align: int) -> bool:
    """Brute force: is there an aligned start with ``nbytes`` free after it?"""
    pos = 0
    bounds = [(s.offset, s.end) for s in pool.slices()] + [(pool.capacity, pool.capacity)]
    for start, end in bounds:
        aligned = -(-pos // align) * align
        if aligned + nbytes <= start:
            return True
        pos = max(pos, end)
    return False


class Model:
    """Drives a pool and checks it after every step."""

    def __init__(self, pool: FlatPool) -> None:
        self.pool = pool
        self.live: list[Slice] = []
        self.tags: dict[int, int] = {}  # slice_id -> byte written into every byte of it
        self.next_tag = 1

    def state(self) -> tuple[Any, ...]:
        p = self.pool
        return (p.slices(), p.capacity, p.used_bytes, p.free_bytes, p.is_materialized)

    def write(self, s: Slice) -> None:
        tag = self.next_tag
        self.next_tag = self.next_tag % 255 + 1
        s.bytes().fill_(tag)
        self.tags[s.slice_id] = tag

    def allocate(self, dtype: torch.dtype, shape: tuple[int, ...]) -> Slice | None:
        pool = self.pool
        nbytes = (torch.Size(shape).numel()) * dtype.itemsize
        align = max(pool.alignment, dtype.itemsize)
        before = self.state()
        could_fit = fits_somewhere(pool, nbytes, align)
        try:
            s = pool.allocate(shape, dtype)
        except PoolExhaustedError as err:
            assert not could_fit, f"refused {nbytes} B at {align} though a gap fits"
            assert err.requested == nbytes and err.largest_free < nbytes
            assert self.state() == before
            return None
        assert s.shape == shape and s.dtype == dtype and s.nbytes == nbytes
        self.live.append(s)
        if pool.is_materialized:
            self.write(s)
        return s

    def free(self, index: int, reallocate: bool) -> None:
        if not self.live:
            return
        s = self.live.pop(index % len(self.live))
        self.pool.free(s)
        self.tags.pop(s.slice_id, None)
        assert not s.is_live
        with pytest.raises(FreedSliceError):
            self.pool.free(s)
        if reallocate:
            capacity = self.pool.capacity
            again = self.pool.allocate(s.shape, s.dtype)  # must fit: the freed range does
            assert self.pool.capacity == capacity, "reuse grew the pool"
            self.live.append(again)
            if self.pool.is_materialized:
                self.write(again)

    def materialize(self) -> None:
        was = self.pool.is_materialized
        self.pool.materialize()
        if not was:
            for s in self.live:
                self.write(s)

    def check(self) -> None:
        pool = self.pool
        slices = pool.slices()
        assert sorted(slices, key=lambda s: s.slice_id) == sorted(
            self.live, key=lambda s: s.slice_id
        )
        for a, b in zip(slices, slices[1:]):
            assert a.end <= b.offset, f"{a} overlaps {b}"
        for s in slices:
            assert s.offset % max(pool.alignment, s.dtype.itemsize) == 0
            assert 0 <= s.offset and s.end <= pool.capacity
        assert pool.used_bytes == sum(s.nbytes for s in slices)
        assert pool.used_bytes + pool.free_bytes == pool.capacity
        assert 0 <= pool.largest_free_bytes <= pool.free_bytes
        if pool.is_materialized:
            raw = pool.flat(torch.uint8)
            for s in slices:
                expected = torch.full((s.nbytes,), self.tags[s.slice_id], dtype=torch.uint8)
                assert torch.equal(raw[s.offset : s.end], expected), f"{s} was overwritten"
                assert torch.equal(s.bytes(), expected)
                assert pool.slice_of(s.tensor()) == s


def run(
    alignment: int, capacity: int | None, steps: list[tuple[Any, ...]], materialize_first: bool
) -> None:
    model = Model(FlatPool(alignment=alignment, capacity=capacity))
    if materialize_first:
        model.materialize()
    for step in steps:
        if step[0] == "alloc":
            model.allocate(step[1], step[2])
        elif step[0] == "free":
            model.free(step[1], step[2])
        else:
            model.materialize()
        model.check()
    model.materialize()
    model.check()


@given(
    alignment=st.sampled_from(ALIGNMENTS),
    capacity=st.one_of(st.none(), st.integers(0, 4096)),
    steps=ops(30),
    materialize_first=st.booleans(),
)
def test_random_sequences(
    alignment: int, capacity: int | None, steps: list[tuple[Any, ...]], materialize_first: bool
) -> None:
    run(alignment, capacity, steps, materialize_first)


@given(
    alignment=st.sampled_from([1, 8, 64]),
    capacity=st.integers(64, 1024),
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    data=st.data(),
)
def test_freed_range_is_reusable_in_full_pool(
    alignment: int, capacity: int, sizes: list[int], data: st.DataObject
) -> None:
    """Fill a fixed pool until it refuses, free any slice: the same request fits again."""
    pool = FlatPool(alignment=alignment, capacity=capacity)
    live = []
    for n in sizes:
        try:
            live.append(pool.allocate(n, torch.uint8))
        except PoolExhaustedError:
            pass
    if not live:
        return
    victim = live[data.draw(st.integers(0, len(live) - 1))]
    used = pool.used_bytes
    pool.free(victim)
    again = pool.allocate(victim.shape, victim.dtype)
    assert pool.used_bytes == used
    assert again.nbytes == victim.nbytes


@pytest.mark.slow
@given(
    alignment=st.sampled_from(ALIGNMENTS),
    capacity=st.one_of(st.none(), st.integers(0, 1 << 16)),
    steps=ops(300),
    materialize_first=st.booleans(),
)
def test_long_random_sequences(
    alignment: int, capacity: int | None, steps: list[tuple[Any, ...]], materialize_first: bool
) -> None:
    run(alignment, capacity, steps, materialize_first)


@given(
    alignment=st.sampled_from(ALIGNMENTS),
    requests=st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=40),
    planned_first=st.integers(0, 3),
)
def test_batch_placement_equals_one_by_one(
    alignment: int, requests: list[tuple[torch.dtype, tuple[int, ...]]], planned_first: int
) -> None:
    """A batch adoption places its slices in one step (``allocate_many``); the layout must be
    exactly what allocating them one at a time gives, free list included."""
    one, many = FlatPool(alignment=alignment), FlatPool(alignment=alignment)
    for dt, shape in requests[:planned_first]:  # slices planned before the batch
        one.allocate(shape, dt)
        many.allocate(shape, dt)
    batch = [(shape, dt) for dt, shape in requests[planned_first:]]
    singles = [one.allocate(shape, dt) for shape, dt in batch]
    placed = many.allocate_many(batch)
    assert [(s.offset, s.shape, s.dtype) for s in placed] == [
        (s.offset, s.shape, s.dtype) for s in singles
    ]
    assert many.describe() == one.describe().replace(one.name, many.name)
    assert many._state._alloc.free_ranges() == one._state._alloc.free_ranges()
    assert many.used_bytes + many.free_bytes == many.capacity


@given(
    alignment=st.sampled_from(ALIGNMENTS),
    requests=st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=30),
    later=st.lists(st.tuples(st.integers(0, 1 << 16), st.sampled_from(DTYPES), shapes),
                   max_size=20),
)
def test_after_a_batch_frees_and_reuse_match_one_by_one(
    alignment: int, requests: list[tuple[torch.dtype, tuple[int, ...]]],
    later: list[tuple[int, torch.dtype, tuple[int, ...]]],
) -> None:
    """The padding gaps a batch leaves are in neither best-fit index (they fit no request):
    freeing slices beside them must still coalesce, and later requests land, exactly as after
    one-by-one placement."""
    one, many = FlatPool(alignment=alignment), FlatPool(alignment=alignment)
    batch = [(shape, dt) for dt, shape in requests]
    singles = [one.allocate(shape, dt) for shape, dt in batch]
    placed = many.allocate_many(batch)
    for pick, dt, shape in later:
        if singles and pick % 2:
            i = pick % len(singles)
            one.free(singles.pop(i))
            many.free(placed.pop(i))
        else:
            a, b = one.allocate(shape, dt), many.allocate(shape, dt)
            assert (a.offset, a.nbytes) == (b.offset, b.nbytes)
            singles.append(a)
            placed.append(b)
        assert many._state._alloc.free_ranges() == one._state._alloc.free_ranges()
        assert many._state._alloc._by_usable == one._state._alloc._by_usable
        assert many._state._alloc._by_size == one._state._alloc._by_size
    check_layout(many)


def test_a_batch_s_padding_gaps_are_kept_as_two_int64_columns() -> None:
    """Issue 20's heap budget: a batch of n odd-sized slices leaves n - 1 padding gaps. They
    are kept as ``array('q')`` bounds (16 B a gap), not Python tuples in the best-fit indexes
    (about 225 B a gap before)."""
    pool = FlatPool(alignment=512)
    pool.allocate_many([((100,), torch.float32)] * 1000)  # 400 B each, 112 B padding after
    alloc = pool._state._alloc
    assert len(alloc.free_ranges()) == 999
    assert alloc._by_size == [] and alloc._by_usable == []
    assert alloc._starts.itemsize == alloc._ends.itemsize == 8
    pool.free(pool.slices()[1])  # coalesces with its padding and the previous slice's
    assert (400, 1024) in alloc.free_ranges()
    assert alloc._by_usable == [(512, 400)]
