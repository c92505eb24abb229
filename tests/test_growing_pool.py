"""A pool made without ``capacity=`` grows when an adoption does not fit (issue 32.1).

A second ``adopt`` into a default pool moves the pool, inside the adoption's transaction, to a
storage with exactly the room the batch needs: every earlier member follows in place (object
identity, values, views made after adoption), the old storage is proven dead with the
originals, and any failure puts the pool back on its old storage. A fixed ``capacity=`` still
raises :class:`PoolExhaustedError`, and ``allocate()`` never moves a storage.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from flatpool import FlatPool, PinnedStorageError, PoolExhaustedError


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_default_pool_takes_a_second_and_third_adopt() -> None:
    pool = FlatPool()
    a = torch.nn.Parameter(torch.randn(100))
    opt = torch.optim.SGD([a], lr=0.1)
    b, c = torch.randn(300), torch.arange(50, dtype=torch.int64)
    want = {"a": a.detach().clone(), "b": b.clone(), "c": c.clone()}
    pool.adopt([a])
    first = StorageWeakRef(pool.storage)
    a_slice = pool.slice_of(a)
    report = pool.adopt([b])
    assert first.expired(), "the pool's old storage outlived its growth"
    assert report.all_released and report.items[0].released
    report = pool.adopt(c)
    assert pool.owns(a) and pool.owns(b) and pool.owns(c)
    assert _ptr(a) == _ptr(b) == _ptr(c) == _ptr(pool.byte_buffer())
    assert pool.slice_of(a) == a_slice  # offsets and handles stay
    for name, t in {"a": a, "b": b, "c": c}.items():
        assert torch.equal(t.detach(), want[name]), name
    # Exactly the room needed: the last slice's end, padded to the pool's alignment.
    last = max(s.end for s in pool.slices())
    assert pool.capacity == -(-last // pool.alignment) * pool.alignment
    pool.check_invariants()
    # The optimizer steps the very parameter the pool holds.
    a.grad = torch.ones(100)
    opt.step()
    assert pool.owns(a) and torch.allclose(a.detach(), want["a"] - 0.1)


def test_views_made_after_adoption_follow_the_growth() -> None:
    pool = FlatPool(alignment=64)
    w = torch.nn.Parameter(torch.randn(8, 8))
    pool.adopt(w)
    row, flat = w[2], pool.flat(torch.float32)  # made after adoption: the registry knows neither
    row_before = row.detach().clone()
    pool.adopt(torch.randn(1000))
    assert _ptr(row) == _ptr(flat) == _ptr(w)
    assert torch.equal(row.detach(), row_before)
    row.data.fill_(7.0)  # still the pool's bytes
    assert torch.equal(w[2].detach(), torch.full((8,), 7.0))


def test_a_failed_batch_puts_the_pool_back_on_its_old_storage() -> None:
    pool = FlatPool(alignment=64)
    a = torch.randn(64)
    pool.adopt(a)
    storage, capacity, a_before = pool.storage.data_ptr(), pool.capacity, a.clone()
    b = torch.randn(500)
    b_view = b[:10]  # not named: pins b's original
    with pytest.raises(PinnedStorageError, match="b_view"):
        pool.adopt(b)
    assert pool.storage.data_ptr() == storage and _ptr(a) == storage
    assert pool.capacity == capacity
    assert torch.equal(a, a_before) and not pool.owns(b)
    assert b_view.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    pool.check_invariants()
    del b_view
    pool.adopt(b)  # (holding the old UntypedStorage object itself would pin it: it is named)
    assert pool.owns(b) and pool.capacity > capacity


def test_a_tensor_autograd_saved_on_the_old_storage_refuses_the_growth() -> None:
    pool = FlatPool(alignment=64)
    w = torch.nn.Parameter(torch.randn(4, 4))
    pool.adopt(w)
    storage, capacity = pool.storage.data_ptr(), pool.capacity
    u = w.view(16)  # an autograd view, then saved by the graph only
    loss = (u * u).sum()
    del u
    gc.collect()
    other = torch.randn(1000)
    with pytest.raises(PinnedStorageError, match="old storage"):
        pool.adopt(other)
    assert pool.storage.data_ptr() == storage and pool.capacity == capacity
    assert not pool.owns(other)
    loss.backward()  # the graph still reads the bytes it saved
    assert torch.allclose(w.grad, 2 * w.detach())
    del loss
    pool.adopt(other)
    assert pool.owns(other) and pool.owns(w)


def test_a_fixed_capacity_raises_and_says_how_to_grow() -> None:
    pool = FlatPool(capacity=1024)
    a = torch.randn(10)
    pool.adopt(a)
    b = torch.randn(1000)
    with pytest.raises(PoolExhaustedError, match="without capacity="):
        pool.adopt(b)
    assert pool.capacity == 1024 and not pool.owns(b) and pool.owns(a)


def test_allocate_never_moves_a_storage_and_says_to_grow() -> None:
    pool = FlatPool(alignment=64)
    pool.adopt(torch.randn(16))
    storage = pool.storage.data_ptr()
    with pytest.raises(PoolExhaustedError, match=r"grow\(\) it first"):
        pool.allocate((100,), torch.float32)
    assert pool.storage.data_ptr() == storage
    pool.grow(pool.capacity + 512)
    assert pool.allocate((100,), torch.float32).end <= pool.capacity


_HEAP_WALKS = {"on": False, "count": 0}


def _count_heap_walks(event: str, args: tuple[object, ...]) -> None:
    """An audit hook (Python raises ``gc.get_objects`` for every call): counts walks while on."""
    if event == "gc.get_objects" and _HEAP_WALKS["on"]:
        _HEAP_WALKS["count"] += 1


sys.addaudithook(_count_heap_walks)  # (a hook stays for the process; it counts only when on)


def _walks_during(fn: Callable[[], object]) -> int:
    _HEAP_WALKS.update(on=True, count=0)
    try:
        fn()
    finally:
        _HEAP_WALKS["on"] = False
    return _HEAP_WALKS["count"]


def test_growth_walks_the_heap_only_for_an_unknown_view() -> None:
    """Issue 41.9: every growing adopt walked the whole Python heap (gc.get_objects) to find
    unknown views of the old storage. With only its bound members on it, growth counts the
    storage's users instead; an unknown view still makes it search, and still follows."""
    pool = FlatPool()
    a = torch.nn.Parameter(torch.randn(64))
    pool.adopt([a])
    old = StorageWeakRef(pool.storage)
    b = torch.randn(5000)
    assert _walks_during(lambda: pool.adopt([b])) == 0
    assert old.expired() and pool.owns(a) and pool.owns(b)
    view = a.detach()[3:10]  # a view the pool never saw
    want = view.clone()
    old = StorageWeakRef(pool.storage)
    c = torch.randn(5000)
    assert _walks_during(lambda: pool.adopt([c])) >= 1
    assert old.expired() and pool.owns(view) and torch.equal(view, want)
