"""One dtype rule: every entry point accepts or refuses the same dtypes, with the same error.

For each dtype torch defines, ``allocate``, ``allocate_like``, ``flat``, ``adopt`` and
``materialize_into`` either all work or all raise :class:`InvalidTypeError`; for the accepted
ones, ``readopt`` brings a re-materialized tensor back with its bytes intact. (``adopt`` used to
accept quantized tensors that ``allocate`` refused, and to fail with a raw ``NotImplementedError``
on the sub-byte shell dtypes.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from flatpool import FlatPool, FlatPoolError, InvalidTypeError

DTYPES = sorted(
    {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}, key=str
)
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _tensor(dtype: torch.dtype) -> torch.Tensor:
    """Four elements of ``dtype`` with known bytes (quantized ones through quantize_per_tensor)."""
    if dtype in QUANTIZED:
        with warnings.catch_warnings():  # quantized creation is deprecated in torch 2.13
            warnings.simplefilter("ignore")
            return torch.quantize_per_tensor(torch.arange(4.0), 0.5, 0, dtype)
    t = torch.empty(4, dtype=dtype)
    pattern = torch.arange(4 * dtype.itemsize, dtype=torch.uint8)
    if dtype == torch.bool:
        pattern %= 2  # other bytes are not bools (a copy normalizes them)
    t.untyped_storage().copy_(pattern.untyped_storage())
    return t


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.untyped_storage())[t.storage_offset() * t.element_size():][:4 * t.element_size()]


ENTRY_POINTS: dict[str, Callable[[torch.dtype], object]] = {
    "allocate": lambda dt: FlatPool(alignment=64).allocate(4, dt),
    "allocate_like": lambda dt: FlatPool(alignment=64).allocate_like(
        torch.empty(4, dtype=dt, device="meta")),
    "flat": lambda dt: FlatPool(alignment=64, capacity=64).flat(dt),
    "adopt": lambda dt: FlatPool(alignment=64).adopt(_tensor(dt)),
    "materialize_into": lambda dt: FlatPool(alignment=64).materialize_into(
        torch.empty(4, dtype=dt, device="meta")),
}


def _outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except InvalidTypeError:
        return "InvalidTypeError"
    except FlatPoolError as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # an untyped error is a failure of its own
        return f"raw {type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_entry_point_agrees_on_every_dtype() -> None:
    table = {dt: {name: _outcome(lambda: f(dt)) for name, f in ENTRY_POINTS.items()}
             for dt in DTYPES}
    disagree = {str(dt): row for dt, row in table.items() if len(set(row.values())) != 1}
    assert not disagree, disagree
    refused = {dt for dt, row in table.items() if row["adopt"] == "InvalidTypeError"}
    assert QUANTIZED <= refused and torch.uint4 in refused and torch.int1 in refused
    assert {torch.float32, torch.bfloat16, torch.bool, torch.complex64,
            torch.float8_e4m3fn, torch.bits8}.isdisjoint(refused)
    assert all(row["adopt"] == "ok" for dt, row in table.items() if dt not in refused)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", [dt for dt in DTYPES if dt not in QUANTIZED
                                   and not str(dt).startswith(("torch.int", "torch.uint"))
                                   or dt in (torch.int8, torch.int16, torch.int32, torch.int64,
                                             torch.uint8, torch.uint16, torch.uint32,
                                             torch.uint64)], ids=str)
def test_accepted_dtypes_round_trip_through_adopt_and_readopt(dtype: torch.dtype) -> None:
    pool = FlatPool(alignment=64)
    t = _tensor(dtype)
    want = _bytes(t)
    pool.adopt(t)
    assert pool.owns(t) and _bytes(t) == want
    fresh = torch.empty_like(t)  # a framework re-materialized it (copied as bytes: torch 2.8
    fresh.view(torch.uint8).copy_(t.view(torch.uint8))  # has no float4 copy kernel)
    t.data = fresh
    del fresh
    assert not pool.is_valid()
    pool.readopt()
    assert pool.is_valid() and pool.owns(t) and _bytes(t) == want
