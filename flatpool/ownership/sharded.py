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

from collections.abc import Sequence

from operator import attrgetter

import torch

from .. import torch_compat as tc
from ..holder import Holder
from ..registry import Record, make_record, tensor_ref
from ..requests import check_dtype
from ..slices import Slice
from ..state import PoolState, pool_of_storage
from .copying import COPY_CHUNK, copy_all
from .faults import checkpoint
from .moves import ImplSwap, Place, SetMove, place_many, swap_many
from .proof import held_outside_python
from .settle import Placed, check_placed, keep_unreleased, release, settle_pins
from .spec import AdoptionReport, AdoptSpec, ItemTable, OnPinned
from .transaction import Transaction
from .validate import label

_PLAIN = (torch.Tensor, torch.nn.Parameter)
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


class _Row:
    """One spec's facts: the shard ``t``, its local tensor ``local``, where both sit now."""

    __slots__ = ("t", "local", "key", "storage", "offset", "size", "stride", "version",
                 "local_version", "local_offset", "swap", "grad", "nbytes", "local_size", "local_stride", "holder", "wrapper", "slice")

    def __init__(self, t: torch.Tensor, local: torch.Tensor, wrapper: torch.Tensor, key: int,
                 storage: torch.UntypedStorage) -> None:
        self.t, self.local, self.wrapper, self.key = t, local, wrapper, key
        self.storage: torch.UntypedStorage | None = storage
        self.offset = int(t.storage_offset())
        self.size: tuple[int, ...] = tuple(t.size())
        self.stride: tuple[int, ...] = t.stride()
        self.nbytes = t.numel() * t.dtype.itemsize
        self.version = t._version
        self.local_version = local._version
        self.local_offset = int(local.storage_offset())
        self.local_size: tuple[int, ...] = tuple(local.size())
        self.local_stride: tuple[int, ...] = local.stride()
        self.holder: Holder | None = None
        self.slice: Slice | None = None
        self.swap = False
        """The shard moves by an impl swap (an autograd view of a base that stays behind)."""
        self.grad = False


_FLAGS = attrgetter("layout", "is_nested", "is_quantized")
_PLAIN_FLAGS = {(torch.strided, False, False)}


def _plain_facts(found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Holder | None]],
                 cpu: bool, device: torch.device) -> bool:
    """Every shard and local tensor is a dense, contiguous, plain-bit tensor, the local of its
    shard's dtype, every shard non-empty and on the pool's device: one C-level ``map`` pass a
    fact over the batch (both are exact tensors: torch's own attributes, no override). The
    local tensor's device is its storage's, checked with the storage."""
    shards = [f[0] for f in found]
    both = shards + [f[1] for f in found]
    if set(map(_FLAGS, both)) != _PLAIN_FLAGS:
        return False
    if (any(map(tc.impl_is_inference, both)) or any(map(tc.impl_is_conj, both))
            or any(map(tc.impl_is_neg, both)) or not all(map(tc.impl_is_contiguous, both))):
        return False
    n = len(shards)
    dtypes = list(map(tc.impl_dtype_of, both))
    if dtypes[:n] != dtypes[n:] or not all(map(tc.impl_numel, shards)):
        return False  # (a local tensor may be empty: a rank's share of no rows)
    if cpu:
        return all(map(_is_cpu, shards))
    return all(d == device for d in map(tc.impl_device, shards))


_is_cpu = attrgetter("is_cpu")


def _eligible(pool: PoolState, specs: list[AdoptSpec], planned: bool) -> list[_Row] | None:
    """Per-spec facts, or ``None`` when any spec needs the general path.

    Shard and local tensor are exact ``torch.Tensor`` objects: their attributes are torch's
    own TensorImpl reads. The wrapper is read only for its ``_local_tensor`` and for having no
    memory of its own (a storage-sharing or meta wrapper moves differently: general path).
    """
    rows: list[_Row] = []
    seen: set[int] = set()
    given: set[int] = set()
    assignable: dict[tuple[type, object, bool], str | None | bool] = {}
    dtypes: set[torch.dtype] = set()
    device = pool.device
    cpu = device.type == "cpu"
    storage_key, pointer_valid = tc.storage_key, tc.storage_pointer_valid
    with_slice = specs[0].slice is not None
    if with_slice and not planned:
        return None  # an existing slice's bytes must be saved for a rollback: general path
    # Python-level reads first (a wrapper's ``_local_tensor``, the holders' places), as the
    # general path makes them; then every TensorImpl read in one no_torch_function block.
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Holder | None]] = []
    for spec in specs:
        t, wrapper = spec.tensor, spec.views[0]
        local = getattr(wrapper, _LOCAL, None)
        if type(local) not in _PLAIN or local is t or (spec.slice is not None) != with_slice:
            return None
        assert isinstance(local, torch.Tensor)
        holder = None
        for h in spec.holders:
            if type(h) is not Holder or holder is not None:
                return None  # (a second holder, or one of the local, is the general path's)
            place = (type(h.owner), h.key, h.item)  # decided from the owner's type alone
            why = assignable.get(place, False)
            if why is False:
                why = assignable[place] = h.unassignable()
            if why is not None:
                return None
            try:
                value = h.get()
            except Exception:
                return None
            if value is not t:
                return None
            del value
            holder = h
        found.append((t, local, wrapper, holder))
    with tc.no_torch_function():
        if not _plain_facts(found, cpu, device):
            return None
        for spec, (t, local, wrapper, holder) in zip(specs, found):
            dt = t.dtype
            # The shard moves in place when it is no autograd view, or a view of its local
            # tensor (which moves with it); a view of a base that stays behind (FSDP2's padded
            # tensor) gets a fresh impl on its slice, swapped in, or that base would pin the
            # original. The local tensor moves in place: no view, or a view of a shard moving
            # in place.
            base, local_base = t._base, local._base
            swap = base is not None and base is not local
            if local_base is not None and (local_base is not t or swap):
                return None
            if swap and tc.storage_address(base) != tc.storage_address(t):  # type: ignore[arg-type]
                return None
            del base, local_base
            storage = t.untyped_storage()
            if not pointer_valid(storage):
                return None
            key = storage_key(storage)
            if (key in seen or (not storage.resizable() and tc.torch_allocated(storage) is not True)
                    or (cpu and storage.is_shared()) or pool_of_storage(key) is not None
                    or tc.storage_address(local) != key):
                return None
            try:
                if tc.impl_is_meta(wrapper) or tc.storage_address(wrapper) == key:
                    return None  # a wrapper on the shard's storage (or meta) moves too
            except (RuntimeError, NotImplementedError, TypeError):
                return None
            seen.add(key)
            row = _Row(t, local, wrapper, key, storage)
            del storage
            row.holder = holder
            row.swap = swap
            if swap:
                row.grad = t.requires_grad and t.is_leaf
            numel = t.numel()
            if ((row.offset + numel) * dt.itemsize > row.storage.nbytes()  # type: ignore[union-attr]
                    or row.local_offset < row.offset
                    or row.local_offset + local.numel() > row.offset + numel):
                return None
            if spec.slice is not None:
                slc = spec.slice
                if (type(slc) is not Slice or slc.pool is not pool or slc.slice_id in given
                        or slc.dtype != dt or slc.nbytes != row.nbytes
                        or pool.registry.holds(slc.slice_id)):
                    return None
                given.add(slc.slice_id)
                row.slice = slc
            dtypes.add(dt)
            rows.append(row)
    if with_slice and not pool.all_live([r.slice.slice_id for r in rows],  # type: ignore[union-attr]
                                        [r.slice for r in rows]):  # type: ignore[misc]
        return None  # a freed or relocated handle: the general path names it
    for dt in dtypes:
        check_dtype(dt)
    return rows


def adopt_sharded(
    pool: PoolState, specs: list[AdoptSpec], txn: Transaction, on_pinned: OnPinned
) -> AdoptionReport | None:
    """Adopt ``specs`` in ``txn``; ``None`` (nothing done) when one needs the general path."""
    snap = txn.snapshot
    planned = snap is not None and snap.buffer is None and snap.buffer_key is None
    rows = _eligible(pool, specs, planned)
    if rows is None:
        return None
    moving = [x for r in rows for x in (r.t, r.local)]
    sets = [x for r in rows for x in ((r.local,) if r.swap else (r.t, r.local))]
    held = {id(t) for t in held_outside_python(sets, moving)}
    del moving, sets
    outside = {}
    for r in rows:
        found = [x for x in (r.t, r.local) if id(x) in held]
        if found:
            outside[r.key] = found
    return _adopt(pool, rows, txn, on_pinned, outside)


def _adopt(
    pool: PoolState, rows: list[_Row], txn: Transaction, on_pinned: OnPinned,
    outside: dict[int, list[torch.Tensor]],
) -> AdoptionReport:
    originals, nbytes = txn.originals, txn.nbytes
    for r in rows:
        assert r.storage is not None
        originals[r.key] = r.storage
        nbytes[r.key] = r.storage.nbytes()
        r.storage = None
    checkpoint("allocate")
    if rows[0].slice is None:
        slices = pool.allocate_many([(r.size, r.t.dtype) for r in rows])
    else:
        slices = [r.slice for r in rows]  # type: ignore[misc]
    target = pool.storage
    empty, dev, flags = torch.empty, pool.device, tc.copy_tensor_flags
    for first in range(0, len(rows), COPY_CHUNK):
        chunk = rows[first:first + COPY_CHUNK]
        placed = slices[first:first + COPY_CHUNK]
        with tc.no_torch_function():
            srcs = [r.t.detach() for r in chunk]
        checkpoint("rebind")
        journal: list[SetMove | ImplSwap] = []
        places: list[Place] = []
        swaps: list[tuple[torch.Tensor, torch.Tensor]] = []
        where: list[Placed] = []
        for r, slc in zip(chunk, placed):
            item = r.t.dtype.itemsize
            start = slc.offset // item
            if r.swap:  # fresh_like(), inline: the transaction is outside grad and inference
                fresh = empty(0, dtype=r.t.dtype, device=dev).set_(target, start, r.size, r.stride)
                if r.grad:
                    fresh.requires_grad_(True)
                flags(r.t, fresh)
                journal.append(ImplSwap(r.t, fresh, r.key, r.version, (r.offset, r.size, r.stride),
                                        r.t.dtype))
                swaps.append((r.t, fresh))
                del fresh
            else:
                journal.append(SetMove(r.t, r.key, r.offset, r.size, r.stride, r.version))
                places.append((r.t, target, start, r.size, r.stride))
            journal.append(SetMove(r.local, r.key, r.local_offset, r.local_size, r.local_stride,
                                   r.local_version))
            places.append((r.local, target, start + r.local_offset - r.offset, r.local_size,
                           r.local_stride))
            lo = slc.offset
            hi = lo + r.nbytes
            where.append((r.t, lo, hi))
            where.append((r.local, lo, hi))
        txn.journal.extend(journal)  # write-ahead: the records exist before the moves
        del journal
        place_many(places)
        swap_many(swaps)
        del places, swaps
        check_placed(pool, where)
        del where
        checkpoint("copy")
        copy_all([r.t for r in chunk], srcs)
        del srcs
    tc.set_versions([x for r in rows for x in (r.t, r.local)],
                    [v for r in rows for v in (r.version, r.local_version)])

    index = {r.key: i for i, r in enumerate(rows)}

    def name(key: int) -> str:
        return label(rows[index[key]].t, index[key])

    keys = [r.key for r in rows]
    pins = settle_pins(txn, keys, name, outside, on_pinned, lambda: [rows, *rows])
    keep_unreleased(pool, txn, name, pins, outside)
    pool.registry.bind_many((s.slice_id, _records(r)) for r, s in zip(rows, slices))
    expired, late = release(txn, name, pins, on_pinned)
    pinned = {index[k]: v for k, v in (*pins.items(), *late.items())}
    return AdoptionReport(ItemTable(slices, [nbytes[k] for k in keys],
                                    [expired[k] for k in keys], pinned, rebound=2))


def _records(r: _Row) -> list[Record]:
    """The general path's records for a spec of this shape: the shard (with its holder), then
    the local tensor (held by its wrapper's slot)."""
    dtype = r.t.dtype
    shift = (r.local_offset - r.offset) * dtype.itemsize
    # The local's record is make_record()'s tuple, inline: its holder's owner is the wrapper,
    # a tensor, which make_record() refers to by tensor_ref() as well.
    return [make_record(r.t, 0, r.size, r.stride, dtype, r.holder, True),
            (tensor_ref(r.local), shift, r.local_size, r.local_stride, dtype,
             tensor_ref(r.wrapper), _LOCAL, False, False)]


def is_sharded_batch(specs: Sequence[object]) -> bool:
    """Would :func:`sharded_specs` take ``specs`` (for tests and benchmarks)."""
    return sharded_specs(list(specs)) is not None


__all__ = ["adopt_sharded", "is_sharded_batch", "sharded_specs"]
