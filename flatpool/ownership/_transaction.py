"""All-or-nothing bookkeeping for one operation on one or several pools; rollback lives here.

A :class:`Transaction` captures every pool it covers, holds the originals (so the release proof
can account for flatpool's own references) and keeps the write-ahead journal of every move;
:meth:`Transaction.rollback` puts every member back where its record says, whether or not its
move happened, exactly and idempotently. :func:`atomic` is the guard every operation runs in.
Its life is a :class:`Phase`; an exception before the commit rolls everything back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TypeVar

import torch

from .. import _torch_compat as tc
from ..errors import AdoptionError, InvalidRequestError
from .._state import PoolSnapshot, PoolState
from .._gcpause import gc_paused
from .._interrupts import RollbackError, run_undo, signals_guarded
from ._moves import Member, Move, Record, SlotSet, byte_view, fresh_like, set_many, swap_many

T = TypeVar("T")


def atomic(body: Callable[[Transaction], T], *pools: PoolState) -> T:
    """Run ``body`` as one all-or-nothing operation on ``pools`` and return what it returns.

    Under every pool's lock (taken in one global order: no deadlock), with the gc paused and
    outside inference and grad mode. An exception before the commit rolls everything back; one
    inside the rollback restarts it (it is idempotent). Signals during the rollback or the
    epilogue are delivered after the operation (see :mod:`flatpool._interrupts`).
    """
    check_plain_torch()
    with signals_guarded() as guard, tc.outside_inference(), torch.no_grad():
        with gc_paused(), ExitStack() as locks:
            for pool in sorted(set(pools), key=id):
                locks.enter_context(pool.lock)
            for pool in pools:
                pool.release_kept()
            txn = Transaction(pools)
            try:
                guard.open()  # what came while taking the locks is delivered now, in the body
                result = body(txn)
            except BaseException:
                if txn.phase is Phase.OPEN:
                    run_undo(txn.rollback)
                txn.close()
                raise
            guard.finishing()
            txn.close()
    return result


def check_plain_torch() -> None:
    """Refuse fake/functional/tracing modes and functorch transforms: tensors made there are
    not real."""
    mode = tc.unreal_dispatch_mode()
    if mode is not None:
        raise InvalidRequestError(
            f"flatpool cannot move storages while a {type(mode).__name__} is active (its tensors "
            "have no real storage, and the mode intercepts the copies); call it outside the "
            "`with` block of the mode")
    if tc.in_functorch_transform():
        raise InvalidRequestError(
            "flatpool cannot move storages inside a torch.func transform (grad, vmap, jacrev, "
            "...): tensors made there are wrapped at the transform's level; adopt before "
            "entering the transform")


def check_not_in_backward() -> None:
    """Refuse to move storages while autograd's backward pass runs (from a backward hook)."""
    if tc.in_backward():
        raise AdoptionError(
            "cannot move storages while autograd's backward pass is running (called from a "
            "backward hook?); adopt before forward or after backward and the optimizer step")


class Phase(enum.Enum):
    """Where a transaction is in its life (see the module)."""

    OPEN = "open: a failure rolls everything back"
    COMMITTED = "committed: the operation stands"
    RELEASED = "released: the originals are held only weakly"
    CLOSED = "closed"


class Transaction:
    """The journal, the originals and the pools' snapshots of one operation."""

    def __init__(self, pools: Sequence[PoolState]) -> None:
        self.pools = list(pools)
        self.snapshots: list[PoolSnapshot | None] = [p.capture() for p in self.pools]
        self.originals: dict[int, torch.UntypedStorage] = {}
        """Original key -> its storage, held strongly until :meth:`release`."""
        self.into: dict[int, PoolState] = {}  # Original key -> the pool it moves into
        self.nbytes: dict[int, int] = {}
        self.journal: list[Record] = []
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pool bytes, before)
        self.weak: dict[int, int] = {}
        """After :meth:`release`: original key -> a weak reference to its storage."""
        self.phase = Phase.OPEN
        self._stored = {id(p) for p, snap in zip(self.pools, self.snapshots)
                        if snap is not None and snap.buffer_key is not None}

    def had_storage(self, pool: PoolState) -> bool:
        """``pool`` had a storage when the transaction began (else a rollback drops the new one)."""
        return id(pool) in self._stored

    # -- originals -------------------------------------------------------------------------
    def track(self, storage: torch.UntypedStorage, pool: PoolState, key: int | None = None) -> int:
        """Hold ``storage`` as an original moving into ``pool``; returns its key."""
        key = tc.storage_key(storage) if key is None else key
        if key not in self.originals:
            self.originals[key] = storage
            self.nbytes[key] = storage.nbytes()
            self.into[key] = pool
        return key

    def save_bytes(self, view: torch.Tensor) -> None:
        """Keep a copy of pool bytes about to be overwritten (an existing slice), for rollback."""
        self.saved.append((view, tc.clone(view.detach())))

    def detach_buffer(self, pool: PoolState) -> None:
        """Relocation: ``pool``'s snapshot must not pin its old storage (now an original); a
        rollback rebuilds the buffer tensor from it."""
        snap = self.snapshots[self.pools.index(pool)]
        if snap is not None:
            snap.buffer = None

    # -- commit and release ----------------------------------------------------------------
    def commit(self) -> None:
        """The point of no return: from here an exception leaves the operation standing."""
        self.phase = Phase.COMMITTED

    def release(self) -> dict[int, bool]:
        """Drop every reference to the originals; report which ones died (weak references)."""
        self.weak = {key: tc.weak_storage(s) for key, s in self.originals.items()}
        self.phase = Phase.RELEASED
        for rec in self.journal:
            if isinstance(rec, Member) and rec.fresh is not None:
                rec.let_go()
        self.originals.clear()
        return self.expired()

    def expired(self) -> dict[int, bool]:
        """Per original key, whether its weak reference expired."""
        return {key: tc.weak_expired(ref) for key, ref in self.weak.items()}

    def close(self) -> None:
        """Done: let go of everything (a kept exception must not pin originals or the pools)."""
        self.phase = Phase.CLOSED
        self.originals.clear()
        self.journal = []
        self.saved = []
        for pool, snap in zip(self.pools, self.snapshots):
            if snap is not None:
                pool.forget(snap)
        self.snapshots = [None] * len(self.pools)
        weak, self.weak = self.weak, {}
        for ref in weak.values():
            tc.weak_free(ref)

    # -- rollback --------------------------------------------------------------------------
    def rollback(self) -> None:
        """Put every member, holder and pool back as they were. Idempotent."""
        if self.phase is Phase.CLOSED:
            return
        if self.weak:
            self._recover_originals()
        errors = undo(self.journal, self.originals)
        with torch.no_grad():
            for view, before in reversed(self.saved):
                tc.foreach_copy([view], [before])
        for pool, snap in zip(self.pools, self.snapshots):
            assert snap is not None
            if snap.buffer is None and snap.buffer_key is not None:  # relocation: rebuild it
                storage = self.originals[snap.buffer_key]
                snap.buffer = byte_view(storage, 0, storage.nbytes())
            pool.restore(snap)
        self.close()
        if errors:
            raise RollbackError(
                f"rollback restored everything except {len(errors)} holder(s): "
                + "; ".join(f"{type(e).__name__}: {e}" for e in errors),
                errors)

    def _recover_originals(self) -> None:
        """After :meth:`release`: get each original back (alive) or rebuild it from the pool."""
        for key, ref in self.weak.items():
            if key in self.originals:
                continue
            alive = tc.weak_upgrade(ref)
            if alive is None:
                alive = tc.new_storage(self.nbytes[key], self.into[key].device)
                self._refill(key, alive)
            self.originals[key] = alive
        for rec in self.journal:  # a swapped member whose old impl died gets one rebuilt
            if (isinstance(rec, Member) and rec.how is not Move.IN_PLACE and rec.key is not None
                    and rec.old_impl() is None):
                rec.fresh = fresh_like(rec.obj, self.originals[rec.key], rec.offset, rec.size,
                                       rec.stride, rec.dtype)

    def _refill(self, key: int, fresh: torch.UntypedStorage) -> None:
        """Copy an original's bytes back from where one of its members sits in the pool now."""
        for rec in self.journal:
            if isinstance(rec, Member) and rec.key == key:
                with tc.no_torch_function():
                    shift = (tc.impl_storage_offset(rec.obj) - rec.offset) * rec.dtype.itemsize
                    pool_storage = tc.impl_untyped_storage(rec.obj)
                lo = max(0, shift)
                n = min(self.nbytes[key], pool_storage.nbytes() - shift) - (lo - shift)
                if n > 0:
                    with torch.no_grad():
                        byte_view(fresh, lo - shift, n).copy_(byte_view(pool_storage, lo, n))
                return


def undo(journal: Sequence[Record], originals: dict[int, torch.UntypedStorage],
         ) -> list[BaseException]:
    """Put every member of ``journal`` back where its record says (absolute, idempotent);
    returns the errors of records that could not be undone, after undoing the rest."""
    back = []
    swaps = []
    counted: list[Member] = []
    for rec in reversed(journal):
        if not isinstance(rec, Member):
            continue
        if rec.how is Move.IN_PLACE:
            assert rec.key is not None
            back.append((rec.obj, originals[rec.key], rec.offset, rec.size, rec.stride))
        else:
            old = rec.old_impl()
            if tc.impl_address(rec.obj) != rec.impl and old is not None:
                swaps.append((rec.obj, old))
        if rec.version >= 0:
            counted.append(rec)
    set_many(back)
    swap_many(swaps)
    errors: list[BaseException] = []
    for rec in reversed(journal):
        try:
            if isinstance(rec, SlotSet):
                setattr(rec.obj, rec.name, rec.old)
        except Exception as exc:  # keep undoing the rest; reported together
            errors.append(exc)
    tc.set_versions([m.obj for m in counted], [m.version for m in counted])
    return errors
