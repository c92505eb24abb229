"""The lean adoption path for sharded parameters: a plain shard, a wrapper over it, a holder.

What a fusion group hands :func:`flatpool.FlatPool.adopt` for an FSDP2 member is one spec per
member: the padded shard (an exact ``torch.Tensor``) as the primary, the DTensor parameter as
its view (a wrapper subclass with no memory of its own whose ``_local_tensor`` is an exact
tensor on the shard's storage) and the member's attribute as the shard's holder. The general
path builds a plan, members, byte views and report items per spec; a model with 10,000 shards
pays that at every fusion. Here every phase is one pass over the batch, as in
:mod:`flatpool.ownership.fastpath`:

* eligibility from TensorImpl reads of exact tensors in one loop (anything else, or anything
  unusual, sends the whole batch to the general path before anything changed, and that path
  raises the precise error for a bad input);
* the slices in one step (or the ones the specs name, on a pool still only planned);
* per chunk: the journal (write-ahead ``SetMove`` records), the ``set_`` of every shard and
  local tensor, the placement check, then one ``_foreach_copy_`` into the shards from detached
  aliases of their originals;
* one pin check, one registry bind, one release proof; report items as columns.

Both moved tensors move in place (``set_``): a shard and its local tensor that are views of
each other keep that link, as the general path keeps a view whose base moves with it. The
guarantees are the general path's: validation, journaled moves undone exactly by any
interrupt, the invariant check, the use-count pre-check, the weak-reference proof, pin naming.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import chain, compress, repeat, starmap
from typing import Any, cast
from operator import add, and_, attrgetter, eq, floordiv, ge, is_, itemgetter, le, mul, sub

import torch

from .. import torch_compat as tc
from ..errors import InvalidRequestError
from ..holder import Holder
from ..registry import ParamRef, Record, Ref, make_record, tensor_ref
from ..requests import check_dtype
from ..slices import Slice
from ..state import PoolState, pool_index, pool_of_storage
from .columns import Interned
from .copying import COPY_CHUNK, copy_all
from .faults import checkpoint
from .moves import ImplSwaps, Place, SetMove, SetMoves, place_columns, place_many
from .proof import held_outside_python
from .settle import Placed, check_moved, keep_unreleased, release, settle_pins
from .spec import AdoptionReport, AdoptSpec, ItemTable, OnPinned, specs_of_columns
from .transaction import Transaction
from .validate import label

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = set(_PLAIN)
_LOCAL = "_local_tensor"


def sharded_specs(targets: object) -> list[AdoptSpec] | None:
    """``targets`` when every one is a spec of this path's shape (a plain primary, one view that
    is a tensor subclass, holders), else ``None``: told apart before anything is read deeply."""
    if not isinstance(targets, (list, tuple)) or not targets:
        return None
    for s in targets:
        if (type(s) is not AdoptSpec or type(s.tensor) not in _PLAIN or len(s.views) != 1
                or type(s.views[0]) in _PLAIN):
            return None
    return list(targets)


class SpecColumns:
    """A sharded batch given as columns, not as one :class:`AdoptSpec` a member: shard
    ``tensors[i]``, its one view ``wrappers[i]``, its holder ``getattr(owners[i], key)`` (or none
    when ``owners`` is ``None``), its slice ``slices[i]``. What a fusion group knows of its
    members already; the specs are built only if the batch needs the general path
    (:meth:`specs`), which then validates them as for any call."""

    __slots__ = ("tensors", "wrappers", "owners", "key", "slices")

    def __init__(self, tensors: list[torch.Tensor], wrappers: list[torch.Tensor],
                 owners: list[Any] | None, key: str, slices: list[Slice | None]) -> None:
        n = len(tensors)
        if len(wrappers) != n or len(slices) != n or (owners is not None and len(owners) != n):
            raise InvalidRequestError(
                f"SpecColumns: {n} tensors, {len(wrappers)} wrappers, {len(slices)} slices"
                + ("" if owners is None else f", {len(owners)} owners")
                + ": give one of each per member")
        self.tensors, self.wrappers, self.owners, self.key, self.slices = (
            tensors, wrappers, owners, key, slices)

    def __len__(self) -> int:
        return len(self.tensors)

    def holders(self) -> list[Holder | None]:
        """Each member's holder of its shard as a :class:`Holder` (made here), or ``None``."""
        if self.owners is None:
            return [None] * len(self.tensors)
        return list(map(Holder, self.owners, repeat(self.key)))

    def specs(self) -> list[AdoptSpec]:
        """The same batch as specs (for the general path)."""
        holders: list[tuple[Holder, ...]] = (  # (with owners, no holder is None)
            [()] * len(self.tensors) if self.owners is None
            else list(zip(cast("list[Holder]", self.holders()))))
        return specs_of_columns(self.tensors, list(zip(self.wrappers)), holders, self.slices)


def _columns_of(specs: list[AdoptSpec]) -> tuple[SpecColumns, list[Holder | None]] | None:
    """The columns of specs :func:`sharded_specs` took, with each one's holder (``None``
    when a spec has more than one: the general path's)."""
    given = list(map(_holders_of, specs))
    if set(map(len, given)) - {0, 1}:
        return None  # (a second holder, or one of the local, is the general path's)
    holders: list[Holder | None] = [h[0] if h else None for h in given]
    return SpecColumns(list(map(_tensor_of, specs)), list(map(_first, map(_views_of, specs))),
                       None, "", list(map(_slice_of, specs))), holders


class _Rows:
    """The batch's facts, one column per fact, in spec order (no object per member): the shard
    ``ts[i]``, its local tensor ``locals[i]`` and wrapper, where both sit now."""

    __slots__ = ("ts", "locals", "wrappers", "holders", "cols", "keys", "storages", "offsets",
                 "sizes", "strides", "dtypes", "nbytes", "versions", "local_versions", "local_offsets",
                 "local_sizes", "local_strides", "swaps", "grads", "slices")

    def __init__(self, ts: list[torch.Tensor], locals_: list[torch.Tensor],
                 wrappers: list[torch.Tensor], holders: list[Holder | None] | None,
                 cols: SpecColumns) -> None:
        self.ts, self.locals, self.wrappers, self.holders = ts, locals_, wrappers, holders
        self.cols = cols
        """With ``holders`` ``None``: the shards are held where ``cols`` says (its owners'
        attribute, no :class:`Holder` object made)."""
        self.keys: list[int] = []
        self.storages: list[torch.UntypedStorage] = []
        self.offsets: list[int] = []
        self.sizes: list[tuple[int, ...]] = []
        self.strides: list[tuple[int, ...]] = []
        self.dtypes: list[torch.dtype] = []
        self.nbytes: list[int] = []
        """Bytes of each shard (its slice's size)."""
        self.versions: list[int] = []
        self.local_versions: list[int] = []
        self.local_offsets: list[int] = []
        self.local_sizes: list[tuple[int, ...]] = []
        self.local_strides: list[tuple[int, ...]] = []
        self.swaps: list[bool] = []
        """The shard moves by an impl swap (an autograd view of a base that stays behind)."""
        self.grads: list[bool] = []
        self.slices: list[Slice | None] = []

    def containers(self) -> list[object]:
        """The lists that hold the batch's tensors (for pin scans to skip)."""
        return [self.ts, self.locals, self.wrappers, self.holders, self.cols.owners,
                self.storages]

    def holder_list(self) -> list[Holder | None]:
        """Each shard's holder as a :class:`Holder` (made here for owner columns)."""
        return self.holders if self.holders is not None else self.cols.holders()


_FLAGS = attrgetter("layout", "is_nested", "is_quantized")
_PLAIN_FLAGS = {(torch.strided, False, False)}
_tensor_of, _views_of = attrgetter("tensor"), attrgetter("views")
_holders_of, _slice_of = attrgetter("holders"), attrgetter("slice")
_local_of, _base_of = attrgetter(_LOCAL), attrgetter("_base")
_owner, _key, _item = attrgetter("owner"), attrgetter("key"), attrgetter("item")
_version_of, _itemsize = attrgetter("_version"), attrgetter("itemsize")
_first = itemgetter(0)


def _plain_facts(shards: list[torch.Tensor], locals_: list[torch.Tensor],
                 cpu: bool, device: torch.device) -> tuple[list[torch.dtype], list[int]] | None:
    """The shards' dtypes and element counts when every shard and local tensor is a dense,
    contiguous, plain-bit tensor, the local of its shard's dtype, every shard non-empty and on
    the pool's device (else ``None``): one C-level ``map`` pass a fact over the batch (both are
    exact tensors: torch's own attributes, no override). The local tensor's device is its
    storage's, checked with the storage."""
    both = shards + locals_
    if set(map(_FLAGS, both)) != _PLAIN_FLAGS:
        return None
    if (any(map(tc.impl_is_inference, both)) or any(map(tc.impl_is_conj, both))
            or any(map(tc.impl_is_neg, both)) or not all(map(tc.impl_is_contiguous, both))):
        return None
    del both
    dtypes = list(map(tc.impl_dtype_of, shards))
    numels = list(map(tc.impl_numel, shards))
    if list(map(tc.impl_dtype_of, locals_)) != dtypes or not all(numels):
        return None  # (a local tensor may be empty: a rank's share of no rows)
    if not (all(map(_is_cpu, shards)) if cpu
            else all(d == device for d in map(tc.impl_device, shards))):
        return None
    return dtypes, numels


_is_cpu = attrgetter("is_cpu")


def _owners_hold(cols: SpecColumns) -> bool:
    """Every owner of the columns holds its shard at attribute ``key`` now, and the place can be
    written to (see :func:`_places_hold`)."""
    if cols.owners is None:
        return True
    n = len(cols.owners)
    return _places_hold(cols.owners, [cols.key] * n, [False] * n, cols.tensors)


def _holders(holders: list[Holder | None], ts: list[torch.Tensor]) -> list[Holder | None] | None:
    """The specs' holders of their shards, or ``None`` when any spec needs the general path:
    a place nothing can be written to, one that does not hold the shard now."""
    present = [h for h in holders if h is not None]
    if not present:
        return holders
    if set(map(type, present)) != {Holder}:
        return None
    shards = ts if len(present) == len(ts) else [t for t, h in zip(ts, holders) if h is not None]
    if not _places_hold(list(map(_owner, present)), list(map(_key, present)),
                        list(map(_item, present)), shards):
        return None
    return holders


def _places_hold(owners: list[Any], keys: list[Any], items: list[bool],
                 shards: list[torch.Tensor]) -> bool:
    """Place ``i`` (``owners[i]``'s attribute or item ``keys[i]``) holds ``shards[i]`` now, and
    can be written to, for every ``i``. Assignability is decided once per place kind (the
    owner's type, the key, attribute or item), from a probe of that kind."""
    for place in set(zip(map(type, owners), keys, items)):  # (a place's key is hashable: a name)
        cls, key, item = place
        probe = next(o for o, k, i in zip(owners, keys, items)
                     if type(o) is cls and k == key and i == item)
        if Holder(probe, key, item).unassignable() is not None:
            return False
    try:
        values = (list(map(getattr, owners, keys)) if not any(items)
                  else [Holder(o, k, i).get() for o, k, i in zip(owners, keys, items)])
    except Exception:  # noqa: BLE001 - a place that cannot be read: the general path reports
        return False
    return all(map(is_, values, shards))


def _eligible(pool: PoolState, cols: SpecColumns, spec_holders: list[Holder | None] | None,
              planned: bool) -> _Rows | None:
    """The batch's facts as columns, or ``None`` when any spec needs the general path.

    Shard and local tensor are exact ``torch.Tensor`` objects: their attributes are torch's
    own TensorImpl reads, each one C-level ``map`` pass over the batch. The wrapper is read only
    for its ``_local_tensor`` and for having no memory of its own (a storage-sharing or meta
    wrapper moves differently: general path).
    """
    device = pool.device
    cpu = device.type == "cpu"
    n = len(cols)
    slices = cols.slices
    if not n or len(slices) != n:
        return None  # (nothing to adopt: the general path says what it does with that)
    with_slice = slices[0] is not None
    if _nones(slices) != (0 if with_slice else n):
        return None  # some specs name their slice, some not
    if with_slice and not planned:
        return None  # an existing slice's bytes must be saved for a rollback: general path
    # Python-level reads first (a wrapper's ``_local_tensor``, the holders' places), as the
    # general path makes them; then every TensorImpl read in one no_torch_function block.
    ts, wrappers = cols.tensors, cols.wrappers
    if not (len(wrappers) == n and (
            cols.owners is None or len(cols.owners) == n)):
        return None
    if not set(map(type, ts)) <= _PLAIN_TYPES or set(map(type, wrappers)) & _PLAIN_TYPES or not all(
            map(isinstance, wrappers, repeat(torch.Tensor))):
        return None  # (what sharded_specs tells of specs: a plain shard, a subclass view)
    try:
        locals_: list[torch.Tensor] = list(map(_local_of, wrappers))
    except AttributeError:
        return None
    if not set(map(type, locals_)) <= _PLAIN_TYPES or any(map(is_, locals_, ts)):
        return None
    if spec_holders is None:
        if not _owners_hold(cols):
            return None
        holders = None
    else:
        holders = _holders(spec_holders, ts)
        if holders is None:
            return None
    r = _Rows(ts, locals_, wrappers, holders, cols)
    with tc.no_torch_function():
        facts = _plain_facts(ts, locals_, cpu, device)
        if facts is None:
            return None
        dtypes, numels = facts
        r.dtypes = dtypes
        # The shard moves in place when it is no autograd view, or a view of its local tensor
        # (which moves with it); a view of a base that stays behind (FSDP2's padded tensor)
        # gets a fresh impl on its slice, swapped in, or that base would pin the original. The
        # local tensor moves in place: no view, or a view of a shard moving in place.
        bases = list(map(_base_of, ts))
        swaps = r.swaps = list(map(_swaps, bases, locals_))
        local_bases = list(map(_base_of, locals_))
        if _nones(local_bases) != n and not all(map(_local_moves, local_bases, ts, swaps)):
            return None
        if any(swaps) and list(map(tc.storage_address, compress(bases, swaps))) != list(
                map(tc.storage_address, compress(ts, swaps))):
            return None  # a view of a base on another storage
        del bases, local_bases
        storages = list(map(tc.impl_untyped_storage, ts))
        try:
            if not all(map(tc.storage_data_ptr, storages)):
                return None  # (no shard here is empty: a null pointer is a placeholder)
        except tc.UNREADABLE_STORAGE:
            return None
        keys = list(map(tc.storage_key_of, storages))
        if len(set(keys)) != n:
            return None  # two shards on one storage
        if not all(map(tc.storage_resizable, storages)):
            return None  # external memory: the general path reports it external
        if cpu and any(map(tc.storage_is_shared, storages)):
            return None  # shared memory: another process may map it
        by_storage = pool_index()
        if any(map(by_storage.__contains__, keys)) and any(
                pool_of_storage(k) is not None for k in keys):
            return None  # a pool's storage
        if list(map(tc.storage_address, locals_)) != keys:
            return None  # a local tensor elsewhere than its shard
        try:  # a wrapper on the shard's storage (or meta) moves too: the general path's
            if any(map(tc.impl_is_meta, wrappers)) or any(
                    map(eq, map(tc.storage_address, wrappers), keys)):
                return None
        except tc.UNREADABLE_STORAGE:
            return None
        interned = Interned()
        intern = interned.__getitem__
        items = list(map(_itemsize, dtypes))
        offsets = r.offsets = list(map(tc.impl_storage_offset, ts))
        r.sizes = list(map(intern, map(tc.impl_size, ts)))
        r.strides = list(map(intern, map(tc.impl_stride, ts)))
        r.nbytes = list(map(mul, numels, items))
        ends = list(map(add, offsets, numels))
        if not all(map(le, map(mul, ends, items), map(tc.storage_nbytes, storages))):
            return None  # reaches past its storage: the general path names it
        local_offsets = r.local_offsets = list(map(tc.impl_storage_offset, locals_))
        if not (all(map(ge, local_offsets, offsets)) and all(
                map(le, map(add, local_offsets, map(tc.impl_numel, locals_)), ends))):
            return None  # a local tensor outside its shard
        r.local_sizes = list(map(intern, map(tc.impl_size, locals_)))
        r.local_strides = list(map(intern, map(tc.impl_stride, locals_)))
        r.versions = list(map(_version_of, ts))
        r.local_versions = list(map(_version_of, locals_))
        r.grads = list(map(and_, swaps, map(and_, map(tc.impl_requires_grad, ts),
                                            map(tc.impl_is_leaf, ts))))
        if with_slice:
            given: set[int] = set()
            for slc, dt, nb in zip(slices, dtypes, r.nbytes):
                if (type(slc) is not Slice or slc.pool is not pool or slc.slice_id in given
                        or slc.dtype != dt or slc.nbytes != nb):
                    return None
                given.add(slc.slice_id)
            if pool.registry.holds_any(given):
                return None
            r.slices = slices
        r.keys, r.storages = keys, storages
        del storages
    if with_slice and not pool.all_live([s.slice_id for s in slices],  # type: ignore[union-attr]
                                        slices):  # type: ignore[arg-type]
        return None  # a freed or relocated handle: the general path names it
    for dt in set(dtypes):
        check_dtype(dt)
    return r


def _nones(xs: list[Any]) -> int:
    """How many of ``xs`` are ``None``, by identity (``list.count`` and ``in`` compare with
    ``==``: a tensor's ``__eq__`` is a dispatched op, microseconds each)."""
    return sum(map(is_, xs, repeat(None)))


def _swaps(base: torch.Tensor | None, local: torch.Tensor) -> bool:
    return base is not None and base is not local


def _local_moves(local_base: torch.Tensor | None, t: torch.Tensor, swap: bool) -> bool:
    """The local tensor can move in place: no view, or a view of a shard moving in place."""
    return local_base is None or (local_base is t and not swap)


def adopt_sharded(
    pool: PoolState, specs: list[AdoptSpec] | SpecColumns, txn: Transaction, on_pinned: OnPinned
) -> AdoptionReport | None:
    """Adopt ``specs`` in ``txn``; ``None`` (nothing done) when one needs the general path."""
    snap = txn.snapshot
    planned = snap is not None and snap.buffer is None and snap.buffer_key is None
    if isinstance(specs, SpecColumns):
        cols, spec_holders = specs, None
    else:
        split = _columns_of(specs)
        if split is None:
            return None
        cols, spec_holders = split
    r = _eligible(pool, cols, spec_holders, planned)
    if r is None:
        return None
    moving = r.ts + r.locals
    sets = r.locals + [t for t, sw in zip(r.ts, r.swaps) if not sw]
    held = {id(t) for t in held_outside_python(sets, moving)}
    del moving, sets
    outside = {}
    if held:
        for t, local, key in zip(r.ts, r.locals, r.keys):
            found = [x for x in (t, local) if id(x) in held]
            if found:
                outside[key] = found
    return _adopt(pool, r, txn, on_pinned, outside)


def _adopt(
    pool: PoolState, r: _Rows, txn: Transaction, on_pinned: OnPinned,
    outside: dict[int, list[torch.Tensor]],
) -> AdoptionReport:
    keys, ts, locals_ = r.keys, r.ts, r.locals
    txn.originals.add_columns(keys, r.storages)
    original_nbytes = list(map(tc.storage_nbytes, r.storages))
    txn.nbytes.add_columns(keys, original_nbytes)
    r.storages = []  # the transaction holds them now: its counts must see no other holder
    checkpoint("allocate")
    if not r.slices:
        slices = pool.allocate_many(list(zip(r.sizes, r.dtypes)))
    else:
        slices = r.slices  # type: ignore[assignment]
    target = pool.storage
    los = list(map(_offset_of, slices))  # byte offsets of the slices
    starts = list(map(floordiv, los, map(_itemsize, r.dtypes)))
    local_starts = list(map(add, starts, map(sub, r.local_offsets, r.offsets)))
    his = list(map(add, los, r.nbytes))
    journal = txn.journal
    n = len(ts)
    for first in range(0, n, COPY_CHUNK):
        last = min(first + COPY_CHUNK, n)
        chunk = ts[first:last]
        with tc.no_torch_function():
            srcs = list(map(tc.impl_detach, chunk))
        checkpoint("rebind")
        records: list[SetMove | SetMoves | ImplSwaps] = []
        places: list[Place] = []
        swapped = list(compress(range(first, last), r.swaps[first:last]))
        if len(swapped) != last - first:  # shards that move in place (no base left behind)
            for i in range(first, last):
                if not r.swaps[i]:
                    records.append(SetMove(ts[i], keys[i], r.offsets[i], r.sizes[i],
                                           r.strides[i], r.versions[i]))
                    places.append((ts[i], target, starts[i], r.sizes[i], r.strides[i]))
        olds = list(map(ts.__getitem__, swapped))
        fresh = _fresh_on(target, r, swapped, starts)
        if swapped:
            records.append(ImplSwaps(
                olds, fresh, list(map(keys.__getitem__, swapped)),
                list(map(r.versions.__getitem__, swapped)),
                list(zip(map(r.offsets.__getitem__, swapped), map(r.sizes.__getitem__, swapped),
                         map(r.strides.__getitem__, swapped))),
                list(map(r.dtypes.__getitem__, swapped))))
        # write-ahead: the records exist before the moves (the locals as one column record)
        records.append(SetMoves(locals_, keys, r.local_offsets, r.local_sizes, r.local_strides,
                                r.local_versions, first, last))
        journal.extend(records)
        del records
        place_many(places)
        _swap_in(olds, fresh, [r.grads[i] for i in swapped])
        place_columns(locals_[first:last], target, local_starts[first:last],
                      r.local_sizes[first:last], r.local_strides[first:last])
        del places, olds, fresh
        # (each asked geometry lies in its slice: a shard fills it, its local lies within)
        check_moved(pool, chunk + locals_[first:last], starts[first:last] + local_starts[first:last],
                    r.sizes[first:last] + r.local_sizes[first:last],
                    r.strides[first:last] + r.local_strides[first:last],
                    partial(_bounds, chunk, locals_[first:last], los[first:last], his[first:last]))
        checkpoint("copy")
        copy_all(chunk, srcs)
        del srcs, chunk
    tc.set_versions(ts + locals_, r.versions + r.local_versions)

    index: dict[int, int] = {}

    def at(key: int) -> int:  # built only when an original is named (pinned, late)
        if not index:
            index.update((k, i) for i, k in enumerate(keys))
        return index[key]

    def name(key: int) -> str:
        return label(ts[at(key)], at(key))

    pins = settle_pins(txn, keys, name, outside, on_pinned, r.containers)
    keep_unreleased(pool, txn, name, pins, outside)
    pool.registry.bind_many(zip(map(_slice_id, slices), _records(r)))
    expired, late = release(txn, name, pins, on_pinned)
    pinned = {at(k): v for k, v in (*pins.items(), *late.items())}
    # Keyed by the batch's own key column (Originals.add_columns): the flags are in batch order.
    released = (expired.in_order() if expired.key_list() is keys
                else bytes(map(expired.__getitem__, keys)))
    return AdoptionReport(ItemTable(slices, original_nbytes, released, pinned, rebound=2))


_offset_of, _slice_id = attrgetter("offset"), attrgetter("slice_id")


def _bounds(shards: list[torch.Tensor], locals_: list[torch.Tensor], lo: list[int],
            hi: list[int]) -> Iterable[Placed]:
    """Each moved tensor with its slice's bounds: a shard and its local share a slice."""
    return chain(zip(shards, lo, hi), zip(locals_, lo, hi))


def _swap_in(objs: list[torch.Tensor], fresh: list[torch.Tensor], grads: list[bool]) -> None:
    """Exchange each shard's impl with its fresh one (``swap_many``, one C-level pass); a leaf
    that requires grad takes its ``.grad`` and hooks along. (A function of its own: no local
    is left holding an old impl, now in ``fresh``, which would pin its original.)"""
    deque(map(tc.swap_impl, objs, fresh), maxlen=0)
    if any(grads):
        for obj, old in compress(zip(objs, fresh), grads):
            tc.carry_leaf_state(obj, old)


def _fresh_on(target: torch.UntypedStorage, r: _Rows, swapped: list[int],
              starts: list[int]) -> list[torch.Tensor]:
    """A new base-less tensor on the pool at each swapped shard's slice (what ``fresh_like``
    makes; the transaction is outside grad and inference mode), requiring grad where the shard
    is a leaf that does. Made with no bytecode per shard when they share a dtype. The shards
    carry no conj/neg bit (:func:`_plain_facts`), so neither does what replaces their impl."""
    dtypes = list(map(r.dtypes.__getitem__, swapped))
    if not dtypes:
        return []
    if len(set(dtypes)) == 1:
        make = partial(torch.empty, 0, dtype=dtypes[0], device=target.device)
        empties: Iterable[torch.Tensor] = starmap(make, repeat((), len(swapped)))
    else:
        empties = [torch.empty(0, dtype=dt, device=target.device) for dt in dtypes]
    fresh = list(map(tc.impl_set_, empties, repeat(target), map(starts.__getitem__, swapped),
                     map(r.sizes.__getitem__, swapped), map(r.strides.__getitem__, swapped)))
    for t, i in zip(fresh, swapped):
        if r.grads[i]:
            t.requires_grad_(True)
    return fresh


def _records(r: _Rows) -> Iterable[list[Record]]:
    """Each member's records for the registry, as the general path makes them: the shard (with
    its holder), then the local tensor (held by its wrapper's slot). In C-level passes when the
    references are all of one kind (what :func:`tensor_ref` would pick: a weak reference for an
    exact tensor, a :class:`ParamRef` for a parameter wrapper); else member by member."""
    refs = _refs_of(r.ts), _refs_of(r.locals), _refs_of(r.wrappers)
    n = len(r.ts)
    owners: list[Ref] | None
    if r.holders is None:  # owner columns: one attribute a shard
        owners = None if r.cols.owners is None else _owner_refs(r.cols.owners)
        keys: Iterable[Any] = repeat(r.cols.key, n)
        items: Iterable[bool] = repeat(False, n)
    else:
        present = [h for h in r.holders if h is not None]
        owners = _owner_refs(list(map(_owner, present))) if len(present) == n else None
        keys, items = map(_key, present), map(_item, present)
    shifts = map(mul, map(sub, r.local_offsets, r.offsets), map(_itemsize, r.dtypes))
    if refs[0] is None or refs[1] is None or refs[2] is None or owners is None:
        return map(_member_records, r.ts, r.locals, r.wrappers, r.holder_list(), r.sizes,
                   r.strides, r.dtypes, r.local_sizes, r.local_strides, shifts)
    shard_recs = zip(refs[0], repeat(0, n), r.sizes, r.strides, r.dtypes, owners, keys, items,
                     repeat(True, n))
    local_recs = zip(refs[1], shifts, r.local_sizes, r.local_strides, r.dtypes, refs[2],
                     repeat(_LOCAL, n), repeat(False, n), repeat(False, n))
    return map(list, zip(shard_recs, local_recs))


def _refs_of(ts: list[torch.Tensor]) -> list[Ref] | None:
    """:func:`tensor_ref` of each of ``ts`` in one pass, when they are all of one kind."""
    kinds = set(map(type, ts))
    if kinds == {torch.Tensor}:
        return list(map(weakref.ref, ts))
    if kinds == {torch.nn.Parameter} or (
            torch.Tensor not in kinds and all(map(is_, map(getattr, ts, repeat("_is_param"),
                                                            repeat(False)), repeat(True)))):
        return list(map(ParamRef, ts))
    return None


def _owner_refs(owners: list[Any]) -> list[Ref] | None:
    """The holders' owners referred to weakly in one pass (what the general path's records do
    for an owner that is no tensor), or ``None`` for any other kind of owner."""
    if any(map(isinstance, owners, repeat(torch.Tensor))):
        return None
    try:
        return list(map(weakref.ref, owners))
    except TypeError:  # a dict or list owner is held strongly, as the general path holds it
        return None


def _member_records(t: torch.Tensor, local: torch.Tensor, wrapper: torch.Tensor,
                    holder: Holder | None, size: tuple[int, ...], stride: tuple[int, ...],
                    dtype: torch.dtype, local_size: tuple[int, ...],
                    local_stride: tuple[int, ...], byte_shift: int) -> list[Record]:
    """One member's records (see :func:`_records`)."""
    # The local's record is make_record()'s tuple, inline: its holder's owner is the wrapper,
    # a tensor, which make_record() refers to by tensor_ref() as well.
    return [make_record(t, 0, size, stride, dtype, holder, True),
            (tensor_ref(local), byte_shift, local_size, local_stride, dtype,
             tensor_ref(wrapper), _LOCAL, False, False)]


def is_sharded_batch(specs: Sequence[object]) -> bool:
    """Would :func:`sharded_specs` take ``specs`` (for tests and benchmarks)."""
    return sharded_specs(list(specs)) is not None


__all__ = ["SpecColumns", "adopt_sharded", "is_sharded_batch", "sharded_specs"]
