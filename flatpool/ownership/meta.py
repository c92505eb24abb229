"""Materialize meta tensors and parameters directly into pool slices.

Each meta target's TensorImpl is exchanged for one on its slice (an impl swap, see
:mod:`flatpool.ownership.moves`), so the Python object stays: the module, an optimizer built
later and any wrapper keep their references, and a following ``reset_parameters()``
initializes in place. No storage besides the pool is ever allocated. A torch DTensor parameter
gets a pool-backed local tensor and a wrapper impl to match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Union, cast

import torch

from .. import torch_compat as tc
from ..aliasing import check_strided
from ..errors import AdoptionError, InvalidRequestError, InvalidTypeError
from ..holder import Holder
from ..registry import make_record
from ..slices import Slice
from ..requests import check_dtype
from ..state import PoolState
from .faults import checkpoint
from .moves import ImplSwap, SlotSet, fresh_on, swap_many
from .settle import check_placed
from .transaction import Transaction, atomic

MetaTargets = Union[torch.Tensor, Sequence[torch.Tensor]]


def _is_dtensor(t: torch.Tensor) -> bool:
    return (tc.is_wrapper_subclass(t) and isinstance(getattr(t, "_local_tensor", None), torch.Tensor)
            and hasattr(t, "_spec"))


def _meta_local(t: torch.Tensor, i: int) -> torch.Tensor:
    local = getattr(t, "_local_tensor") if _is_dtensor(t) else t
    with tc.no_torch_function():
        meta = tc.impl_is_meta(local)
        device = tc.impl_device(local)
    if not meta:
        raise InvalidRequestError(
            f"materialize_into() takes meta tensors; target #{i} is on {device}: use adopt()"
        )
    if not _is_dtensor(t) and tc.is_wrapper_subclass(t):
        raise InvalidTypeError(
            f"target #{i} is a {type(t).__name__}: a wrapper subclass without a _local_tensor "
            "cannot be given storage; materialize the tensors it wraps"
        )
    check_strided(local, f"target #{i}")
    with tc.no_torch_function():
        check_dtype(tc.impl_dtype(local), f"target #{i}")  # what allocate() and adopt() refuse
    return local


def materialize_into(
    pool: PoolState, targets: MetaTargets, slices: Sequence[Slice] | None = None
) -> tuple[Slice, ...]:
    """Give meta tensors/parameters (or DTensor params with meta local tensors) pool storage.

    Each target keeps its Python identity; its contents are uninitialized afterwards (like
    ``to_empty``). ``slices`` may name pre-planned slices (one per target, matching shape and
    dtype); otherwise they are allocated. All-or-nothing.
    """
    items = [targets] if isinstance(targets, torch.Tensor) else list(targets)
    for t in items:
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"materialize_into() takes tensors, got {type(t).__name__}")
    if slices is not None and len(slices) != len(items):
        raise InvalidRequestError(f"{len(items)} targets but {len(slices)} slices")
    if len({id(t) for t in items}) != len(items):
        raise InvalidRequestError("a target was given twice")
    locals_ = [_meta_local(t, i) for i, t in enumerate(items)]
    for i, t in enumerate(items):
        # An autograd node holding the impl (a meta forward already ran) would keep
        # accumulating into the old impl after the swap.
        if tc.tensor_impl_users(t) > 1:
            raise AdoptionError(
                f"target #{i} ({type(t).__name__}) is held outside Python (an autograd graph "
                "or C++ hook): materialize before running anything on it"
            )
    return atomic(pool, lambda txn: _materialize(pool, txn, items, locals_, slices))


def _materialize(
    pool: PoolState, txn: Transaction, items: list[torch.Tensor], locals_: list[torch.Tensor],
    slices: Sequence[Slice] | None,
) -> tuple[Slice, ...]:
    planned: list[Slice] = []
    geometry = []
    with tc.no_torch_function():
        for local in locals_:
            geometry.append((tuple(tc.impl_size(local)), tuple(tc.impl_stride(local)),
                             tc.impl_dtype(local)))
    for i, (size, _, dtype) in enumerate(geometry):
        if slices is not None:
            slc = slices[i]
            pool.check_live(slc)
            if slc.shape != size or slc.dtype != dtype:
                raise InvalidRequestError(
                    f"target #{i} is {size} {dtype} but slice {slc.slice_id} is {slc.shape} "
                    f"{slc.dtype}"
                )
            if pool.registry.holds(slc.slice_id):
                raise InvalidRequestError(f"slice {slc.slice_id} already backs tensors")
        else:
            checkpoint("allocate")
            slc = pool.allocate_checked(size, dtype)
        planned.append(slc)
    storage = pool.storage
    records: list[ImplSwap | SlotSet] = []
    swaps: list[tuple[torch.Tensor, torch.Tensor]] = []
    slots: list[tuple[torch.Tensor, torch.Tensor]] = []
    placed = []
    for t, local, slc, (size, stride, dtype) in zip(items, locals_, planned, geometry):
        grad = bool(t.requires_grad)
        new_local = fresh_on(storage, slc.offset // dtype.itemsize, size, stride, dtype,
                             grad and not _is_dtensor(t))
        if _is_dtensor(t):
            from torch.distributed.tensor import DTensor

            make = cast(Callable[..., torch.Tensor], DTensor)
            wrapper = make(new_local, getattr(t, "_spec"), requires_grad=grad)
            records.append(SlotSet(t, "_local_tensor", local))
            slots.append((t, new_local))
            records.append(ImplSwap(t, wrapper, None, -1))
            swaps.append((t, wrapper))
            placed.append((new_local, slc.offset, slc.end))
        else:
            records.append(ImplSwap(t, new_local, None, -1))
            swaps.append((t, new_local))
            placed.append((t, slc.offset, slc.end))
    checkpoint("rebind")
    txn.journal.extend(records)  # write-ahead
    for t, new_local in slots:
        t._local_tensor = new_local  # type: ignore[attr-defined]
    try:
        swap_many(swaps)
    except RuntimeError as exc:
        raise AdoptionError(f"cannot give a meta tensor pool storage in place: {exc}") from exc
    check_placed(pool, placed)
    for t, slc, (size, stride, dtype) in zip(items, planned, geometry):
        if _is_dtensor(t):
            inner = getattr(t, "_local_tensor")
            rec = make_record(inner, 0, size, stride, dtype, Holder(t, "_local_tensor"), True)
        else:
            rec = make_record(t, 0, size, stride, dtype, None, True)
        pool.registry.bind(slc.slice_id, [rec])
    txn.commit()
    return tuple(planned)


__all__ = ["MetaTargets", "materialize_into"]
