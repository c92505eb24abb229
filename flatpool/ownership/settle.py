"""The end of every move: check the invariants, find pins, commit, release, prove.

Shared by adoption (both paths) and re-adoption. After the moves:

1. :func:`check_placed`: the pool's storage is still exactly its capacity and every moved
   tensor lies, by its TensorImpl, inside its slice; otherwise :class:`PoolInvariantError`
   (the operation rolls back).
2. :func:`settle_pins`: originals something else still uses, with the names of the holders (a
   holder no Python object explains is looked at again for a bounded time first: it may be a
   thread that lets go by itself); by policy raise (roll back), warn, or force.
3. :func:`release`: commit, drop every reference to the originals, and prove with weak
   references which ones died; one that survives unexpectedly is named, and under "raise" the
   operation undoes itself.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import eq

import torch

from .. import torch_compat as tc
from .._warn import warn
from ..errors import OriginalKeptAliveWarning, PinnedStorageError, PoolInvariantError
from ..state import PoolState
from ..unreleased import UnreleasedOriginal
from .columns import KeyedColumn
from .faults import checkpoint
from .interrupts import run_undo
from .moves import ImplSwap, ImplSwaps
from .pins import name_pins, only_cxx
from .proof import OUTSIDE_PYTHON, look_again, old_impls, storage_pinned, swapped_held_once
from .spec import OnPinned
from .transaction import Transaction

Pins = dict[int, tuple[str, ...]]
"""Pinned originals: storage key -> what holds it."""
Labels = Callable[[int], str]
"""How messages name the original with a given storage key (built only when needed)."""
Placed = tuple[torch.Tensor, int, int]
"""``(tensor object, slice start, slice end)`` in bytes of the pool."""


def check_placed(pool: PoolState, placed: Iterable[Placed]) -> None:
    """Raise :class:`PoolInvariantError` unless the pool is consistent and every moved tensor
    sits inside its slice (read back from its TensorImpl, not from what was asked)."""
    pool.check_invariants()
    key = pool.storage_key
    address, offset_of, contiguous = tc.storage_address, tc.impl_storage_offset, tc.impl_is_contiguous
    with tc.no_torch_function():
        for t, lo, hi in placed:
            item = tc.impl_element_size(t)
            start = offset_of(t) * item
            if contiguous(t):
                end = start + tc.impl_numel(t) * item
            else:
                end = start
                if tc.impl_numel(t):
                    span = 1
                    for size, stride in zip(tc.impl_size(t), tc.impl_stride(t)):
                        span += (size - 1) * abs(stride)
                    end = start + span * item
            if address(t) != key or start < lo or end > hi:
                raise PoolInvariantError(
                    f"a {type(t).__name__} moved into pool {pool.name!r} would sit at bytes "
                    f"{start}..{end}, outside its slice {lo}..{hi} (its geometry is not what it "
                    "claimed): nothing was changed"
                )


def check_moved(
    pool: PoolState, tensors: Sequence[torch.Tensor], places: Sequence[int],
    sizes: Sequence[tuple[int, ...]], strides: Sequence[tuple[int, ...]],
    placed: Callable[[], Iterable[Placed]],
) -> None:
    """:func:`check_placed` for exact tensors a lean path ``set_`` or swapped in at geometry it
    chose inside their slices: read back from each TensorImpl (one C-level pass a fact) that it
    sits on the pool's storage at its element offset ``places[i]`` with ``sizes[i]`` and
    ``strides[i]`` (which fix its extent); on any difference ``placed()`` gives every tensor's
    slice bounds for check_placed's full verdict."""
    pool.check_invariants()
    with tc.no_torch_function():
        if (all(map(eq, map(tc.storage_address, tensors), repeat(pool.storage_key)))
                and list(map(tc.impl_storage_offset, tensors)) == list(places)
                and list(map(tc.impl_size, tensors)) == list(sizes)
                and list(map(tc.impl_stride, tensors)) == list(strides)):
            return
    check_placed(pool, placed())
    raise PoolInvariantError(  # the geometry is in bounds, yet not what was asked
        f"a tensor moved into pool {pool.name!r} does not sit where it was placed: "
        "nothing was changed")


def own_ids(txn: Transaction, *more: object) -> set[int]:
    """Ids of objects the operation itself holds, for pin scans to skip."""
    ids = {*map(id, txn.originals.containers()), id(txn.journal)} | {id(m) for m in more}
    for rec in txn.journal:
        ids.add(id(rec))
        if isinstance(rec, ImplSwap) and rec.other is not None:
            ids.add(id(rec.other))
        elif isinstance(rec, ImplSwaps):
            ids.update(map(id, rec.containers()))
            ids.update(id(o) for o in rec.others if o is not None)
    return ids


Outside = dict[int, list[torch.Tensor]]
"""Per original key, the moved tensors something outside Python holds (found before the move
by :func:`flatpool.ownership.proof.held_outside_python`)."""


def outside_by_key(pairs: Iterable[tuple[int, torch.Tensor]], held: Sequence[torch.Tensor]) -> Outside:
    """Group the ``held`` tensors by the original key they move from."""
    ids = {id(t) for t in held}
    out: Outside = {}
    if ids:
        for key, t in pairs:
            if id(t) in ids:
                out.setdefault(key, []).append(t)
    return out


def pinned_keys(txn: Transaction, keys: Iterable[int], outside: Outside) -> dict[int, bool]:
    """The pinned originals (cheap counts, no gc scan): key -> pinned by a storage user (else
    only by an owner outside Python)."""
    olds = old_impls(txn)
    originals, users, refs = txn.originals, tc.storage_users, tc.python_refs
    if not outside and (swapped_held_once(txn, olds) if olds
                        else tc.storages_held_once(originals.values())):
        return {}  # the counts below, read for every original in C-level passes
    out: dict[int, bool] = {}
    for key in keys:
        if key not in olds:  # the common case, inline: only our storage object uses it
            storage = originals[key]
            by_storage = users(storage) != 1 or refs(storage) != 2
            del storage
            if by_storage:  # the full count says why (and sees bases)
                by_storage = storage_pinned(txn, key)
        else:
            by_storage = storage_pinned(txn, key, olds[key])
        if by_storage or key in outside:
            out[key] = by_storage
    return out


def name_all(txn: Transaction, found: dict[int, bool], skip: Callable[[], Iterable[object]]) -> Pins:
    """Name what holds each pinned original (a gc scan: only on this path)."""
    ours = own_ids(txn, *skip())
    # An unnamed view on the original also adds a link to its base's impl: when the storage
    # itself is pinned, the holders gc names explain both.
    return {key: name_pins(txn.originals[key], ours, [] if by_storage else [OUTSIDE_PYTHON])
            for key, by_storage in found.items()}


def _let_cxx_holders_go(
    txn: Transaction, outside: Outside, found: dict[int, bool], pins: Pins,
    skip: Callable[[], Iterable[object]],
) -> tuple[dict[int, bool], Pins]:
    """Wait (bounded, :func:`flatpool.ownership.proof.look_again`) for the storage pins that
    no Python object explains: a collective's worker thread still holds the tensor it wrote for
    a moment after ``wait()`` returned (gloo, right after ``distribute_tensor``), and the move
    made here took less than that moment. The pre-move check waits for such owners of the moved
    impls; this one is for another impl on the same storage. ``(found, pins)`` after it."""
    waiting = {k for k, by_storage in found.items() if by_storage and only_cxx(pins[k])}
    if not waiting:
        return found, pins
    left = look_again(waiting, lambda still: set(pinned_keys(txn, still, outside)))
    if left == waiting:
        return found, pins  # nothing let go: the names stand
    found = {k: v for k, v in found.items() if k not in waiting or k in left}
    return found, (name_all(txn, found, skip) if found else {})


def settle_pins(
    txn: Transaction, keys: Sequence[int], label: Labels, outside: Outside,
    on_pinned: OnPinned, skip: Callable[[], Iterable[object]] = tuple,
    force: Callable[[Pins], None] | None = None,
) -> Pins:
    """Apply the ``on_pinned`` policy; returns what stays pinned (empty when all is clear)."""
    checkpoint("release")
    found = pinned_keys(txn, keys, outside)
    if found:  # unreachable cycles (a kept traceback) may be all that holds it: collect, retry
        gc.collect()
        found = pinned_keys(txn, keys, outside)
    pins = name_all(txn, found, skip) if found else {}
    if pins:
        found, pins = _let_cxx_holders_go(txn, outside, found, pins, skip)
    if found and on_pinned == "force" and force is not None:
        force(pins)
        found = pinned_keys(txn, keys, outside)
        pins = name_all(txn, found, skip) if found else {}
    if not found:
        return {}
    if on_pinned == "raise":
        named = labelled(pins, label)
        raise PinnedStorageError(pinned_message(named), named)
    warn(pinned_message(labelled(pins, label), kept=True), OriginalKeptAliveWarning)
    return pins


def labelled(pins: Pins, label: Labels) -> dict[str, tuple[str, ...]]:
    return {label(k): v for k, v in pins.items()}


def keep_unreleased(
    pool: PoolState, txn: Transaction, label: Labels, pins: Pins, outside: Outside
) -> None:
    """Record what a warn/force adoption left alive; keep alive (in the pool) the originals
    whose moved tensors something outside Python holds, until it lets go."""
    for key, reasons in pins.items():
        storage = txn.originals[key]
        # Kept only where nothing Python can see holds it: then the pool is all that does.
        held = outside.get(key, []) if OUTSIDE_PYTHON in reasons else []
        info = UnreleasedOriginal(
            label=label(key), nbytes=txn.nbytes[key], address=storage.data_ptr(),
            device=str(storage.device), kept_by_pool=bool(held),
        )
        pool.trace_unreleased(info, storage, held[0] if held else None)
        del storage


def release(
    txn: Transaction, label: Labels, pinned: Pins, on_pinned: OnPinned
) -> tuple[KeyedColumn[bool], Pins]:
    """Commit, let go of the originals, prove which died; name late survivors.

    Under "raise" a late survivor undoes the whole operation (the originals still alive are
    put back exactly; ones that died are rebuilt from the pool's copy) and raises.
    """
    checkpoint("release")
    txn.commit()
    expired = txn.release()
    if not all(expired.values()):  # cyclic garbage is no pin
        gc.collect()
        expired = txn.expired()
    late_keys = [k for k, dead in expired.items() if not dead and k not in pinned]
    if not late_keys:
        return expired, {}
    # Something we could not count (a Python reference to a moved object's old impl) kept an
    # original alive. Undo first so the holders are back on the original and nameable.
    survivors = {k: tc.weak_upgrade(txn.weak[k]) for k in late_keys}
    if on_pinned == "raise":
        run_undo(txn.rollback)
    late: Pins = {}
    for k, alive in survivors.items():
        if alive is not None:
            late[k] = name_pins(alive, own_ids(txn, survivors))
    del survivors, alive
    if on_pinned == "raise":
        named = labelled(late, label)
        raise PinnedStorageError(pinned_message(named), named)
    warn(pinned_message(labelled(late, label), kept=True), OriginalKeptAliveWarning)
    return expired, late


def pinned_message(pinned: dict[str, tuple[str, ...]], *, kept: bool = False) -> str:
    lines = [f"{len(pinned)} original storage(s) are still referenced after rebinding:"]
    for lab, holders in pinned.items():
        lines.append(f"  {lab} is held by: " + "; ".join(holders))
    if kept:  # on_pinned="warn"/"force": the move stands, the originals live on
        lines.append(
            "The move was kept (on_pinned='warn'/'force'); each original is freed when its "
            "holders drop it (pool.unreleased_originals() lists them)."
        )
        return "\n".join(lines)
    lines.append(
        "Pass those tensors in AdoptSpec.views (or their places in AdoptSpec.holders), drop the "
        "references, or use on_pinned='warn'/'force'. Nothing was changed."
    )
    return "\n".join(lines)


__all__ = ["Labels", "Outside", "Pins", "outside_by_key", "Placed", "check_moved", "check_placed", "keep_unreleased",
           "labelled", "name_all", "own_ids", "pinned_keys", "pinned_message", "release", "settle_pins"]
