"""Re-adoption: bring bound members that moved back into their slices.

Frameworks re-materialize on their own (``to_empty``, FSDP2's lazy init, ``load_state_dict``):
re-adoption copies current values into the existing slices and moves the objects back, with the
same journal, release proof and rollback as :func:`adopt`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _torch_compat as tc
from .._aliasing import check_no_wrapper, check_strided, extent_of
from .._warn import warn
from ..errors import InvalidRequestError, OrphanedSliceWarning
from .._registry import Binding, TensorRef, binding
from ..slices import Slice
from .._state import PoolState
from ._adopt import adopt, data_storage
from ._faults import checkpoint
from ._moves import Member, Move, copy_all, fresh_on, member_of, move
from ._release import check_placed, finish, held_outside_python, outside_by_key
from ._spec import AdoptedItem, AdoptionReport, AdoptSpec, OnPinned, check_policy
from ._transaction import Transaction, atomic, check_not_in_backward
from ._validity import Moved, moved, orphaned


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


def readopt(pool: PoolState, specs: Sequence[AdoptSpec] | None = None, *,
            on_pinned: OnPinned = "raise") -> AdoptionReport:
    """Bring every moved binding of ``pool`` back into its slice; with ``specs`` (each naming
    its ``slice``), adopt exactly those instead, replacing the slices' bindings."""
    check_policy(on_pinned)
    if specs is not None:
        specs = list(specs)
        for i, spec in enumerate(specs):
            if not isinstance(spec, AdoptSpec) or spec.slice is None:
                raise InvalidRequestError(
                    f"readopt() spec #{i} must be an AdoptSpec naming the slice to re-adopt into")
        if not specs:
            return AdoptionReport(())
        return adopt(pool, specs, on_pinned=on_pinned, into_bound=True)
    check_not_in_backward()

    def body(txn: Transaction) -> AdoptionReport:
        todo = moved(pool)
        if not todo:
            return AdoptionReport(())
        return _readopt(pool, todo, txn, on_pinned)

    report = atomic(body, pool)
    if not report.items:
        lost = orphaned(pool)
        if lost:
            warn(orphan_message(lost), OrphanedSliceWarning)
    return report


def _check(slc: Slice, b: Binding, obj: torch.Tensor, pool: PoolState) -> None:
    what = f"a tensor bound to slice {slc.slice_id}"
    check_strided(obj, what)
    check_no_wrapper(obj, what)
    with tc.no_torch_function():
        if tc.impl_is_meta(obj):
            raise InvalidRequestError(
                f"a tensor bound to slice {slc.slice_id} is on the meta device now; use "
                "materialize_into() to give it pool storage")
        size, dtype, device = tuple(tc.impl_size(obj)), tc.impl_dtype(obj), tc.impl_device(obj)
    if size != b.shape or dtype != b.dtype or device != pool.device:
        raise InvalidRequestError(
            f"a tensor bound to slice {slc.slice_id} changed to {size} {dtype} on {device} (was "
            f"{b.shape} {b.dtype} on {pool.device}); re-adoption keeps shape, dtype and device. "
            f"Call pool.disown(slice) and pool.free(slice), then adopt it anew")
    with tc.no_torch_function():
        extent = extent_of(obj)
    data_storage(obj, extent, what)  # a storage resized away would be read past its end


def _readopt(
    pool: PoolState, todo: list[Moved], txn: Transaction, on_pinned: OnPinned
) -> AdoptionReport:
    for slc, b, obj in todo:
        # Everything refused before this frame holds the pool's storage: a kept exception's
        # traceback keeps its locals, and would pin the pool against a later grow().
        _check(slc, b, obj, pool)
    feeds: dict[int, list[int]] = {}  # original storage key -> slice ids it fed
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    members: list[Member] = []
    for slc, b, obj in todo:
        with tc.no_torch_function():
            storage = tc.impl_untyped_storage(obj)
        if not tc.storage_has_data(storage):
            raise InvalidRequestError(f"a tensor bound to slice {slc.slice_id} has no storage")
        key = txn.track(storage, pool)
        feeds.setdefault(key, []).append(slc.slice_id)
        # The object's own bytes, by its TensorImpl: a subclass's detach() may answer for
        # another tensor (HyperParallel's DTensor detaches its local tensor) or raise.
        with tc.no_torch_function():
            base = tc.impl_base(obj)
            off_base = base is not None and tc.storage_address(base) == key
            del base
        members.append(member_of(obj, Move.OFF_BASE if off_base else Move.IN_PLACE, key))
        m = members[-1]
        src.append(fresh_on(storage, m.offset, m.size, m.stride, b.dtype))
        del storage
        view = pool.view_at(slc.offset + b.byte_offset, b.shape, b.dtype, b.stride)
        txn.save_bytes(view)  # a rollback must give the slice its old bytes back
        dst.append(view)
    checkpoint("copy")
    copy_all(dst, src)
    del dst, src

    held = held_outside_python([m.obj for m in members if m.how is Move.IN_PLACE],
                               [m.obj for m in members])
    outside = outside_by_key(((m.key, m.obj) for m in members if m.key is not None), held)
    target = pool.storage
    dests = [(target, (slc.offset + b.byte_offset) // b.dtype.itemsize, b.shape, b.stride)
             for slc, b, _ in todo]  # (its binding's geometry; its record keeps where it sat)
    move(txn.journal, members, dests)
    check_placed(pool, [(obj, slc.offset, slc.end, *dest[1:]) for (slc, _, obj), dest
                        in zip(todo, dests)])
    rebound = {id(b): binding(obj, b.byte_offset, b.shape, b.stride, b.dtype, b.holder(),
                              b.primary, type(b.ref) is TensorRef) for _, b, obj in todo}
    del members, dests

    def name(key: int) -> str:
        return f"the storage re-adopted into slice(s) {sorted(set(feeds[key]))}"

    def bind() -> None:
        for slice_id, bound in pool.registry.items():
            pool.registry.bind(slice_id, [rebound.get(id(b), b) for b in bound])
        todo.clear()  # the caller's list too: its (slice, binding, tensor) rows would pin

    nbytes = dict(txn.nbytes)
    expired, pins = finish(txn, name, outside, on_pinned, bind, lambda: [todo])
    items: list[AdoptedItem] = []
    for key, slice_ids in feeds.items():
        for sid in sorted(set(slice_ids)):
            live = pool.live_slice(sid)
            assert live is not None
            items.append(AdoptedItem(slice=live, original_nbytes=nbytes[key],
                                     released=expired[key], rebound=slice_ids.count(sid),
                                     pinned_by=pins.get(key, ())))
    return AdoptionReport(tuple(items))
