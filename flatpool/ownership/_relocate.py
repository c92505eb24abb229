"""``grow`` and ``compact``: move a pool to new storage and move everything it adopted.

The old storage must die like any adopted original (a kept ``pool.flat()`` pins it). Handles
stay valid across ``grow``; ``compact`` returns new ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import _torch_compat as tc
from .._allocator import RangeAllocator, align_up
from ..errors import InvalidRequestError, InvalidTypeError
from .._registry import Binding
from ..slices import Slice
from .._state import MAX_BYTES, PoolState, empty_storage_tensor
from ._faults import checkpoint
from ._moves import Dest, Member, Move, byte_view, copy_all, member_of, move
from ._pins import movable_tensors_on
from ._release import Placed, check_placed, finish, held_outside_python
from ._spec import OnPinned, check_policy
from ._transaction import Transaction, atomic, check_not_in_backward
from ._validity import in_place


def grow(pool: PoolState, capacity: int, *, on_pinned: OnPinned = "raise") -> None:
    """Give ``pool`` a capacity of ``capacity`` bytes (>= current), keeping every offset."""
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise InvalidTypeError(f"capacity must be an int, got {capacity!r}")
    with pool.lock:
        if capacity > MAX_BYTES:
            raise InvalidRequestError(f"grow() to {capacity} bytes exceeds {MAX_BYTES} bytes")
        if capacity < pool.capacity:
            raise InvalidRequestError(
                f"grow() cannot shrink pool {pool.name!r} from {pool.capacity} to {capacity} "
                "bytes; use compact() to drop free space")
        layout = {s.slice_id: s.offset for s in pool.slices()}
        relocate(pool, capacity, layout, on_pinned)


def compact(pool: PoolState, *, on_pinned: OnPinned = "raise") -> dict[int, Slice]:
    """Pack live slices to the front (in order) and shrink to fit; returns old id -> new slice."""
    with pool.lock:
        layout: dict[int, int] = {}
        pos = 0
        for s in pool.slices():
            start = align_up(pos, pool.slice_alignment(s.dtype))
            layout[s.slice_id] = start
            pos = start + s.nbytes
        capacity = align_up(pos, pool.alignment)
        result = relocate(pool, capacity, layout, on_pinned)
        return result  # not `return f()`: see flatpool._interrupts


def relocate(
    pool: PoolState, capacity: int, layout: dict[int, int], on_pinned: OnPinned
) -> dict[int, Slice]:
    """Move ``pool`` to a new storage of ``capacity`` bytes with slices at ``layout``."""
    check_policy(on_pinned)
    check_not_in_backward()
    return atomic(lambda txn: _relocate(pool, txn, capacity, layout, on_pinned), pool)


def _relocate(
    pool: PoolState, txn: Transaction, capacity: int, layout: dict[int, int], on_pinned: OnPinned
) -> dict[int, Slice]:
    mapping, moved = move_storage(pool, txn, capacity, layout)
    if moved is not None:
        old_key, held = moved
        del moved

        def name(key: int) -> str:
            return f"pool {pool.name!r}'s old storage"

        finish(txn, name, {old_key: held} if held else {}, on_pinned, lambda: None)
        del held
    return mapping


def grow_within(
    txn: Transaction, pool: PoolState, requests: Sequence[tuple[tuple[int, ...], torch.dtype]]
) -> tuple[int, list[torch.Tensor]]:
    """Inside an adoption's transaction: move ``pool`` to a storage with room for ``requests``.
    Returns the old storage's key in ``txn`` and its members held outside Python, for the
    caller's release proof."""
    end = max((s.end for s in pool.slices()), default=0)
    for shape, dtype in requests:
        end = align_up(end, pool.slice_alignment(dtype)) + math.prod(shape) * dtype.itemsize
    capacity = align_up(max(end, pool.capacity), pool.alignment)
    if capacity > MAX_BYTES:
        raise InvalidRequestError(
            f"pool {pool.name!r} would grow to {capacity} bytes, past {MAX_BYTES} bytes")
    # Offsets stay, so every tensor on the old storage has its place on the new one: the views
    # a user made after adoption follow (an explicit grow() names them as pins instead).
    layout = {s.slice_id: s.offset for s in pool.slices()}
    _, moved = move_storage(pool, txn, capacity, layout, follow_unbound=True)
    assert moved is not None  # (a materialized pool's storage moved)
    return moved


def move_storage(
    pool: PoolState, txn: Transaction, capacity: int, layout: dict[int, int],
    follow_unbound: bool = False,
) -> tuple[dict[int, Slice], tuple[int, list[torch.Tensor]] | None]:
    """Everything of a relocation but the release proof. ``follow_unbound`` (offsets kept only)
    also moves tensors the registry does not know."""
    old_slices = pool.slices()
    keep_ids = all(layout[s.slice_id] == s.offset for s in old_slices)
    alloc = RangeAllocator(capacity, pool.alignment)
    mapping: dict[int, Slice] = {}
    for s in old_slices:
        alloc.take(layout[s.slice_id], s.nbytes)
        mapping[s.slice_id] = s if keep_ids else pool.new_handle(
            layout[s.slice_id], s.shape, s.dtype)
    if not pool.is_materialized:  # only planned: no data to move
        pool.install(None, alloc, list(mapping.values()))
        return mapping, None

    pool.check_invariants()  # a storage shrunk through a tensor on it has no bytes to move
    checkpoint("allocate")
    new_buffer = empty_storage_tensor(capacity, pool.device, pool.name)
    old_key = txn.track(pool.storage, pool)
    txn.detach_buffer(pool)
    new_storage = new_buffer.untyped_storage()
    checkpoint("copy")
    if old_slices:
        old = txn.originals[old_key]
        copy_all([byte_view(new_storage, layout[s.slice_id], s.nbytes) for s in old_slices],
                 [byte_view(old, s.offset, s.nbytes) for s in old_slices])
        del old
    registry, placed, held = _move_bound(pool, txn, old_key, new_storage, old_slices, mapping,
                                         follow_unbound)
    pool.install(new_buffer, alloc, list(mapping.values()))
    pool.registry.restore(registry)
    del new_buffer, new_storage
    check_placed(pool, placed)
    del placed
    return mapping, (old_key, held)


def _move_bound(
    pool: PoolState,
    txn: Transaction,
    old_key: int,
    new_storage: torch.UntypedStorage,
    old_slices: tuple[Slice, ...],
    mapping: dict[int, Slice],
    follow_unbound: bool,
) -> tuple[dict[int, list[Binding]], list[Placed], list[torch.Tensor]]:
    """Move every bound member (with ``follow_unbound``, every Python-visible tensor) to the
    new storage; returns the new registry, placements and members held outside Python."""
    out: dict[int, list[Binding]] = {}
    members: list[Member] = []
    dests: list[Dest] = []
    placed: list[Placed] = []
    for s in old_slices:
        new = mapping[s.slice_id]
        kept: list[Binding] = []
        for b in pool.registry.bindings(s.slice_id):
            obj = b.current()
            if obj is None:
                continue
            if in_place(old_key, s, b, obj):
                members.append(member_of(obj, Move.IN_PLACE, old_key))
                dests.append((new_storage, (new.offset + b.byte_offset) // b.dtype.itemsize,
                              b.shape, b.stride))
                placed.append((obj, new.offset, new.end, *dests[-1][1:]))
            kept.append(b)
        if kept:
            out[new.slice_id] = kept
    if follow_unbound and _unknown_users(pool, txn, old_key, members):
        known = {id(m.obj) for m in members} | {id(pool.byte_buffer())}
        for t in movable_tensors_on(old_key, known):
            members.append(member_of(t, Move.IN_PLACE, old_key))
            with tc.no_torch_function():  # (the same place on the new storage)
                dests.append((new_storage, tc.impl_storage_offset(t), tuple(tc.impl_size(t)),
                              tuple(tc.impl_stride(t))))
            placed.append((t, 0, new_storage.nbytes(), *dests[-1][1:]))
    moving = [m.obj for m in members]
    held = held_outside_python(moving, moving)
    del moving
    move(txn.journal, members, dests)
    return out, placed, held


def _unknown_users(pool: PoolState, txn: Transaction, old_key: int, members: list[Member]) -> bool:
    """Whether the old storage has a user beyond the bound members, the pool's buffer and the
    transaction's storage object: only then is the heap searched (a gc walk costs the whole
    Python heap) for unknown views to move; a holder it cannot move is named by the proof."""
    storage = txn.originals[old_key]
    own = 1 if pool.storage_key == old_key else 0  # (the pool's buffer tensor, not yet swapped)
    extra = tc.storage_users(storage) - 1 - own - len({id(m.obj) for m in members})
    del storage
    return extra > 0
