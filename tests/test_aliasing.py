"""Storage identity and byte-range checks: same_storage, overlaps, byte_range, check_no_aliasing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from flatpool import (
    AliasingError,
    ByteRange,
    FlatPool,
    InvalidTypeError,
    byte_range,
    check_no_aliasing,
    local_tensor,
    overlaps,
    same_storage,
    storage_of,
)

Wrap = Callable[[torch.Tensor], torch.Tensor]


# -- byte_range ------------------------------------------------------------------------------
def test_byte_range_contiguous_and_views() -> None:
    t = torch.zeros(4, 6, dtype=torch.float32)
    assert byte_range(t) == ByteRange(0, 96)
    assert byte_range(t[1]) == ByteRange(24, 48)
    assert byte_range(t[1:3, 2:4]) == ByteRange(32, 64)
    assert byte_range(t.t()) == ByteRange(0, 96)
    assert byte_range(t[:, 5]) == ByteRange(20, 96)
    assert byte_range(t[::2]) == ByteRange(0, 72)
    assert byte_range(t.view(-1).view(torch.uint8)[3:5]) == ByteRange(3, 5)
    assert byte_range(t[2:2]) == ByteRange(48, 48)
    assert byte_range(t[2:2]).nbytes == 0
    assert byte_range(torch.zeros(3).expand(5, 3)) == ByteRange(0, 12)
    assert byte_range(torch.tensor(1.0, dtype=torch.float64)) == ByteRange(0, 8)


def test_byte_range_helpers() -> None:
    r = ByteRange(10, 20)
    assert r.nbytes == 10
    assert r.contains(ByteRange(10, 20)) and r.contains(ByteRange(12, 15))
    assert not r.contains(ByteRange(5, 15))
    assert r.intersects(ByteRange(19, 30)) and not r.intersects(ByteRange(20, 30))
    assert not r.intersects(ByteRange(15, 15))  # an empty range shares no byte
    assert not ByteRange(15, 15).intersects(r)
    assert r.contains(ByteRange(15, 15))


def test_byte_range_of_pool_slice() -> None:
    pool = FlatPool(alignment=64)
    pool.allocate(3, torch.uint8)
    s = pool.allocate((2, 4), torch.float64)
    assert byte_range(s.tensor()) == ByteRange(s.offset, s.end)


# -- same_storage / overlaps ----------------------------------------------------------------------
def test_same_storage_and_overlaps() -> None:
    base = torch.zeros(10)
    a, b, c = base[:5], base[3:8], base[5:]
    assert same_storage(a, b) and same_storage(a, c)
    assert overlaps(a, b) and overlaps(b, c)
    assert not overlaps(a, c)  # adjacent, disjoint
    other = torch.zeros(10)
    assert not same_storage(base, other) and not overlaps(base, other)
    assert overlaps(base, base)


def test_same_address_is_not_same_storage() -> None:
    t = torch.arange(8.0)
    twin = torch.from_numpy(t.numpy())
    assert twin.data_ptr() == t.data_ptr()
    assert not same_storage(t, twin)
    assert not overlaps(t, twin)
    empty_a, empty_b = torch.empty(0), torch.empty(0)
    assert empty_a.data_ptr() == empty_b.data_ptr()
    assert not same_storage(empty_a, empty_b)


def test_zero_size_tensors_never_overlap() -> None:
    base = torch.zeros(10)
    assert same_storage(base, base[4:4])
    assert not overlaps(base, base[4:4])
    assert not overlaps(base[4:4], base[4:4])


def test_interleaved_strided_views_are_conservative() -> None:
    m = torch.zeros(4, 4)
    # Columns 0 and 1 touch disjoint elements but their extents intersect: reported as overlap.
    assert overlaps(m[:, 0], m[:, 1])


def test_pool_slices_share_storage_but_do_not_overlap() -> None:
    pool = FlatPool(alignment=1)
    a = pool.allocate(4, torch.float32)
    b = pool.allocate(4, torch.float32)
    ta, tb = a.tensor(), b.tensor()
    assert same_storage(ta, tb)
    assert not overlaps(ta, tb)
    assert overlaps(ta, pool.flat())
    assert same_storage(ta, pool.flat())


# -- through DTensor and storage-sharing wrappers -------------------------------------------------------
def test_helpers_see_through_dtensor(dtensor_from_local: Wrap) -> None:
    base = torch.zeros(8, 4)
    d1 = dtensor_from_local(base[:4])
    d2 = dtensor_from_local(base[2:6])
    d3 = dtensor_from_local(base[4:])
    assert local_tensor(d1) is d1._local_tensor
    assert storage_of(d1)._cdata == base.untyped_storage()._cdata
    assert byte_range(d2) == ByteRange(32, 96)
    assert same_storage(d1, d3) and same_storage(d1, base)
    assert overlaps(d1, d2) and not overlaps(d1, d3)
    assert overlaps(d2, base[5])
    assert not same_storage(d1, dtensor_from_local(torch.zeros(4, 4)))


def test_helpers_see_through_make_subclass_wrapper(hp_wrap: Wrap) -> None:
    base = torch.zeros(8, 4)
    w1, w2 = hp_wrap(base[:4]), hp_wrap(base[4:])
    assert local_tensor(w1) is w1._local_tensor  # type: ignore[attr-defined]
    assert byte_range(w2) == ByteRange(64, 128)
    assert same_storage(w1, w2) and not overlaps(w1, w2)
    assert overlaps(w1, base[3])
    assert not same_storage(w1, hp_wrap(torch.zeros(4)))


def test_nested_local_tensors(hp_wrap: Wrap, dtensor_from_local: Wrap) -> None:
    base = torch.zeros(6)
    inner = hp_wrap(base[2:4])
    outer = dtensor_from_local(inner)  # from_local re-views the wrapper: same storage
    assert storage_of(outer)._cdata == storage_of(inner)._cdata == storage_of(base)._cdata
    assert byte_range(outer) == ByteRange(8, 16)
    assert overlaps(outer, base[3:])


def test_non_tensors_rejected() -> None:
    for bad in [None, 3, [1.0], "t"]:
        with pytest.raises(InvalidTypeError):
            byte_range(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError):
            same_storage(torch.zeros(1), bad)  # type: ignore[arg-type]


# -- check_no_aliasing ------------------------------------------------------------------------------------
def test_disjoint_slices_of_one_storage_pass() -> None:
    pool = FlatPool(alignment=1)
    slices = [pool.allocate((3, 2), torch.float32) for _ in range(5)]
    views = {f"s{i}": s.tensor() for i, s in enumerate(slices)}
    check_no_aliasing(views)
    check_no_aliasing(list(views.values()))
    check_no_aliasing(v for v in views.values())
    check_no_aliasing({})
    check_no_aliasing([])
    base = torch.zeros(10)
    check_no_aliasing([base[:3], base[3:7], base[7:], base[5:5], torch.zeros(10)])


def test_every_offending_pair_is_listed_with_names() -> None:
    base = torch.zeros(20)
    tensors = {
        "a": base[0:8],
        "b": base[4:12],  # overlaps a and c
        "c": base[10:14],
        "d": base[14:20],  # disjoint from all
        "e": torch.zeros(3),
        "f": base[0:2],  # inside a
    }
    with pytest.raises(AliasingError) as info:
        check_no_aliasing(tensors)
    err = info.value
    assert isinstance(err, ValueError)
    assert {frozenset(p) for p in err.offenders} == {
        frozenset({"a", "b"}),
        frozenset({"b", "c"}),
        frozenset({"a", "f"}),
    }
    assert len(err.offenders) == 3
    msg = str(err)
    assert "3 pair(s)" in msg
    for a, b in err.offenders:
        assert f"{a} & {b}" in msg


def test_list_input_names_by_index() -> None:
    base = torch.zeros(10)
    with pytest.raises(AliasingError) as info:
        check_no_aliasing([torch.zeros(2), base[:6], base[5:], base[:1]])
    assert {frozenset(p) for p in info.value.offenders} == {
        frozenset({"[1]", "[2]"}),
        frozenset({"[1]", "[3]"}),
    }
    assert "[1] & " in str(info.value) or " & [1]" in str(info.value)


def test_same_tensor_twice_aliases() -> None:
    t = torch.zeros(4)
    with pytest.raises(AliasingError):
        check_no_aliasing([t, t])


def test_pairs_in_several_storages() -> None:
    x, y = torch.zeros(8), torch.zeros(8)
    with pytest.raises(AliasingError) as info:
        check_no_aliasing({"x1": x[:5], "x2": x[4:], "y1": y, "y2": y[7:]})
    assert {frozenset(p) for p in info.value.offenders} == {
        frozenset({"x1", "x2"}),
        frozenset({"y1", "y2"}),
    }


def test_check_no_aliasing_through_dtensor_and_wrapper(
    dtensor_from_local: Wrap, hp_wrap: Wrap
) -> None:
    pool = FlatPool(alignment=1)
    a = pool.allocate((4, 2), torch.float32)
    b = pool.allocate((4, 2), torch.float32)
    ok = {"dt": dtensor_from_local(a.tensor()), "hp": hp_wrap(b.tensor())}
    check_no_aliasing(ok)
    bad = dict(ok, raw=a.tensor()[1], flat=pool.flat()[b.offset // 4 + 7 :])
    with pytest.raises(AliasingError) as info:
        check_no_aliasing(bad)
    assert {frozenset(p) for p in info.value.offenders} == {
        frozenset({"dt", "raw"}),
        frozenset({"hp", "flat"}),
    }


def test_check_no_aliasing_bad_inputs() -> None:
    with pytest.raises(InvalidTypeError, match="single tensor"):
        check_no_aliasing(torch.zeros(4, 4))
    with pytest.raises(InvalidTypeError, match=r"\[1\]"):
        check_no_aliasing([torch.zeros(1), "not a tensor"])  # type: ignore[list-item]
    with pytest.raises(InvalidTypeError, match="w"):
        check_no_aliasing({"w": 3.0})  # type: ignore[dict-item]
