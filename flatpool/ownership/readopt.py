"""Validity checks and re-adoption: find bound tensors that left the pool, bring them back.

Frameworks re-materialize on their own (``to_empty``, FSDP2's lazy init, ``load_state_dict``
with ``assign=True``): a bound object may be re-pointed at a new storage, or its holder may get
a new object. Re-adoption copies the current values into the binding's place in its existing
slice and moves the object back, with the same journal, invariant check, release proof and
rollback as :func:`adopt`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import torch_compat as tc
from ..aliasing import check_no_wrapper, check_strided, extent_of
from .._warn import warn
from ..errors import InvalidRequestError, OrphanedSliceWarning
from ..registry import ParamRef, Record, current, make_record, record_holder
from ..slices import Slice
from ..state import PoolState
from .adopt import adopt, check_not_in_backward, check_policy
from .copying import copy_all
from .faults import checkpoint
from .moves import (
    ImplSwap, SetMove, counter_group, fresh_like, fresh_on, geometry_of, place_many, swap_many,
)
from .proof import held_outside_python
from .settle import check_placed, keep_unreleased, outside_by_key, release, settle_pins
from .spec import AdoptedItem, AdoptionReport, AdoptSpec, OnPinned
from .transaction import Transaction, atomic
from .validate import data_storage
from .validity import Moved, moved, orphaned

def orphan_message(slices: Sequence[Slice]) -> str:
    ids = ", ".join(str(s.slice_id) for s in slices)
    return (
        f"the parameters adopted into slice(s) {ids} are gone: their module replaced them "
        "(load_state_dict(assign=True)?) with objects the pool cannot see, so nothing trains on "
        "those bytes. Re-adopt the module's current parameters into them with "
        "pool.readopt([AdoptSpec(p, slice=s), ...]), or adopt with "
        "AdoptSpec(p, holders=[Holder(module, name)]) so that readopt() finds a replacement; "
        "or free the slices."
    )


def readopt(
    pool: PoolState,
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
    check_policy(on_pinned)
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
    check_not_in_backward()

    def body(txn: Transaction) -> AdoptionReport:
        todo = moved(pool)
        if not todo:
            return AdoptionReport(())
        return _readopt(pool, todo, txn, on_pinned)

    report = atomic(pool, body)
    if not report.items:
        lost = orphaned(pool)
        if lost:
            warn(orphan_message(lost), OrphanedSliceWarning)
    return report


def _check(slc: Slice, rec: Record, obj: torch.Tensor, pool: PoolState) -> None:
    what = f"a tensor bound to slice {slc.slice_id}"
    check_strided(obj, what)
    check_no_wrapper(obj, what)
    with tc.no_torch_function():
        if tc.impl_is_meta(obj):
            raise InvalidRequestError(
                f"a tensor bound to slice {slc.slice_id} is on the meta device now; use "
                "materialize_into() to give it pool storage"
            )
        size, dtype, device = tuple(tc.impl_size(obj)), tc.impl_dtype(obj), tc.impl_device(obj)
    if size != rec[2] or dtype != rec[4] or device != pool.device:
        raise InvalidRequestError(
            f"a tensor bound to slice {slc.slice_id} changed to {size} {dtype} on {device} (was "
            f"{rec[2]} {rec[4]} on {pool.device}); re-adoption keeps shape, dtype and device. "
            f"Call pool.disown(slice) and pool.free(slice), then adopt it anew"
        )
    with tc.no_torch_function():
        extent = extent_of(obj)
    data_storage(obj, extent, what)  # a storage resized away would be read past its end


def _readopt(
    pool: PoolState, todo: list[Moved], txn: Transaction, on_pinned: OnPinned
) -> AdoptionReport:
    for slc, rec, obj in todo:
        # Everything refused before this frame holds the pool's storage: a kept exception's
        # traceback keeps its locals, and would pin the pool against a later grow().
        _check(slc, rec, obj, pool)
    target = pool.storage
    feeds: dict[int, list[int]] = {}  # original storage key -> slice ids it fed
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for slc, rec, obj in todo:
        with tc.no_torch_function():
            storage = tc.impl_untyped_storage(obj)
        if not tc.storage_has_data(storage):
            raise InvalidRequestError(f"a tensor bound to slice {slc.slice_id} has no storage")
        # The object's own bytes, by its TensorImpl: a subclass's detach() may answer for
        # another tensor (HyperParallel's DTensor detaches its local tensor) or raise.
        with tc.no_torch_function():
            src.append(fresh_on(storage, *geometry_of(obj), rec[4]))
        key = txn.track(storage)
        del storage
        feeds.setdefault(key, []).append(slc.slice_id)
        view = pool.view_at(slc.offset + rec[1], rec[2], rec[4], rec[3])
        txn.save_bytes(view)  # a rollback must give the slice its old bytes back
        dst.append(view)
    checkpoint("copy")
    copy_all(dst, src)
    del dst, src

    records: list[SetMove | ImplSwap] = []
    kinds = []
    with tc.no_torch_function():
        for _, _, obj in todo:
            base = tc.impl_base(obj)
            kinds.append(base is not None and tc.storage_address(base) == tc.storage_address(obj))
            del base
    held = held_outside_python([o for (_, _, o), swap in zip(todo, kinds) if not swap],
                               [o for _, _, o in todo])
    outside = outside_by_key(((tc.storage_address(o), o) for _, _, o in todo), held)
    places = []
    swaps = []
    placed = []
    with tc.no_torch_function():
        # Aliases keep sharing a version counter (see adopt's _move): a swapped view's new impl
        # takes the counter of the first member of its group.
        counters: dict[int, torch.Tensor] = {}
        for (_, _, obj), swap in zip(todo, kinds):
            if not swap:
                counters.setdefault(counter_group(obj), obj)
        for (slc, rec, obj), swap in zip(todo, kinds):
            key = tc.storage_address(obj)
            item = rec[4].itemsize
            offset = (slc.offset + rec[1]) // item
            version = tc.impl_version(obj)
            old = (tc.impl_storage_offset(obj), tuple(tc.impl_size(obj)), tuple(tc.impl_stride(obj)))
            if swap:
                grad = tc.impl_requires_grad(obj) and tc.impl_is_leaf(obj)
                group = counter_group(obj)
                fresh = fresh_like(obj, target, offset, rec[2], rec[3], rec[4], grad,
                                   counters.get(group))
                counters.setdefault(group, fresh)
                records.append(ImplSwap(obj, fresh, key, version, old, rec[4]))
                swaps.append((obj, fresh))
                del fresh  # after the swap it carries the old impl: only the journal may hold it
            else:
                records.append(SetMove(obj, key, *old, version))
                places.append((obj, target, offset, rec[2], rec[3]))
            placed.append((obj, slc.offset, slc.end))
        del counters  # it holds swapped-in impls, which carry the old ones after the swap
    checkpoint("rebind")
    txn.journal.extend(records)
    place_many(places)
    swap_many(swaps)
    tc.set_versions([r.obj for r in records], [r.version for r in records])
    check_placed(pool, placed)
    new_records = {id(rec): make_record(obj, rec[1], rec[2], rec[3], rec[4], record_holder(rec),
                                        rec[8]) for _, rec, obj in todo}
    del records, places, swaps, placed
    keys = list(feeds)

    def name(key: int) -> str:
        return f"the storage re-adopted into slice(s) {sorted(set(feeds[key]))}"

    pins = settle_pins(txn, keys, name, outside, on_pinned, lambda: [todo])
    keep_unreleased(pool, txn, name, pins, outside)
    for slice_id, recs in pool.registry.items():
        pool.registry.bind(slice_id, [new_records.get(id(r), r) for r in recs])
    todo.clear()  # the caller's list too: its (slice, record, tensor) rows would pin
    nbytes = dict(txn.nbytes)
    expired, _ = release(txn, name, pins, on_pinned)
    items: list[AdoptedItem] = []
    for key, slice_ids in feeds.items():
        for sid in sorted(set(slice_ids)):
            live = pool.live_slice(sid)
            assert live is not None
            items.append(AdoptedItem(slice=live, original_nbytes=nbytes[key],
                                     released=expired[key], rebound=slice_ids.count(sid),
                                     pinned_by=pins.get(key, ())))
    return AdoptionReport(tuple(items))


__all__ = ["readopt"]
