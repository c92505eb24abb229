"""Materialize meta tensors and parameters directly into pool slices.

Each meta target's TensorImpl is swapped for one on its slice, so the Python object (and every
reference to it) stays and ``reset_parameters()`` initializes in place; no other storage is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Union, cast

import torch

from .. import _torch_compat as tc
from .._aliasing import check_strided
from ..errors import AdoptionError, InvalidRequestError, InvalidTypeError
from .._holder import Holder
from .._registry import binding
from ..slices import Slice
from .._requests import check_dtype
from .._state import PoolState
from ._faults import checkpoint
from ._moves import Dest, Member, Move, SlotSet, fresh_on, move
from ._release import check_placed
from ._transaction import Transaction, atomic

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
            f"materialize_into() takes meta tensors; target #{i} is on {device}: use adopt()")
    if not _is_dtensor(t) and tc.is_wrapper_subclass(t):
        raise InvalidTypeError(
            f"target #{i} is a {type(t).__name__}: a wrapper subclass without a _local_tensor "
            "cannot be given storage; materialize the tensors it wraps")
    check_strided(local, f"target #{i}")
    with tc.no_torch_function():
        check_dtype(tc.impl_dtype(local), f"target #{i}")  # what allocate() and adopt() refuse
    return local


def materialize_into(
    pool: PoolState, targets: MetaTargets, slices: Sequence[Slice] | None = None
) -> tuple[Slice, ...]:
    """Give meta tensors/parameters (or DTensors with meta locals) uninitialized pool storage,
    identity kept, all-or-nothing; ``slices`` may name pre-planned slices, one per target."""
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
                "or C++ hook): materialize before running anything on it")
    return atomic(lambda txn: _materialize(pool, txn, items, locals_, slices), pool)


def _materialize(pool: PoolState, txn: Transaction, items: list[torch.Tensor],
                 locals_: list[torch.Tensor], slices: Sequence[Slice] | None) -> tuple[Slice, ...]:
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
                    f"{slc.dtype}")
            if pool.registry.holds(slc.slice_id):
                raise InvalidRequestError(f"slice {slc.slice_id} already backs tensors")
        else:
            checkpoint("allocate")
            slc = pool.allocate_checked(size, dtype)
        planned.append(slc)
    storage = pool.storage
    slots: list[SlotSet] = []
    locals_new: list[torch.Tensor] = []
    members: list[Member] = []
    dests: list[Dest] = []
    placed = []
    for t, local, slc, (size, stride, dtype) in zip(items, locals_, planned, geometry):
        grad = bool(t.requires_grad)
        offset = slc.offset // dtype.itemsize
        new_local = fresh_on(storage, offset, size, stride, dtype, grad and not _is_dtensor(t))
        fresh = new_local
        if _is_dtensor(t):
            from torch.distributed.tensor import DTensor

            make = cast(Callable[..., torch.Tensor], DTensor)
            fresh = make(new_local, getattr(t, "_spec"), requires_grad=grad)
            slots.append(SlotSet(t, "_local_tensor", local))
            locals_new.append(new_local)
        members.append(Member(t, Move.NEW_IMPL, None, offset, size, stride, dtype, -1,
                              fresh=fresh))
        dests.append((storage, offset, size, stride))
        # (a plain target is checked by itself, once its new impl is swapped in)
        placed.append((new_local if _is_dtensor(t) else t, slc.offset, slc.end, offset, size,
                       stride))
    move(txn.journal, members, dests)
    txn.journal.extend(slots)  # write-ahead
    for rec, new_local in zip(slots, locals_new):
        rec.obj._local_tensor = new_local
    check_placed(pool, placed)
    for t, slc, (size, stride, dtype) in zip(items, planned, geometry):
        if _is_dtensor(t):
            inner = getattr(t, "_local_tensor")
            b = binding(inner, 0, size, stride, dtype, Holder(t, "_local_tensor"), True)
        else:
            b = binding(t, 0, size, stride, dtype, None, True)
        pool.registry.bind(slc.slice_id, [b])
    txn.commit()
    return tuple(planned)
