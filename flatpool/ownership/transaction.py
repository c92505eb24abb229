"""All-or-nothing bookkeeping for multi-tensor storage moves.

A :class:`Transaction` snapshots the pool, journals every rebind, and can undo all of it.
Original storages are held in one map (``storages``) so that the release proof can account for
every reference flatpool itself holds: after :meth:`commit_release` drops them, a storage that
does not expire was pinned by someone else, and :meth:`rollback` can still bring everything
back (onto the original if it is alive, onto a fresh copy of its bytes if it died).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .faults import checkpoint
from .rebind import autograd_base, fresh_tensor_like, own_storage, set_storage
from .spec import Holder
from .weak import StorageRef, new_storage, upgrade, weak_storage

if TYPE_CHECKING:
    from ..pool import FlatPool


class InPlace:
    """``obj`` was moved with ``set_``; it came from storage ``key`` at this geometry."""

    __slots__ = ("obj", "key", "byte_offset", "shape", "stride")

    def __init__(
        self, obj: torch.Tensor, key: int, byte_offset: int, shape: tuple[int, ...],
        stride: tuple[int, ...],
    ) -> None:
        self.obj, self.key, self.byte_offset, self.shape, self.stride = (
            obj, key, byte_offset, shape, stride,
        )


class Replaced:
    """``holder`` held ``old`` (on storage ``key``) and now holds ``new``."""

    __slots__ = ("holder", "old", "old_ref", "new", "key", "byte_offset", "shape", "stride")

    def __init__(
        self, holder: Holder, old: torch.Tensor, new: torch.Tensor, key: int, byte_offset: int,
        shape: tuple[int, ...], stride: tuple[int, ...],
    ) -> None:
        self.holder, self.new = holder, new
        self.old: torch.Tensor | None = old
        self.old_ref: weakref.ref[torch.Tensor] | None = None  # set when ``old`` is dropped
        self.key, self.byte_offset, self.shape, self.stride = key, byte_offset, shape, stride


def byte_view(storage: torch.UntypedStorage, start: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``storage`` from ``start`` as a new uint8 tensor (never needs grad,
    so ``set_`` needs no ``no_grad``)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, start, (nbytes,), (1,)
    )


class Transaction:
    def __init__(self, pool: FlatPool) -> None:
        self.pool = pool
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.nbytes: dict[int, int] = {}
        self.journal: list[InPlace | Replaced] = []
        self.weak: dict[int, StorageRef] = {}
        self.patches: list[tuple[object, str, object]] = []
        self.overwritten: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pool bytes, before)
        self._snapshot: tuple[Any, ...] | None = _pool_snapshot(pool)

    # -- originals -------------------------------------------------------------------------
    def track(self, storage: torch.UntypedStorage) -> int:
        key = int(storage._cdata)
        if key not in self.storages:
            self.storages[key] = storage
            self.nbytes[key] = storage.nbytes()
        return key

    # -- moves -----------------------------------------------------------------------------
    def move_in_place(
        self, obj: torch.Tensor, key: int, target: torch.UntypedStorage, new_offset: int
    ) -> None:
        checkpoint("rebind")
        with torch._C.DisableTorchFunctionSubclass():
            off = int(obj.storage_offset()) * obj.element_size()
            shape, stride = tuple(obj.shape), tuple(obj.stride())
        set_storage(obj, target, new_offset, shape, stride)
        self.journal.append(InPlace(obj, key, off, shape, stride))

    def move_by_holder(
        self, holder: Holder, old: torch.Tensor, key: int, target: torch.UntypedStorage,
        new_offset: int,
    ) -> torch.Tensor:
        checkpoint("rebind")
        with torch._C.DisableTorchFunctionSubclass():
            off = int(old.storage_offset()) * old.element_size()
            shape, stride = tuple(old.shape), tuple(old.stride())
        new = fresh_tensor_like(old, target, new_offset, shape, stride)
        holder.set(new)
        self.journal.append(Replaced(holder, old, new, key, off, shape, stride))
        return new

    def save_bytes(self, view: torch.Tensor) -> None:
        """Keep a copy of pool bytes about to be overwritten (an existing slice), for rollback."""
        self.overwritten.append((view, view.detach().clone()))

    def forget_buffer(self, key: int) -> None:
        """Relocation: the snapshot must not pin the pool's old storage (tracked as ``key``)."""
        assert self._snapshot is not None
        snap = list(self._snapshot)
        snap[4] = key
        self._snapshot = tuple(snap)

    def patch(self, obj: object, field: str, value: object, undo: object) -> None:
        """Set a field of a frozen value (an AdoptSpec naming a replaced tensor), undoably.

        ``undo`` says what to put back: a :class:`Replaced` record stands for whatever its
        holder holds after rollback (the original tensor is not kept, it would pin the storage).
        """
        self.patches.append((obj, field, undo))
        object.__setattr__(obj, field, value)

    def own_ids(self) -> set[int]:
        """Ids of the objects this transaction holds, for pin scans to skip."""
        ids = {id(self.storages), id(self.journal), id(self.patches)}
        for rec in self.journal:
            ids.add(id(rec))
            if isinstance(rec, Replaced) and rec.old is not None:
                ids.add(id(rec.old))
        ids.update(id(p) for p in self.patches)
        return ids

    # -- release proof ---------------------------------------------------------------------
    def unaccounted_users(
        self, key: int, records: Sequence[InPlace | Replaced] | None = None
    ) -> int:
        """Users of original ``key`` beyond what this transaction itself holds (before commit).

        C++ users (TensorImpls, counted by ``_storage_Use_Count``) minus the storage object
        and the replaced tensors the journal keeps for rollback, plus Python references to the
        storage object other than ours. Python references to a journaled tensor are invisible
        here; the weak-reference proof after commit catches those.

        ``records``: the journal records of ``key`` when the caller already grouped them (a
        batch checking every key would otherwise scan the whole journal once per key).
        """
        storage = self.storages[key]
        known: dict[int, torch.Tensor] = {}
        held_bases = 0
        for rec in self.journal if records is None else records:
            if isinstance(rec, Replaced) and rec.key == key and rec.old is not None:
                known[id(rec.old)] = rec.old
                base = autograd_base(rec.old)
                if base is not None and id(base) not in known:
                    bs = own_storage(base)
                    if bs is not None and int(bs._cdata) == key:
                        known[id(base)] = base
                        # The base of a replaced view dies with the view unless someone else
                        # holds it. Python refs: `known`, `base`, getrefcount's argument, and
                        # the one C++ keeps while views of it live (PyObject preservation).
                        held_bases += max(0, sys.getrefcount(base) - 4)
                    del bs
                del base
        cpp_users = int(torch._C._storage_Use_Count(storage._cdata))
        # Python refs: self.storages, `storage`, getrefcount's argument, and one held by C++
        # itself while the storage has other users (PyObject preservation).
        py_extra = sys.getrefcount(storage) - 3 - (1 if cpp_users > 1 else 0)
        del storage
        return max(0, cpp_users - 1 - len(known)) + max(0, py_extra) + held_bases

    def commit_release(self) -> dict[int, bool]:
        """Drop every reference to the originals and report which ones expired."""
        checkpoint("release")
        self.weak = {k: weak_storage(s) for k, s in self.storages.items()}
        for rec in self.journal:
            if isinstance(rec, Replaced) and rec.old is not None:
                # If whoever else holds the old object pins the original, a rollback hands the
                # holder that same object back (not a look-alike).
                rec.old_ref = weakref.ref(rec.old)
                rec.old = None
        self.storages.clear()
        return {k: w.expired() for k, w in self.weak.items()}

    # -- undo ------------------------------------------------------------------------------
    def _recover_storages(self) -> None:
        """After commit_release: get each original back (alive) or rebuild it from the pool."""
        by_key: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for rec in self.journal:
            obj = rec.obj if isinstance(rec, InPlace) else rec.new
            s = own_storage(obj)
            if s is not None:
                with torch._C.DisableTorchFunctionSubclass():
                    cur = int(obj.storage_offset()) * obj.element_size()
                by_key.setdefault(rec.key, (s, cur - rec.byte_offset))
        for key, ref in self.weak.items():
            if key in self.storages:
                continue
            alive = upgrade(ref)
            if alive is not None:
                self.storages[key] = alive
                continue
            fresh = new_storage(self.nbytes[key], self.pool.device)
            if key in by_key:
                pool_storage, shift = by_key[key]
                lo = max(0, shift)
                n = min(self.nbytes[key], pool_storage.nbytes() - shift) - (lo - shift)
                with torch.no_grad():
                    byte_view(fresh, lo - shift, n).copy_(byte_view(pool_storage, lo, n))
            self.storages[key] = fresh

    def rollback(self) -> None:
        """Put every tensor, holder and the pool back as they were before the transaction.

        Idempotent: a second call finds nothing left to undo.
        """
        if self._snapshot is None:
            return
        if self.weak and self.journal:
            self._recover_storages()
        for rec in reversed(self.journal):
            storage = self.storages[rec.key]
            if isinstance(rec, InPlace):
                set_storage(rec.obj, storage, rec.byte_offset, rec.shape, rec.stride)
            else:
                old = rec.old
                if old is None and rec.old_ref is not None:
                    old = rec.old_ref()
                if old is None:
                    old = fresh_tensor_like(rec.new, storage, rec.byte_offset, rec.shape, rec.stride)
                rec.holder.set(old)
        self.journal.clear()
        for obj, field, undo in reversed(self.patches):
            object.__setattr__(obj, field, _resolve(undo))
        self.patches.clear()
        with torch.no_grad():
            for view, before in reversed(self.overwritten):
                view.copy_(before)
        self.overwritten.clear()
        buffer = self._snapshot[4]
        if isinstance(buffer, int):  # relocation: rebuild the old buffer tensor
            storage = self.storages[buffer]
            self._snapshot = self._snapshot[:4] + (
                byte_view(storage, 0, storage.nbytes()),
            ) + self._snapshot[5:]
        _pool_restore(self.pool, self._snapshot)
        # Done: drop the originals, or an exception traceback holding this transaction (a
        # PinnedStorageError the caller keeps) would pin them and fail the next attempt.
        self.storages.clear()
        # Nor may the snapshot pin the pool's storage: a grow() or compact() in the caller's
        # except block (what PoolExhaustedError suggests) would find it pinned.
        self._snapshot = None


def _resolve(undo: object) -> object:
    if isinstance(undo, Replaced):
        return undo.holder.get()
    if isinstance(undo, tuple):
        return tuple(_resolve(u) for u in undo)
    return undo


def _pool_snapshot(pool: FlatPool) -> tuple[Any, ...]:
    reg = pool._registry
    return (
        pool._alloc.snapshot(),
        dict(pool._live),
        list(pool._offsets),
        dict(pool._at_offset),
        pool._buffer,
        reg.snapshot() if reg is not None else None,
        pool._slice_ids,
    )


def _pool_restore(pool: FlatPool, snap: tuple[Any, ...]) -> None:
    alloc, live, offsets, at_offset, buffer, reg, _ = snap
    pool._alloc.restore(alloc)
    pool._live, pool._offsets, pool._at_offset = dict(live), list(offsets), dict(at_offset)
    pool._buffer = buffer
    if reg is not None:
        pool.registry.restore(reg)
    elif pool._registry is not None:
        pool._registry.restore({})
