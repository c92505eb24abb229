"""Validity checks and re-adoption: find bound tensors that left the pool, bring them back.

Frameworks re-materialize on their own (``to_empty``, FSDP2's lazy init, ``load_state_dict``
with ``assign=True``): a bound object may be re-pointed at a new storage, or its holder may get
a new object. Re-adoption copies the current values into the binding's place in its existing
slice and rebinds, with the same release proof and rollback as :func:`adopt`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..aliasing import storage_key
from ..errors import InvalidRequestError, PinnedStorageError
from ..slices import Slice
from .adopt import _check_not_in_backward, _pinned_message, adopt
from .faults import checkpoint
from .pins import name_pins
from .rebind import autograd_base, own_storage
from .registry import Binding
from .spec import AdoptedItem, AdoptionReport, AdoptSpec, OnPinned
from .transaction import Transaction

if TYPE_CHECKING:
    from ..pool import FlatPool


def is_in_place(pool_key: int, slc: Slice, binding: Binding, obj: torch.Tensor | None) -> bool:
    """True when ``obj`` sits exactly where ``binding`` says inside ``slc``."""
    if obj is None:
        return True  # the object is gone: nothing to keep valid
    s = own_storage(obj)
    if s is None or int(s._cdata) != pool_key:
        return False
    g = binding.geometry
    with torch._C.DisableTorchFunctionSubclass():
        return (
            int(obj.storage_offset()) * obj.element_size() == slc.offset + g.byte_offset
            and tuple(obj.shape) == g.shape
            and tuple(obj.stride()) == g.stride
            and obj.dtype == g.dtype
        )


def moved(pool: FlatPool) -> list[tuple[Slice, Binding, torch.Tensor]]:
    """Every bound tensor object that no longer sits at its place in the pool."""
    if pool._registry is None or pool._buffer is None:
        return []
    key = storage_key(pool._buffer.untyped_storage())
    out: list[tuple[Slice, Binding, torch.Tensor]] = []
    for slice_id, bindings in pool.registry.items():
        slc = pool._live.get(slice_id)
        if slc is None:
            continue
        for b in bindings:
            obj = b.current()
            if obj is not None and not is_in_place(key, slc, b, obj):
                out.append((slc, b, obj))
    return out


def readopt(
    pool: FlatPool,
    specs: Sequence[AdoptSpec] | None = None,
    *,
    on_pinned: OnPinned = "raise",
) -> AdoptionReport:
    """Bring every moved binding of ``pool`` back into its slice; a no-op when nothing moved.

    With ``specs`` (each naming its ``slice``), adopt exactly those into their existing slices
    instead, replacing the slices' bindings: for callers that know the current holders better
    than the registry, e.g. after ``load_state_dict(assign=True)`` installed new Parameter
    objects that no recorded holder points to.
    """
    if on_pinned not in ("raise", "warn", "force"):
        raise InvalidRequestError(f"on_pinned must be 'raise', 'warn' or 'force', got {on_pinned!r}")
    if specs is not None:
        specs = list(specs)
        for i, spec in enumerate(specs):
            if not isinstance(spec, AdoptSpec) or spec.slice is None:
                raise InvalidRequestError(
                    f"readopt() spec #{i} must be an AdoptSpec naming the slice to re-adopt into"
                )
        if not specs:
            return AdoptionReport(())
        return adopt(pool, specs, on_pinned=on_pinned, into_bound=True)
    _check_not_in_backward()
    with pool.lock:
        todo = moved(pool)
        if not todo:
            return AdoptionReport(())
        txn = Transaction(pool)
        try:
            return _readopt(pool, todo, txn, on_pinned)
        except BaseException:
            txn.rollback()
            raise


def _readopt(
    pool: FlatPool,
    todo: list[tuple[Slice, Binding, torch.Tensor]],
    txn: Transaction,
    on_pinned: OnPinned,
) -> AdoptionReport:
    target = pool.storage
    keys: dict[int, list[int]] = {}  # original storage key -> slice ids it fed
    for slc, b, obj in todo:
        g = b.geometry
        with torch._C.DisableTorchFunctionSubclass():
            if obj.is_meta:
                raise InvalidRequestError(
                    f"a tensor bound to slice {slc.slice_id} is on the meta device now; use "
                    "materialize_into() to give it pool storage"
                )
            if tuple(obj.shape) != g.shape or obj.dtype != g.dtype or obj.device != pool.device:
                raise InvalidRequestError(
                    f"a tensor bound to slice {slc.slice_id} changed to {tuple(obj.shape)} "
                    f"{obj.dtype} on {obj.device} (was {g.shape} {g.dtype} on {pool.device}); "
                    "re-adoption keeps shape, dtype and device: free the slice and adopt anew"
                )
        storage = own_storage(obj)
        if storage is None:
            raise InvalidRequestError(f"a tensor bound to slice {slc.slice_id} has no storage")
        key = txn.track(storage)
        del storage
        keys.setdefault(key, []).append(slc.slice_id)
        checkpoint("copy")
        dst = pool.view_at(slc.offset + g.byte_offset, g.shape, g.dtype, g.stride)
        txn.save_bytes(dst)  # a rollback must give the slice its old bytes back
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            dst.copy_(obj)
        del dst
    replaced: dict[int, Binding] = {}
    for slc, b, obj in todo:
        key = int(own_storage(obj)._cdata)  # type: ignore[union-attr]
        holder = b.holder()
        new_offset = slc.offset + b.geometry.byte_offset
        if holder is not None and autograd_base(obj) is not None:
            new = txn.move_by_holder(holder, obj, key, target, new_offset)
            replaced[id(b)] = Binding.make(new, b.geometry, holder, b.primary)
        else:
            txn.move_in_place(obj, key, target, new_offset)
            replaced[id(b)] = Binding.make(obj, b.geometry, holder, b.primary)
    todo.clear()  # the caller's list too: its (slice, binding, tensor) rows would pin
    del target, obj
    checkpoint("release")
    pinned: dict[str, tuple[str, ...]] = {}
    for key, slice_ids in keys.items():
        if txn.unaccounted_users(key):
            label = f"the storage re-adopted into slice(s) {sorted(set(slice_ids))}"
            pinned[label] = name_pins(txn.storages[key], txn.own_ids())
    if pinned and on_pinned == "raise":
        raise PinnedStorageError(_pinned_message(pinned), pinned)
    if pinned:
        warnings.warn(_pinned_message(pinned, kept=True), stacklevel=3)
    for slice_id, bindings in pool.registry.items():
        pool.registry.bind(pool._live[slice_id], [replaced.get(id(b), b) for b in bindings])
    nbytes = dict(txn.nbytes)
    expired = txn.commit_release()
    items: list[AdoptedItem] = []
    for key, slice_ids in keys.items():
        for sid in sorted(set(slice_ids)):
            items.append(
                AdoptedItem(
                    slice=pool._live[sid],
                    original_nbytes=nbytes[key],
                    released=expired[key],
                    rebound=slice_ids.count(sid),
                )
            )
    return AdoptionReport(tuple(items))
