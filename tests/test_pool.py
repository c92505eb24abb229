"""FlatPool and Slice: allocation, layout, materialization, views, ownership queries, errors."""

from __future__ import annotations

import importlib.util
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from flatpool import (
    DEFAULT_ALIGNMENT,
    DeviceError,
    FlatPool,
    FlatPoolError,
    ForeignSliceError,
    FreedSliceError,
    InvalidRequestError,
    InvalidTypeError,
    PoolExhaustedError,
    Slice,
    SliceError,
    live_pools,
)

ALL_DTYPES = sorted(
    {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}, key=str
)
# Quantized dtypes need quantizer parameters a plain storage cannot carry: rejected by design.
QUANTIZED = [dt for dt in ALL_DTYPES if str(dt).startswith(("torch.qint", "torch.quint"))]
# Sub-byte shell dtypes (torch.int1..torch.uint7) have no kernels, not even copy_: rejected too.
SHELL = [dt for dt in ALL_DTYPES if re.fullmatch(r"torch\.u?int[1-7]", str(dt))]
PLAIN_DTYPES = [dt for dt in ALL_DTYPES if dt not in QUANTIZED and dt not in SHELL]


def state(pool: FlatPool) -> tuple[Any, ...]:
    """Everything observable about a pool's layout, to compare before/after a failing call."""
    return (
        pool.describe(),
        pool.slices(),
        pool.capacity,
        pool.used_bytes,
        pool.free_bytes,
        pool.largest_free_bytes,
        pool.is_materialized,
    )


def gap_rows(pool: FlatPool) -> list[tuple[int, int]]:
    rows = []
    for line in pool.describe().splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[3] == "gap":
            rows.append((int(cols[0]), int(cols[1])))
    return rows


@pytest.fixture(params=["planned", "materialized", "fixed"])
def populated(request: pytest.FixtureRequest) -> FlatPool:
    """A pool holding two slices of different dtypes, in one of three states."""
    capacity = 4096 if request.param == "fixed" else None
    pool = FlatPool(capacity=capacity, name=f"populated-{request.param}")
    pool.allocate((4, 4), torch.float32)
    pool.allocate(10, torch.bfloat16)
    if request.param == "materialized":
        pool.materialize()
    return pool


# -- allocation ----------------------------------------------------------------------------
def test_allocate_returns_typed_slice() -> None:
    pool = FlatPool(name="p")
    s = pool.allocate((3, 5), torch.float64)
    assert isinstance(s, Slice)
    assert s.pool is pool
    assert (s.shape, s.dtype, s.offset) == ((3, 5), torch.float64, 0)
    assert (s.numel, s.nbytes, s.end) == (15, 120, 120)
    assert s.is_live and pool.is_live(s)
    assert pool.slices() == (s,)
    assert pool.used_bytes == 120
    assert not pool.is_materialized


@pytest.mark.parametrize(
    "shape, expected",
    [
        (7, (7,)),
        ((2, 3), (2, 3)),
        ([2, 3], (2, 3)),
        (torch.Size([4, 1, 2]), (4, 1, 2)),
        ((np.int64(3), np.int32(2)), (3, 2)),
        ((), ()),
    ],
)
def test_shape_forms(shape: Any, expected: tuple[int, ...]) -> None:
    pool = FlatPool()
    s = pool.allocate(shape, torch.int16)
    assert s.shape == expected
    assert all(type(d) is int for d in s.shape)
    assert s.tensor().shape == expected


def test_slice_ids_unique_over_pool_lifetime() -> None:
    pool = FlatPool(capacity=4096)
    a = pool.allocate(4, torch.float32)
    pool.free(a)
    b = pool.allocate(4, torch.float32)
    assert b.offset == a.offset
    assert b.slice_id != a.slice_id
    assert a != b and not a.is_live and b.is_live
    assert {b: "ok"}[b] == "ok"  # slices are hashable handles


def test_slices_in_storage_order() -> None:
    pool = FlatPool(alignment=1, capacity=100)
    a = pool.allocate(10, torch.uint8)
    b = pool.allocate(10, torch.uint8)
    c = pool.allocate(10, torch.uint8)
    pool.free(a)
    d = pool.allocate(5, torch.uint8)
    assert pool.slices() == (d, b, c)
    assert [s.offset for s in pool.slices()] == [0, 10, 20]


# -- alignment -------------------------------------------------------------------------------
def test_dtype_enumeration_is_complete() -> None:
    assert torch.float32 in PLAIN_DTYPES and torch.bfloat16 in PLAIN_DTYPES
    assert torch.qint8 in QUANTIZED and torch.quint4x2 in QUANTIZED
    assert len(PLAIN_DTYPES) > 20


def test_default_alignment_is_512() -> None:
    assert DEFAULT_ALIGNMENT == 512
    pool = FlatPool()
    assert pool.alignment == 512
    pool.allocate(1, torch.uint8)
    s = pool.allocate(1, torch.uint8)
    assert s.offset == 512


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("alignment", [1, 2, 64, 512])
@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=str)
def test_alignment_every_dtype(dtype: torch.dtype, alignment: int) -> None:
    pool = FlatPool(alignment=alignment)
    pad = pool.allocate(3, torch.uint8)  # odd-sized, so the next start must be rounded up
    s = pool.allocate((2, 3), dtype)
    step = max(alignment, dtype.itemsize)
    assert pool.slice_alignment(dtype) == step
    assert s.offset % step == 0
    assert s.offset >= pad.end
    assert s.offset - pad.end < step  # no more padding than needed
    pool.materialize()
    t = s.tensor()
    assert t.dtype == dtype and t.shape == (2, 3) and t.is_contiguous()
    assert t.data_ptr() == pool.storage.data_ptr() + s.offset
    assert pool.slice_of(t) == s
    # The bytes written through the slice land at its offset of the storage.
    s.bytes().copy_(torch.arange(s.nbytes, dtype=torch.uint8))
    assert torch.equal(pool.flat(torch.uint8)[s.offset : s.end], torch.arange(s.nbytes, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_quantized_dtypes_rejected(dtype: torch.dtype, populated: FlatPool) -> None:
    before = state(populated)
    with pytest.raises(InvalidTypeError, match="quantized"):
        populated.allocate(4, dtype)
    assert state(populated) == before


@pytest.mark.parametrize("dtype", SHELL, ids=str)
def test_shell_dtypes_rejected(dtype: torch.dtype, populated: FlatPool) -> None:
    before = state(populated)
    with pytest.raises(InvalidTypeError, match="no kernels"):
        populated.allocate(4, dtype)
    assert state(populated) == before


def test_mixed_dtypes_in_one_pool() -> None:
    pool = FlatPool(alignment=1)
    specs = [
        ((3,), torch.uint8),
        ((2, 2), torch.float32),
        ((5,), torch.bfloat16),
        ((3,), torch.int64),
        ((7,), torch.bool),
        ((2,), torch.complex128),
    ]
    slices = [pool.allocate(shape, dt) for shape, dt in specs]
    pool.materialize()
    for i, s in enumerate(slices):
        assert s.offset % s.dtype.itemsize == 0
        s.tensor().copy_(torch.full(s.shape, i + 1).to(s.dtype))
    for i, s in enumerate(slices):
        assert torch.equal(s.tensor(), torch.full(s.shape, i + 1).to(s.dtype))
    ranges = sorted((s.offset, s.end) for s in slices)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
    assert pool.flat().dtype == torch.uint8


# -- free, coalescing, best fit -----------------------------------------------------------------
def test_free_coalesces_into_one_gap() -> None:
    pool = FlatPool(alignment=512)
    a, b, c = (pool.allocate(25, torch.float32) for _ in range(3))
    pool.materialize()
    assert pool.capacity == 1536
    assert gap_rows(pool) == [(100, 512), (612, 1024), (1124, 1536)]
    pool.free(a)
    pool.free(c)
    assert gap_rows(pool) == [(0, 512), (612, 1536)]
    assert "in 2 range(s)" in pool.describe()
    pool.free(b)
    assert gap_rows(pool) == [(0, 1536)]
    assert "in 1 range(s), 0 slice(s)" in pool.describe()
    assert pool.largest_free_bytes == pool.capacity == pool.free_bytes
    # The merged range takes an allocation of the whole capacity.
    whole = pool.allocate(1536, torch.uint8)
    assert whole.offset == 0


def test_best_fit_takes_the_smallest_fitting_gap() -> None:
    pool = FlatPool(alignment=1, capacity=100)
    sizes = [10, 30, 10, 20, 10]
    a, b, c, d, e = (pool.allocate(n, torch.uint8) for n in sizes)
    pool.free(b)  # gap [10, 40)
    pool.free(d)  # gap [50, 70)
    assert pool.allocate(20, torch.uint8).offset == 50
    assert pool.allocate(30, torch.uint8).offset == 10


def test_planning_reuses_freed_gaps_before_growing() -> None:
    pool = FlatPool(alignment=1)
    a = pool.allocate(64, torch.uint8)
    pool.allocate(64, torch.uint8)
    pool.free(a)
    assert pool.capacity == 128
    assert pool.allocate(32, torch.uint8).offset == 0
    assert pool.capacity == 128
    assert pool.allocate(64, torch.uint8).offset == 128
    assert pool.capacity == 192


# -- exhaustion --------------------------------------------------------------------------------
@pytest.mark.parametrize("materialize", [False, True])
@pytest.mark.parametrize("alignment, largest", [(512, 0), (1, 424)])
def test_exhaustion_fixed_capacity(materialize: bool, alignment: int, largest: int) -> None:
    pool = FlatPool(capacity=1024, alignment=alignment)
    pool.allocate(600, torch.uint8)
    if materialize:
        pool.materialize()
    before = state(pool)
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate(600, torch.uint8)
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err, FlatPoolError)
    assert (err.requested, err.free, err.largest_free) == (600, 424, largest)
    assert "600" in str(err) and repr(pool.name) in str(err)
    assert state(pool) == before
    # What the error says fits, fits.
    if largest:
        assert pool.allocate(largest, torch.uint8).end == 1024


def test_exhaustion_after_materialize_of_growable_pool() -> None:
    pool = FlatPool(alignment=1)
    pool.allocate(16, torch.float32)
    pool.materialize()
    assert pool.capacity == 64
    before = state(pool)
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate(1, torch.uint8)
    assert (info.value.requested, info.value.free, info.value.largest_free) == (1, 0, 0)
    assert state(pool) == before


def test_exhaustion_counts_alignment() -> None:
    # 8 bytes are free at offset 4, but a float64 needs an 8-aligned start.
    pool = FlatPool(capacity=12, alignment=1)
    pool.allocate(4, torch.uint8)
    before = state(pool)
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate(1, torch.float64)
    assert (info.value.free, info.value.largest_free) == (8, 4)
    assert state(pool) == before


def test_fixed_capacity_is_allocated_exactly() -> None:
    pool = FlatPool(capacity=1000)  # not a multiple of the alignment
    pool.allocate(10, torch.float32)
    pool.materialize()
    assert pool.capacity == 1000
    assert pool.storage.nbytes() == 1000


# -- plan, then materialize ----------------------------------------------------------------------
def test_plan_from_meta_tensors_then_materialize_once(monkeypatch: pytest.MonkeyPatch) -> None:
    real_empty = torch.empty
    sized_calls: list[tuple[Any, ...]] = []

    def counting_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real_empty(*args, **kwargs)
        if out.numel():
            sized_calls.append(args)
        return out

    metas = [
        torch.empty(64, 32, device="meta"),
        torch.empty(32, dtype=torch.bfloat16, device="meta"),
        torch.empty(3, 3, dtype=torch.int64, device="meta"),
    ]
    pool = FlatPool()
    monkeypatch.setattr(torch, "empty", counting_empty)
    slices = [pool.allocate_like(m) for m in metas]
    assert not pool.is_materialized
    assert sized_calls == []
    assert [(s.shape, s.dtype) for s in slices] == [(tuple(m.shape), m.dtype) for m in metas]
    planned = pool.capacity
    assert planned == slices[-1].end
    offsets = [s.offset for s in slices]

    pool.materialize()
    assert pool.is_materialized
    assert len(sized_calls) == 1
    assert pool.capacity == -(-planned // pool.alignment) * pool.alignment
    assert pool.storage.nbytes() == pool.capacity
    assert [s.offset for s in pool.slices()] == offsets
    assert all(m.is_meta for m in metas)

    ptr = pool.storage.data_ptr()
    pool.materialize()  # idempotent
    slices[0].tensor()
    assert len(sized_calls) == 1
    assert pool.storage.data_ptr() == ptr


def test_first_view_materializes() -> None:
    pool = FlatPool()
    s = pool.allocate(4, torch.float32)
    assert not pool.is_materialized
    assert pool.slice_of(torch.empty(4)) is None and not pool.owns(torch.empty(4))
    t = s.tensor()
    assert pool.is_materialized
    assert pool.slice_of(t) == s


def test_allocate_like_real_tensor_copies_nothing() -> None:
    src = torch.arange(6.0).reshape(2, 3)
    pool = FlatPool()
    s = pool.allocate_like(src)
    assert (s.shape, s.dtype) == ((2, 3), torch.float32)
    assert not pool.owns(src)


# -- views ------------------------------------------------------------------------------------
def test_slice_views_write_through_to_flat() -> None:
    pool = FlatPool(alignment=4)
    a = pool.allocate((2, 3), torch.float32)
    b = pool.allocate(4, torch.float32)
    pool.materialize()
    pool.flat().zero_()
    a.tensor().copy_(torch.arange(6.0).reshape(2, 3))
    b.tensor().fill_(-1.0)
    flat = pool.flat()
    assert flat.dtype == torch.float32
    assert torch.equal(flat[: a.numel], torch.arange(6.0))
    assert torch.equal(flat[b.offset // 4 : b.end // 4], torch.full((4,), -1.0))
    flat[0] = 42.0
    assert a.tensor()[0, 0].item() == 42.0


def test_tensor_is_a_fresh_object_each_call() -> None:
    pool = FlatPool()
    s = pool.allocate(8, torch.int32)
    t1, t2 = s.tensor(), s.tensor()
    assert t1 is not t2
    assert t1.data_ptr() == t2.data_ptr()
    assert t1._base is None and t2._base is None
    t1.fill_(7)
    assert torch.equal(t2, torch.full((8,), 7, dtype=torch.int32))
    t1.resize_(0)  # reshaping one view object leaves the slice and other views intact
    assert s.tensor().shape == (8,)
    assert t2.shape == (8,)


def test_bytes_view() -> None:
    pool = FlatPool()
    s = pool.allocate(2, torch.int32)
    s.tensor().copy_(torch.tensor([1, 256], dtype=torch.int32))
    raw = s.bytes()
    assert raw.dtype == torch.uint8 and raw.shape == (8,)
    assert torch.equal(raw.view(torch.int32), s.tensor())


# -- flat() ----------------------------------------------------------------------------------------
def test_flat_typed_when_one_dtype() -> None:
    pool = FlatPool()  # planned: flat() materializes, then views the padded capacity
    pool.allocate(10, torch.bfloat16)
    pool.allocate(3, torch.bfloat16)
    f = pool.flat()
    assert f.dtype == torch.bfloat16 and f.shape == (pool.capacity // 2,)
    assert pool.flat(torch.bfloat16).dtype == torch.bfloat16
    assert pool.flat(torch.uint8).shape == (pool.capacity,)


def test_flat_bytes_when_mixed_or_empty() -> None:
    empty = FlatPool(capacity=64)
    assert empty.flat().dtype == torch.uint8  # no slices
    assert empty.flat().shape == (64,)
    pool = FlatPool()
    pool.allocate(10, torch.bfloat16)
    pool.allocate(3, torch.float32)
    assert pool.flat().dtype == torch.uint8
    assert pool.flat().shape == (pool.capacity,)


def test_flat_bytes_when_capacity_not_a_multiple() -> None:
    pool = FlatPool(capacity=10, alignment=1)
    pool.allocate(2, torch.float32)
    assert pool.flat().dtype == torch.uint8
    before = state(pool)
    with pytest.raises(InvalidRequestError, match="multiple"):
        pool.flat(torch.float32)
    assert state(pool) == before


@pytest.mark.parametrize(
    "dtype, error",
    [
        (torch.float32, InvalidRequestError),  # would reinterpret the bfloat16 slice
        (torch.float64, InvalidRequestError),
        ("float32", InvalidTypeError),
        (np.float32, InvalidTypeError),
        (torch.qint8, InvalidTypeError),
    ],
)
def test_flat_explicit_dtype_errors(dtype: Any, error: type[Exception]) -> None:
    pool = FlatPool()
    pool.allocate(4, torch.float32)
    pool.allocate(4, torch.bfloat16)
    pool.materialize()
    before = state(pool)
    with pytest.raises(error):
        pool.flat(dtype)
    assert state(pool) == before


# -- owns / slice_of ---------------------------------------------------------------------------------
@pytest.fixture
def matrix_pool() -> tuple[FlatPool, Slice, Slice]:
    pool = FlatPool(alignment=64)
    m = pool.allocate((6, 8), torch.float32)  # bytes [0, 192)
    v = pool.allocate(10, torch.float64)  # bytes [192, 272)
    pool.materialize()
    return pool, m, v


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t,
        lambda t: t[2],
        lambda t: t[1:4],
        lambda t: t.narrow(1, 2, 3),
        lambda t: t.t(),
        lambda t: t.transpose(0, 1)[::2],
        lambda t: t[::2],
        lambda t: t[:, ::3],
        lambda t: t[5, 7:],
        lambda t: t.view(-1)[10:20],
        lambda t: t.unsqueeze(0).expand(3, 6, 8),
        lambda t: t.view(torch.uint8),
        lambda t: t.view(torch.int16)[1:, 3:5],
        lambda t: t[2:2],
        lambda t: t[3, 4:4],
        lambda t: torch.as_strided(t, (2, 2), (8, 1), 9),
    ],
    ids=[
        "whole", "row", "rows", "narrow", "transposed", "transposed-stepped", "step-rows",
        "step-cols", "tail", "flat-range", "expanded", "bytes", "reinterpreted", "zero-rows",
        "zero-cols", "as_strided",
    ],
)
def test_slice_of_views(make: Callable[[torch.Tensor], torch.Tensor], matrix_pool: Any) -> None:
    pool, m, v = matrix_pool
    t = make(m.tensor())
    assert pool.owns(t)
    assert pool.slice_of(t) == m
    assert pool.slice_of(v.tensor()[3:]) == v


def test_slice_of_ranges_outside_slices(matrix_pool: Any) -> None:
    pool, m, v = matrix_pool
    flat = pool.flat(torch.uint8)
    straddling = flat[m.end - 4 : v.offset + 4]
    assert pool.owns(straddling) and pool.slice_of(straddling) is None
    padding = flat[v.end : v.end + 8]
    assert pool.owns(padding) and pool.slice_of(padding) is None
    zero_in_gap = flat[v.end + 1 : v.end + 1]
    assert pool.owns(zero_in_gap) and pool.slice_of(zero_in_gap) is None
    assert pool.owns(flat) and pool.slice_of(flat) is None
    # A zero-size view one past the slice belongs to no slice.
    assert pool.slice_of(v.tensor()[10:]) is None


def test_other_storages_are_not_owned(matrix_pool: Any) -> None:
    pool, m, _ = matrix_pool
    t = m.tensor()
    others = [
        torch.empty(6, 8),
        t.clone(),
        t.contiguous().detach().clone(),
        torch.empty(0),
        torch.empty(6, 8, device="meta"),
        FlatPool().allocate((6, 8), torch.float32).tensor(),
    ]
    for o in others:
        assert not pool.owns(o)
        assert pool.slice_of(o) is None


def test_same_address_other_storage_is_not_owned(matrix_pool: Any) -> None:
    pool, m, _ = matrix_pool
    t = m.tensor()
    twin = torch.from_numpy(t.numpy())  # same memory, a second StorageImpl
    assert twin.data_ptr() == t.data_ptr()
    assert not pool.owns(twin)
    assert pool.slice_of(twin) is None
    assert pool.owns(t)


def test_zero_size_tensor_at_zero_address_of_empty_pool() -> None:
    pool = FlatPool(capacity=0)
    pool.materialize()
    outsider = torch.empty(0)
    assert pool.storage.data_ptr() == outsider.data_ptr() == 0
    assert not pool.owns(outsider)
    assert pool.slice_of(outsider) is None
    assert pool.owns(pool.flat())


def test_free_and_reuse_stale_view() -> None:
    pool = FlatPool(capacity=1024)
    a = pool.allocate(8, torch.float32)
    stale = a.tensor()
    pool.free(a)
    assert pool.owns(stale)  # the bytes are still the pool's
    assert pool.slice_of(stale) is None  # but no live slice holds them
    b = pool.allocate(8, torch.float32)
    assert b.offset == a.offset
    assert pool.slice_of(stale) == b
    assert pool.slice_of(stale) != a
    with pytest.raises(FreedSliceError):
        a.tensor()


def test_unmaterialized_pool_owns_nothing() -> None:
    pool = FlatPool()
    pool.allocate(4, torch.float32)
    t = torch.empty(4)
    assert not pool.owns(t) and pool.slice_of(t) is None
    assert not pool.is_materialized


def test_dtensor_local_tensor_in_pool(
    matrix_pool: Any, dtensor_from_local: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    pool, m, v = matrix_pool
    dt = dtensor_from_local(m.tensor())
    assert dt.data_ptr() == 0  # the wrapper has no storage of its own
    assert pool.owns(dt) and pool.slice_of(dt) == m
    narrowed = dtensor_from_local(v.tensor()[2:6])
    assert pool.slice_of(narrowed) == v
    outside = dtensor_from_local(torch.empty(4))
    assert not pool.owns(outside) and pool.slice_of(outside) is None


def test_make_subclass_wrapper_in_pool(
    matrix_pool: Any, hp_wrap: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    pool, m, v = matrix_pool
    local = m.tensor()[1:3]
    w = hp_wrap(local)
    assert type(w) is not torch.Tensor
    assert pool.owns(w) and pool.slice_of(w) == m
    assert pool.slice_of(hp_wrap(v.tensor())) == v
    assert pool.slice_of(hp_wrap(torch.empty(3))) is None


# -- bad inputs: every one leaves the pool exactly as it was -------------------------------------
BAD_SHAPES: list[tuple[Any, type[Exception]]] = [
    (-1, InvalidRequestError),
    ((2, -3), InvalidRequestError),
    (1.5, InvalidTypeError),
    ((2, 1.5), InvalidTypeError),
    (2.0, InvalidTypeError),
    ("3", InvalidTypeError),
    ("abc", InvalidTypeError),
    (b"\x03", InvalidTypeError),
    ([2, "3"], InvalidTypeError),
    (None, InvalidTypeError),
    ((None,), InvalidTypeError),
    (True, InvalidTypeError),
    ((True, 2), InvalidTypeError),
    ((2, False), InvalidTypeError),
    ({2: 3}, InvalidTypeError),
    (torch.tensor(3.0), InvalidTypeError),
]


@pytest.mark.parametrize("shape, error", BAD_SHAPES, ids=repr)
def test_bad_shape(shape: Any, error: type[Exception], populated: FlatPool) -> None:
    before = state(populated)
    with pytest.raises(error):
        populated.allocate(shape, torch.float32)
    assert state(populated) == before


@pytest.mark.parametrize("shape", [0, (0,), (3, 0), (0, 5, 2)], ids=repr)
def test_zero_size_allocation(shape: Any, populated: FlatPool) -> None:
    before = state(populated)
    with pytest.raises(InvalidRequestError, match="no bytes"):
        populated.allocate(shape, torch.float32)
    with pytest.raises(InvalidRequestError):
        populated.allocate_like(torch.empty(shape, device="meta"))
    assert state(populated) == before


@pytest.mark.parametrize(
    "dtype",
    ["float32", "torch.float32", np.float32, np.dtype("float32"), float, int, None, 4, torch.Tensor],
    ids=repr,
)
def test_bad_dtype(dtype: Any, populated: FlatPool) -> None:
    before = state(populated)
    with pytest.raises(InvalidTypeError):
        populated.allocate(4, dtype)
    assert state(populated) == before


def test_allocate_like_needs_a_tensor(populated: FlatPool) -> None:
    before = state(populated)
    for bad in [np.zeros(3), [1.0, 2.0], None]:
        with pytest.raises(InvalidTypeError):
            populated.allocate_like(bad)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated in torch
        quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(InvalidTypeError):
        populated.allocate_like(quantized)
    assert state(populated) == before


def _no_new_pool(before: set[int]) -> bool:
    return {id(p) for p in live_pools()} <= before


@pytest.mark.parametrize(
    "device, match",
    [
        ("tpu", "unknown device"),
        ("gpu", "unknown device"),
        ("", "unknown device"),
        ("meta", "meta"),
        (torch.device("meta"), "meta"),
        ("xla", "not supported"),
    ],
    ids=repr,
)
def test_unknown_device(device: Any, match: str) -> None:
    before = {id(p) for p in live_pools()}
    with pytest.raises(DeviceError, match=match):
        FlatPool(device)
    assert _no_new_pool(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=str)
def test_cuda_unavailable(device: Any) -> None:
    with pytest.raises(DeviceError, match="no cuda device"):
        FlatPool(device)


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="needs a machine without torch_npu"
)
@pytest.mark.parametrize("device", ["npu", "npu:0"])
def test_npu_without_torch_npu(device: str) -> None:
    before = {id(p) for p in live_pools()}
    with pytest.raises(DeviceError) as info:
        FlatPool(device)
    msg = str(info.value)
    assert "import torch_npu" in msg and "No module named 'torch_npu'" in msg
    assert isinstance(info.value.__cause__, ImportError)
    assert _no_new_pool(before)


@pytest.mark.parametrize("device", [None, 1.5, ["cpu"], True], ids=repr)
def test_device_of_wrong_type(device: Any) -> None:
    with pytest.raises(InvalidTypeError):
        FlatPool(device)


def test_cpu_device_forms() -> None:
    assert FlatPool("cpu").device == torch.device("cpu")
    assert FlatPool(torch.device("cpu")).device == torch.device("cpu")
    assert FlatPool("cpu:0").device == torch.device("cpu")


@pytest.mark.parametrize(
    "alignment, error",
    [
        (0, InvalidRequestError),
        (3, InvalidRequestError),
        (-8, InvalidRequestError),
        (768, InvalidRequestError),
        (1.5, InvalidTypeError),
        (8.0, InvalidTypeError),
        (True, InvalidTypeError),
        ("512", InvalidTypeError),
        (None, InvalidTypeError),
    ],
    ids=repr,
)
def test_bad_alignment(alignment: Any, error: type[Exception]) -> None:
    before = {id(p) for p in live_pools()}
    with pytest.raises(error):
        FlatPool(alignment=alignment)
    assert _no_new_pool(before)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"capacity": -1}, InvalidRequestError),
        ({"capacity": 1.5}, InvalidTypeError),
        ({"capacity": True}, InvalidTypeError),
        ({"capacity": "1024"}, InvalidTypeError),
        ({"name": 3}, InvalidTypeError),
    ],
    ids=repr,
)
def test_bad_constructor_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        FlatPool(**kwargs)


def test_double_free(populated: FlatPool) -> None:
    s = populated.slices()[0]
    populated.free(s)
    before = state(populated)
    with pytest.raises(FreedSliceError) as info:
        populated.free(s)
    assert isinstance(info.value, SliceError) and isinstance(info.value, ValueError)
    assert state(populated) == before


def test_foreign_slice(populated: FlatPool) -> None:
    other = FlatPool(name="other")
    foreign = other.allocate(4, torch.float32)
    before, before_other = state(populated), state(other)
    with pytest.raises(ForeignSliceError, match="other"):
        populated.free(foreign)
    with pytest.raises(ForeignSliceError):
        populated.view(foreign)
    assert not populated.is_live(foreign)
    assert state(populated) == before
    assert state(other) == before_other
    assert foreign.is_live


def test_free_of_non_slice(populated: FlatPool) -> None:
    before = state(populated)
    for bad in [None, 0, torch.empty(4), populated.slices()[0].offset]:
        with pytest.raises(InvalidTypeError):
            populated.free(bad)  # type: ignore[arg-type]
    assert state(populated) == before


def test_use_of_freed_slice(populated: FlatPool) -> None:
    s = populated.slices()[1]
    populated.free(s)
    before = state(populated)
    assert not s.is_live
    with pytest.raises(FreedSliceError):
        s.tensor()
    with pytest.raises(FreedSliceError):
        s.bytes()
    with pytest.raises(FreedSliceError):
        populated.view(s)
    assert state(populated) == before


# -- introspection, threads ---------------------------------------------------------------------------
def test_repr_and_describe() -> None:
    pool = FlatPool(name="params", alignment=1)
    s = pool.allocate((2, 3), torch.bfloat16)
    pool.allocate((), torch.float32)
    assert "planned" in repr(pool) and "'params'" in repr(pool)
    text = pool.describe()
    assert "bfloat16" in text and "2x3" in text and "scalar" in text
    assert "capacity 16 B, used 16 B, free 0 B" in text
    assert "pool=" in repr(s) and "'params'" in repr(s)
    pool.materialize()
    assert "materialized" in repr(pool)


def test_concurrent_allocate_and_free() -> None:
    pool = FlatPool(capacity=64 * 1024, alignment=64)
    pool.materialize()
    errors: list[BaseException] = []
    kept: list[list[Slice]] = [[] for _ in range(4)]

    def worker(k: int) -> None:
        try:
            for i in range(200):
                s = pool.allocate(1 + (i * 7 + k) % 50, torch.float32)
                s.tensor().fill_(k)
                assert pool.used_bytes <= pool.capacity
                if i % 3:
                    pool.free(s)
                else:
                    kept[k].append(s)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    live = sorted(pool.slices(), key=lambda s: s.offset)
    assert len(live) == sum(map(len, kept))
    assert all(a.end <= b.offset for a, b in zip(live, live[1:]))
    for k, mine in enumerate(kept):
        for s in mine:
            assert bool((s.tensor() == k).all())
    assert pool.used_bytes + pool.free_bytes == pool.capacity
