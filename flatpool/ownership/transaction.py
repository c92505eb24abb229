"""All-or-nothing bookkeeping for one operation on one pool.

A :class:`Transaction` captures the pool's state, holds the original storages (so the release
proof can account for every reference flatpool itself holds), journals every move *before* it
happens (:mod:`flatpool.ownership.moves`) and can undo all of it, exactly and idempotently.

Its life: open -> (moves) -> :meth:`commit` -> :meth:`release` (drop the originals, take weak
references) -> closed. An exception before ``commit`` rolls everything back; after it the
operation stands (every tensor is in the pool), except where the operation itself decides to
undo a release that did not go through (:meth:`rollback` then recovers the originals).
:func:`atomic` is the guard every operation's body runs in.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from itertools import chain
from typing import TypeVar

import torch

from .. import torch_compat as tc
from ..errors import InvalidRequestError
from ..state import PoolSnapshot, PoolState
from .columns import KeyedColumn
from .gcpause import gc_paused
from .interrupts import RollbackError, run_undo, signals_guarded
from .moves import ImplSwap, ImplSwaps, Record, fresh_like, set_moves, undo

T = TypeVar("T")


def atomic(pool: PoolState, body: Callable[[Transaction], T]) -> T:
    """Run ``body`` as one all-or-nothing operation on ``pool`` and return what it returns.

    Under the pool's lock, with the cycle collector paused and outside inference and grad
    mode. An exception before the transaction commits rolls everything back; an exception
    landing inside the rollback only makes it start over (it is idempotent). Signals that
    arrive while the lock is taken and the gc paused are delivered as the body starts; signals
    that arrive while the rollback runs, or once the body has returned (while the lock and the
    gc pause are let go: CPython cannot make a ``with`` statement's exit atomic), are delivered
    after the operation, as their original handlers would have run.
    """
    check_plain_torch()
    with signals_guarded() as guard, tc.outside_inference(), torch.no_grad():
        with gc_paused(), pool.lock:
            pool.release_kept()
            txn = Transaction(pool)
            try:
                guard.open()  # what came while taking the lock is delivered now, in the body
                result = body(txn)
            except BaseException:
                if not txn.committed:
                    run_undo(txn.rollback)
                txn.close()
                raise
            guard.finishing()
            txn.close()
    return result


def check_plain_torch() -> None:
    """Refuse to run under a fake/functional/tracing dispatch mode or a functorch transform:
    flatpool moves real storages, and there every tensor it makes would be fake or wrapped."""
    mode = tc.unreal_dispatch_mode()
    if mode is not None:
        raise InvalidRequestError(
            f"flatpool cannot move storages while a {type(mode).__name__} is active (its tensors "
            "have no real storage, and the mode intercepts the copies); call it outside the "
            "`with` block of the mode"
        )
    if tc.in_functorch_transform():
        raise InvalidRequestError(
            "flatpool cannot move storages inside a torch.func transform (grad, vmap, jacrev, "
            "...): tensors made there are wrapped at the transform's level; adopt before "
            "entering the transform"
        )


def byte_view(storage: torch.UntypedStorage, start: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``storage`` from ``start`` as a new uint8 tensor."""
    with tc.outside_inference():
        result = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, start, (nbytes,), (1,)
        )
        return result  # not `return f()`: see flatpool.ownership.interrupts


class OriginalSizes(dict[int, int]):
    """Original key -> bytes. A lean batch adds its keys and sizes as two columns
    (:meth:`add_columns`: no dict entry and no int objects per original at the batch's peak);
    the first lookup the entries miss moves the columns into the dict (only a rollback after
    the release and the unreleased-original report look one up). Only ``[key]`` sees the
    columns: iteration, ``get``, ``in`` and copies see the entries (no lean batch's transaction
    is read that way)."""

    def __init__(self) -> None:
        super().__init__()
        self._columns: list[tuple[Sequence[int], Sequence[int]]] = []

    def add_columns(self, keys: Sequence[int], sizes: Sequence[int]) -> None:
        self._columns.append((keys, sizes))

    def __missing__(self, key: int) -> int:
        columns, self._columns = self._columns, []
        for keys, sizes in columns:
            self.update(zip(keys, sizes))
        if key in self:
            return self[key]
        raise KeyError(key)


class Originals(MutableMapping[int, torch.UntypedStorage]):
    """Original key -> its storage object, held strongly until the release (the proof counts
    references to exactly these objects). A lean batch adds its keys and storages as two
    columns (:meth:`add_columns`: a shared ``array('q')`` and one list slot, 16 B an original,
    where a dict entry and its int key cost ~62 B at the batch's peak); a lookup by key builds
    the index once (the common path only iterates: the pin pre-check, the release)."""

    __slots__ = ("_entries", "_keys", "_stores", "_index")

    def __init__(self) -> None:
        self._entries: dict[int, torch.UntypedStorage] = {}
        self._keys: Sequence[int] = ()
        self._stores: list[torch.UntypedStorage | None] = []
        self._index: dict[int, int] | None = None

    def add_columns(self, keys: Sequence[int], storages: list[torch.UntypedStorage]) -> None:
        """Hold ``storages[i]`` under ``keys[i]`` (the columns are kept, not copied: the caller
        must not change them); keys already held, or a second batch, go in as entries."""
        if self._stores or any(map(self._entries.__contains__, keys)):
            self.update(zip(keys, storages))
            return
        self._index = None
        self._keys, self._stores = keys, list(storages)

    def containers(self) -> tuple[object, ...]:
        """The objects that refer to the storages directly (for pin scans to skip)."""
        return self, self._entries, self._stores

    def key_column(self) -> Sequence[int]:
        """Every key, in order, without an int object per column key when there are no entries."""
        if not self._entries and None not in self._stores:
            return self._keys
        return list(self)

    def _at(self, key: int) -> int | None:
        if not self._stores:
            return None
        index = self._index
        if index is None:
            index = self._index = {k: i for i, k in enumerate(self._keys)}
        return index.get(key)

    def __getitem__(self, key: int) -> torch.UntypedStorage:
        found = self._entries.get(key)
        if found is not None:
            return found
        i = self._at(key)
        stored = None if i is None else self._stores[i]
        if stored is None:
            raise KeyError(key)
        return stored

    def __setitem__(self, key: int, storage: torch.UntypedStorage) -> None:
        i = None if key in self._entries else self._at(key)
        if i is not None:
            self._stores[i] = storage
        else:
            self._entries[key] = storage

    def __delitem__(self, key: int) -> None:
        if key in self._entries:
            del self._entries[key]
            return
        i = self._at(key)
        if i is None or self._stores[i] is None:
            raise KeyError(key)
        self._stores[i] = None

    def __iter__(self) -> Iterator[int]:
        yield from self._entries
        for k, stored in zip(self._keys, self._stores):
            if stored is not None:
                yield k

    def __len__(self) -> int:
        return len(self._entries) + len(self._stores) - self._stores.count(None)

    def values(self) -> Iterator[torch.UntypedStorage]:  # type: ignore[override]
        """The storages, entries first, then the columns' (no object per call but the iterator)."""
        stores: Iterable[torch.UntypedStorage | None] = self._stores
        if None in self._stores:
            stores = (s for s in self._stores if s is not None)
        return chain(self._entries.values(), stores)  # type: ignore[arg-type]

    def clear(self) -> None:
        self._entries.clear()
        self._keys, self._stores, self._index = (), [], None


_NO_WEAK: KeyedColumn[int] = KeyedColumn((), array("q"))
"""The weak references of a transaction not released yet (or closed): none."""


class Transaction:
    def __init__(self, pool: PoolState) -> None:
        self.pool = pool
        self.snapshot: PoolSnapshot | None = pool.capture()
        self.originals = Originals()
        self.nbytes = OriginalSizes()
        self.journal: list[Record] = []
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pool bytes, before)
        self.weak: KeyedColumn[int] = _NO_WEAK
        self.committed: bool = False
        self.closed: bool = False

    # -- originals -------------------------------------------------------------------------
    def track(self, storage: torch.UntypedStorage) -> int:
        key = tc.storage_key(storage)
        if key not in self.originals:
            self.originals[key] = storage
            self.nbytes[key] = storage.nbytes()
        return key

    def save_bytes(self, view: torch.Tensor) -> None:
        """Keep a copy of pool bytes about to be overwritten (an existing slice), for rollback."""
        self.saved.append((view, tc.clone(view.detach())))

    def detach_buffer(self) -> None:
        """Relocation: the snapshot must not pin the pool's old storage (tracked as an original
        under the snapshot's ``buffer_key``); a rollback rebuilds the buffer tensor from it."""
        if self.snapshot is not None:
            self.snapshot.buffer = None

    # -- commit and release ----------------------------------------------------------------
    def commit(self) -> None:
        """The point of no return: from here an exception leaves the operation standing."""
        self.committed = True

    def release(self) -> KeyedColumn[bool]:
        """Drop every reference to the originals; report which ones died (weak references).

        The journal keeps only weak references to the old impls of swapped views, so if the
        operation then undoes itself a view gets its very impl back where it still lives.
        """
        keys = self.originals.key_column()  # (a lean batch's own column: no int object a key)
        self.weak = KeyedColumn(keys, array("q", tc.weak_storages(self.originals.values())))
        for rec in self.journal:
            if isinstance(rec, (ImplSwap, ImplSwaps)):
                rec.let_go()
        self.originals.clear()
        return self.expired()

    def expired(self) -> KeyedColumn[bool]:
        """Per original key, whether its weak reference expired (columns: see
        :mod:`flatpool.ownership.columns`)."""
        weak = self.weak
        return KeyedColumn(weak.key_list(), bytes(tc.weak_expired_each(weak.values())), flags=True)

    def close(self) -> None:
        """Done: let go of everything (a kept exception must not pin originals or the pool)."""
        self.closed = True
        self.originals.clear()
        self.journal = []
        self.saved = []
        if self.snapshot is not None:
            self.pool.forget(self.snapshot)
        self.snapshot = None
        weak, self.weak = self.weak, _NO_WEAK
        tc.weak_free_each(weak.values())

    # -- undo ------------------------------------------------------------------------------
    def rollback(self) -> None:
        """Put every tensor, holder and the pool back as they were. Idempotent."""
        if self.closed:
            return
        if self.weak:
            self._recover_originals()
        errors = undo(self.journal, self.originals)
        with torch.no_grad():
            for view, before in reversed(self.saved):
                tc.foreach_copy([view], [before])
        snap = self.snapshot
        assert snap is not None
        if snap.buffer is None and snap.buffer_key is not None:  # relocation: rebuild it
            storage = self.originals[snap.buffer_key]
            snap.buffer = byte_view(storage, 0, storage.nbytes())
        self.pool.restore(snap)
        self.close()
        if errors:
            raise RollbackError(
                f"rollback restored everything except {len(errors)} holder(s): "
                + "; ".join(f"{type(e).__name__}: {e}" for e in errors),
                errors,
            )

    def _recover_originals(self) -> None:
        """After :meth:`release`: get each original back (alive) or rebuild it from the pool."""
        for key, ref in self.weak.items():
            if key in self.originals:
                continue
            alive = tc.weak_upgrade(ref)
            if alive is not None:
                self.originals[key] = alive
                continue
            fresh = tc.new_storage(self.nbytes[key], self.pool.device)
            self._refill(key, fresh)
            self.originals[key] = fresh
        for rec in self.journal:
            if isinstance(rec, ImplSwap) and rec.old_impl_holder() is None and rec.key is not None:
                assert rec.geometry is not None and rec.dtype is not None
                rec.other = fresh_like(rec.obj, self.originals[rec.key], *rec.geometry, rec.dtype)
            elif isinstance(rec, ImplSwaps):
                for i, held in enumerate(rec.holders()):
                    if held is None:
                        rec.hold(i, fresh_like(rec.objs[i], self.originals[rec.keys[i]],
                                               *rec.geometries[i], rec.dtypes[i]))

    def _refill(self, key: int, fresh: torch.UntypedStorage) -> None:
        """Copy an original's bytes back from where its tensors sit in the pool now."""
        for rec in set_moves(self.journal):
            if rec.key == key:
                obj = rec.obj
                with tc.no_torch_function():
                    item = tc.impl_element_size(obj)
                    shift = (tc.impl_storage_offset(obj) - rec.offset) * item
                    pool_storage = tc.impl_untyped_storage(obj)
                lo = max(0, shift)
                n = min(self.nbytes[key], pool_storage.nbytes() - shift) - (lo - shift)
                if n > 0:
                    with torch.no_grad():
                        byte_view(fresh, lo - shift, n).copy_(byte_view(pool_storage, lo, n))
                return


__all__ = ["Transaction", "atomic", "byte_view"]
