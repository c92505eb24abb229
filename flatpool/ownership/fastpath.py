"""The lean adoption path for the common batch: plain tensors and parameters, nothing else.

Eligible: every target is an exact ``torch.Tensor`` or ``nn.Parameter`` (no subclass, no
views, holders or slice named), not an autograd view, with a storage of its own (no two
targets share one) owned by torch's allocator. Everything a sharded trainer adopts at start-up
looks like that. The path keeps every guarantee of the general one (validation, real slices,
journaled in-place moves, the invariant check, use-count pre-check, weak-reference proof,
registry) and drops the per-tensor objects the general path needs for views and holders:

* one flat validation loop over TensorImpl reads, no plan objects;
* the slices are placed in one step;
* the tensors are moved first, then copied *into themselves* from detached aliases of their
  originals (one ``_foreach_copy_``, small copies threaded), so no byte view is made;
* registry entries are plain tuples.

Anything unusual sends the whole batch to the general path before anything has changed, and
that path raises the precise error for a bad input.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import partial
from operator import add, attrgetter, floordiv, le, mul

import torch

from .. import torch_compat as tc
from ..requests import check_dtype
from ..slice_index import SliceRun
from ..slices import Slice
from ..state import PoolState, pool_index, pool_of_storage
from .columns import Interned
from .copying import COPY_CHUNK, copy_all
from .faults import checkpoint
from .moves import SetMoves, place_columns
from .proof import held_outside_python
from .settle import Outside, Placed, check_moved, keep_unreleased, release, settle_pins
from .spec import AdoptionReport, AdoptSpec, ItemTable, OnPinned
from .transaction import Transaction
from .validate import label, self_overlapping

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)


def plain_targets(targets: object) -> list[torch.Tensor] | None:
    """The tensors of ``targets`` when each is an exact tensor or parameter (or a bare spec of
    one), else ``None``: the lean path's batches, told apart before any spec is built."""
    items = [targets] if isinstance(targets, (torch.Tensor, AdoptSpec)) else targets
    if not isinstance(items, (list, tuple)) or not items:
        return None
    if set(map(type, items)) <= _PLAIN_TYPES:  # the common batch: one C-level pass
        return list(items)
    out = []
    for x in items:
        if isinstance(x, AdoptSpec):
            if x.views or x.holders or x.slice is not None:
                return None
            x = x.tensor
        if type(x) not in _PLAIN:
            return None
        out.append(x)
    return out


_itemsize = attrgetter("itemsize")


class _Batch:
    """What the lean path knows of a batch: one column per fact, in input order (no object per
    tensor). Shapes and strides are interned, so equal ones share one tuple; the integers are
    ``array('q')`` columns (8 B a tensor, not a list slot and an int object's 36)."""

    __slots__ = ("tensors", "storages", "keys", "offsets", "sizes", "strides", "shapes",
                 "dtypes", "spans", "versions", "nbytes")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.storages: list[torch.UntypedStorage] = []
        self.keys = array("q")
        self.offsets = array("q")  # element offsets on the originals
        self.sizes: list[tuple[int, ...]] = []
        self.strides: list[tuple[int, ...]] = []
        self.shapes: list[tuple[int, ...]] = []  # of the slices: a strided one's is flat
        self.dtypes: list[torch.dtype] = []
        self.spans = array("q")  # bytes each needs in the pool
        self.versions = array("q")
        self.nbytes = array("q")  # bytes of each original storage


_is_inference, _is_conj, _is_neg = tc.impl_is_inference, tc.impl_is_conj, tc.impl_is_neg
_size, _stride, _numel, _contiguous = tc.impl_size, tc.impl_stride, tc.impl_numel, tc.impl_is_contiguous
_storage_of, _dtype_of = tc.impl_untyped_storage, tc.impl_dtype_of
_version_of = attrgetter("_version")  # (exact tensors: torch's own descriptor, at C speed)
_data_ptr, _nbytes, _detach = tc.storage_data_ptr, tc.storage_nbytes, tc.impl_detach
_resizable, _is_shared, _key_of = tc.storage_resizable, tc.storage_is_shared, tc.storage_key_of
_PLAIN_FLAGS = (None, torch.strided, False, False)
"""``(_base, layout, is_nested, is_quantized)`` of a tensor the lean path takes."""


def _eligible(pool: PoolState, tensors: list[torch.Tensor]) -> _Batch | None:
    """Per-tensor facts, or ``None`` when any tensor needs the general path.

    The targets are exact ``torch.Tensor``/``nn.Parameter`` objects (:func:`plain_targets`):
    their attributes are torch's own, read straight from the TensorImpl (no subclass can
    override them). Each fact is one C-level ``map`` pass over a chunk of the batch (the chunk's
    objects stay in cache from one pass to the next; whole-batch passes did not): no bytecode
    per tensor on the common batch, only for the rare strided or non-resizable one.
    """
    b = _Batch(tensors)
    device = pool.device
    cpu = device.type == "cpu"
    flags = attrgetter("is_cpu" if cpu else "device", "_base", "layout", "is_nested",
                       "is_quantized")
    plain = {(True if cpu else device, *_PLAIN_FLAGS)}
    by_storage = pool_index()
    interned = Interned()
    intern = interned.__getitem__
    dtypes: set[torch.dtype] = set()
    for first in range(0, len(tensors), COPY_CHUNK):
        chunk = tensors[first:first + COPY_CHUNK]
        if set(map(flags, chunk)) != plain:
            return None  # another device (a meta tensor is on none), a view, sparse, nested...
        if any(map(_is_inference, chunk)) or any(map(_is_conj, chunk)) or any(map(_is_neg, chunk)):
            return None  # lazy conj/neg bits: the copy into itself would see them
        numels = list(map(_numel, chunk))
        if not all(numels):
            return None  # empty tensors stay off the pool: the general path says so
        sizes = list(map(intern, map(_size, chunk)))
        strides = list(map(intern, map(_stride, chunk)))
        shapes, spans = sizes, numels  # of the slices, in elements
        if not all(map(_contiguous, chunk)):
            shapes, spans = list(sizes), list(numels)
            for i, t in enumerate(chunk):
                if not _contiguous(t):
                    geo = _strided(t, sizes[i], strides[i])
                    if geo is None:
                        return None
                    spans[i], shapes[i] = geo
        storages = list(map(_storage_of, chunk))
        try:
            if not all(map(_data_ptr, storages)):
                return None  # (no tensor here is empty: a null pointer is a placeholder)
        except tc.UNREADABLE_STORAGE:
            return None  # a C++ functional tensor's placeholder: validate() names it
        if not all(map(_resizable, storages)):
            return None  # external memory: the general path reports it external
        if cpu and any(map(_is_shared, storages)):
            return None  # shared memory: another process may map it
        keys = list(map(_key_of, storages))
        if any(map(by_storage.__contains__, keys)) and any(
                pool_of_storage(k) is not None for k in keys):
            return None  # a pool's storage
        chunk_dtypes = list(map(_dtype_of, chunk))
        items = list(map(_itemsize, chunk_dtypes))
        offsets = list(map(tc.impl_storage_offset, chunk))
        nbytes = list(map(_nbytes, storages))
        if not all(map(le, map(mul, map(add, offsets, spans), items), nbytes)):
            return None  # reaches past its storage: the general path names it
        dtypes.update(chunk_dtypes)
        b.storages += storages
        b.keys.extend(keys)
        b.offsets.extend(offsets)
        b.sizes += sizes
        b.strides += strides
        b.shapes += shapes
        b.dtypes += chunk_dtypes
        b.spans.extend(map(mul, spans, items))
        b.versions.extend(map(_version_of, chunk))
        b.nbytes.extend(nbytes)
        del storages
    if _has_duplicates(b.keys):
        return None  # two targets share a storage
    if b.shapes == b.sizes:  # (every original contiguous: the slices' shapes are its sizes)
        b.shapes = b.sizes  # one list kept by the pool's index and the registry, not two
    for dtype in dtypes:
        check_dtype(dtype)
    return b


def _has_duplicates(keys: array[int]) -> bool:
    """Some key appears twice: ``torch.unique`` over the column itself (16 B a key in torch's
    allocator, briefly), where a set of int objects cost ~85 B a key and was the batch's
    Python heap peak."""
    if not keys:
        return False
    distinct = torch.frombuffer(keys, dtype=torch.int64).unique()  # type: ignore[no-untyped-call]
    return int(distinct.numel()) != len(keys)


def _strided(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...],
             ) -> tuple[int, tuple[int, ...]] | None:
    """``(span in elements, shape of the slice)`` of a non-contiguous original (kept with its
    strides in a flat run), or ``None`` for one the lean path does not take."""
    span = 1
    for sz, st in zip(size, stride):
        if st < 0:
            return None
        span += (sz - 1) * st
    with tc.no_torch_function():
        if self_overlapping(t):
            return None  # the general path refuses it with the reason
    return span, (span,)


def adopt_plain(
    pool: PoolState, tensors: list[torch.Tensor], txn: Transaction, on_pinned: OnPinned
) -> AdoptionReport | None:
    """Adopt plain tensors in ``txn``; ``None`` (nothing done) when one needs the general path."""
    batch = _eligible(pool, tensors)
    if batch is None:
        return None
    # Only a tensor whose impl has another owner can be held outside Python (no views here).
    users = tc.impl_use_count
    maybe = [t for t in tensors if users(t) > 1] if max(map(users, tensors)) > 1 else []
    held = held_outside_python(maybe) if maybe else []
    outside: Outside = {}
    if held:
        ids = {id(t) for t in held}
        outside = {k: [t] for k, t in zip(batch.keys, tensors) if id(t) in ids}
    del maybe, held
    return _adopt(pool, batch, txn, on_pinned, outside)


def _adopt(
    pool: PoolState, b: _Batch, txn: Transaction, on_pinned: OnPinned, outside: Outside
) -> AdoptionReport:
    keys, tensors = b.keys, b.tensors
    txn.originals.add_columns(keys, b.storages)
    txn.nbytes.add_columns(keys, b.nbytes)
    b.storages = []  # the transaction holds them now: its counts must see no other holder
    checkpoint("allocate")
    slices, starts = pool.allocate_spans(b.spans, b.shapes, b.dtypes)
    b.shapes = []  # placed: not kept through the rest of the batch (peak heap)
    target = pool.storage
    # In chunks, so a batch of thousands never holds all its source aliases at once: journal
    # the moves (write-ahead), move, check where each tensor landed, then copy into it from an
    # alias that still reads the original.
    journal = txn.journal
    for first in range(0, len(tensors), COPY_CHUNK):
        last = first + COPY_CHUNK
        chunk = tensors[first:last]
        with tc.no_torch_function():
            srcs = list(map(_detach, chunk))
        checkpoint("rebind")
        sizes, strides = b.sizes[first:last], b.strides[first:last]
        places = list(map(floordiv, starts[first:last], map(_itemsize, b.dtypes[first:last])))
        # write-ahead, as columns over the batch's own lists: no record object per tensor
        journal.append(SetMoves(tensors, keys, b.offsets, b.sizes, b.strides, b.versions,
                                first, last))
        place_columns(chunk, target, places, sizes, strides)  # element offsets
        check_moved(pool, chunk, places, sizes, strides, partial(_bounds, chunk, slices, first))
        checkpoint("copy")
        copy_all(chunk, srcs, threaded=False)  # (see copy_all)
        del srcs
    tc.set_versions(tensors, b.versions)

    index: dict[int, int] = {}

    def at(k: int) -> int:  # built only when an original is named (pinned, late)
        if not index:
            index.update((k, i) for i, k in enumerate(keys))
        return index[k]

    def name(k: int) -> str:
        return label(tensors[at(k)], at(k))

    pins = settle_pins(txn, keys, name, outside, on_pinned, lambda: [b, tensors])
    keep_unreleased(pool, txn, name, pins, outside)
    # One run of columns, not a record per tensor: records are built when someone asks.
    ids = slices.ids if isinstance(slices, SliceRun) else [s.slice_id for s in slices]
    pool.registry.bind_run(ids, tensors, b.sizes, b.strides, b.dtypes)
    nbytes = b.nbytes
    expired, late = release(txn, name, pins, on_pinned)
    pinned = {at(k): v for k, v in (*pins.items(), *late.items())}
    # Keyed by the batch's own key column (Originals.add_columns): the flags are in batch order.
    released = (expired.in_order() if expired.key_list() is keys
                else bytes(map(expired.__getitem__, keys)))
    return AdoptionReport(ItemTable(slices, nbytes, released, pinned))


def _bounds(tensors: list[torch.Tensor], slices: Sequence[Slice], first: int) -> list[Placed]:
    """Each tensor's slice bounds (a run's handles made only here: a failed check)."""
    mine = slices[first:first + len(tensors)]
    return [(t, s.offset, s.end) for t, s in zip(tensors, mine)]


__all__ = ["adopt_plain", "plain_targets"]
