"""``grow`` and ``compact``: move a pool to new storage and rebind everything it adopted.

The old storage must die like any adopted original: a tensor the pool does not know about
(``pool.flat()`` or ``slice.tensor()`` kept from before) pins it, and the move rolls back with
the holders named. Handles stay valid across ``grow`` (offsets do not change); ``compact``
returns new handles, and the old ones raise :class:`FreedSliceError`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..allocator import RangeAllocator, align_up
from ..errors import InvalidRequestError, InvalidTypeError, PinnedStorageError
from ..pool import MAX_BYTES, empty_storage_tensor
from ..slices import Slice
from .adopt import _check_not_in_backward, _pinned_message
from .faults import checkpoint
from .pins import name_pins
from .readopt import is_in_place
from .registry import Binding
from .spec import OnPinned
from .transaction import Transaction, byte_view

if TYPE_CHECKING:
    from ..pool import FlatPool


def grow(pool: FlatPool, capacity: int, *, on_pinned: OnPinned = "raise") -> None:
    """Give ``pool`` a capacity of ``capacity`` bytes (>= current), keeping every offset."""
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise InvalidTypeError(f"capacity must be an int, got {capacity!r}")
    with pool.lock:
        if capacity > MAX_BYTES:
            raise InvalidRequestError(f"grow() to {capacity} bytes exceeds {MAX_BYTES} bytes")
        if capacity < pool.capacity:
            raise InvalidRequestError(
                f"grow() cannot shrink pool {pool.name!r} from {pool.capacity} to {capacity} "
                "bytes; use compact() to drop free space"
            )
        layout = {s.slice_id: s.offset for s in pool.slices()}
        _relocate(pool, capacity, layout, on_pinned)


def compact(pool: FlatPool, *, on_pinned: OnPinned = "raise") -> dict[int, Slice]:
    """Pack live slices to the front (in order) and shrink to fit; returns old id -> new slice."""
    with pool.lock:
        layout: dict[int, int] = {}
        pos = 0
        for s in pool.slices():
            start = align_up(pos, pool.slice_alignment(s.dtype))
            layout[s.slice_id] = start
            pos = start + s.nbytes
        capacity = align_up(pos, pool.alignment)
        return _relocate(pool, capacity, layout, on_pinned)


def _relocate(
    pool: FlatPool, capacity: int, layout: dict[int, int], on_pinned: OnPinned
) -> dict[int, Slice]:
    if on_pinned not in ("raise", "warn", "force"):
        raise InvalidRequestError(f"on_pinned must be 'raise', 'warn' or 'force', got {on_pinned!r}")
    _check_not_in_backward()
    old_slices = pool.slices()
    keep_ids = all(layout[s.slice_id] == s.offset for s in old_slices)
    txn = Transaction(pool)
    try:
        # New layout and handles.
        alloc = RangeAllocator(capacity, pool.alignment)
        mapping: dict[int, Slice] = {}
        for s in old_slices:
            alloc.take(layout[s.slice_id], s.nbytes)
            if keep_ids:
                mapping[s.slice_id] = s
            else:
                mapping[s.slice_id] = Slice(
                    pool, next(pool._slice_ids), layout[s.slice_id], s.shape, s.dtype
                )
        old_buffer = pool._buffer
        if old_buffer is None:  # only planned: no data to move
            pool._alloc = alloc
            _install_slices(pool, mapping)
            return mapping

        checkpoint("allocate")
        new_buffer = empty_storage_tensor(capacity, pool.device, pool.name)
        old_key = txn.track(old_buffer.untyped_storage())
        txn.forget_buffer(old_key)
        del old_buffer
        new_storage = new_buffer.untyped_storage()
        checkpoint("copy")
        if old_slices:
            src = [byte_view(txn.storages[old_key], s.offset, s.nbytes) for s in old_slices]
            dst = [byte_view(new_storage, layout[s.slice_id], s.nbytes) for s in old_slices]
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
            del src, dst
        rebound = _rebind_bindings(pool, txn, old_key, new_storage, old_slices, mapping)
        pool._install_buffer(new_buffer, alloc)
        _install_slices(pool, mapping)
        pool.registry.restore(rebound)
        del new_buffer, new_storage

        checkpoint("release")
        if txn.unaccounted_users(old_key):
            pinned = {
                f"pool {pool.name!r}'s old storage": name_pins(txn.storages[old_key], txn.own_ids())
            }
            if on_pinned == "raise":
                raise PinnedStorageError(_pinned_message(pinned), pinned)
            warnings.warn(_pinned_message(pinned, kept=True), stacklevel=3)
        txn.commit_release()
        return mapping
    except BaseException:
        txn.rollback()
        raise


def _rebind_bindings(
    pool: FlatPool,
    txn: Transaction,
    old_key: int,
    new_storage: torch.UntypedStorage,
    old_slices: tuple[Slice, ...],
    mapping: dict[int, Slice],
) -> dict[int, list[Binding]]:
    """Move every bound object still in place to the new storage; returns the new registry."""
    out: dict[int, list[Binding]] = {}
    for s in old_slices:
        new = mapping[s.slice_id]
        kept: list[Binding] = []
        for b in pool.registry.bindings(s):
            obj = b.current()
            if obj is None:
                continue
            if is_in_place(old_key, s, b, obj):
                txn.move_in_place(obj, old_key, new_storage, new.offset + b.geometry.byte_offset)
            kept.append(b)
        if kept:
            out[new.slice_id] = kept
    return out


def _install_slices(pool: FlatPool, mapping: dict[int, Slice]) -> None:
    pool._live, pool._offsets, pool._at_offset = {}, [], {}
    for s in sorted(mapping.values(), key=lambda s: s.offset):
        pool._insert(s)
