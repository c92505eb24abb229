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

from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, eq, floordiv

import torch

from .. import torch_compat as tc
from ..errors import PoolInvariantError
from ..registry import plain_ref
from ..requests import check_dtype
from ..slices import Slice
from ..state import PoolState, pool_index, pool_of_storage
from .copying import COPY_CHUNK, copy_all
from .faults import checkpoint
from .moves import SetMoves, place_many
from .proof import held_outside_python
from .settle import Outside, check_placed, keep_unreleased, release, settle_pins
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
    """What the lean path knows of a batch: one list per fact, in input order (no object per
    tensor). Shapes and strides are interned, so equal ones share one tuple."""

    __slots__ = ("tensors", "storages", "keys", "offsets", "sizes", "strides", "shapes",
                 "dtypes", "spans", "versions", "nbytes")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.storages: list[torch.UntypedStorage] = []
        self.keys: list[int] = []
        self.offsets: list[int] = []  # element offsets on the originals
        self.sizes: list[tuple[int, ...]] = []
        self.strides: list[tuple[int, ...]] = []
        self.shapes: list[tuple[int, ...]] = []  # of the slices: a strided one's is flat
        self.dtypes: list[torch.dtype] = []
        self.spans: list[int] = []  # bytes each needs in the pool
        self.versions: list[int] = []
        self.nbytes: list[int] = []  # bytes of each original storage


_Geometry = tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]
"""``(size, stride, span in elements, shape of the slice)``: a function of size and stride
only, so worked out once per distinct pair of a batch (and the pair's tuples shared)."""


def _geometry(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> _Geometry | None:
    if 0 in size:
        return None
    if t.is_contiguous():
        return size, stride, t.numel(), size
    span = 1
    for sz, st in zip(size, stride):
        if st < 0:
            return None
        span += (sz - 1) * st
    with tc.no_torch_function():
        if self_overlapping(t):
            return None  # the general path refuses it with the reason
    return size, stride, span, (span,)  # a strided original keeps its strides in a flat run


def _eligible(pool: PoolState, tensors: list[torch.Tensor]) -> _Batch | None:
    """Per-tensor facts, or ``None`` when any tensor needs the general path.

    The targets are exact ``torch.Tensor``/``nn.Parameter`` objects (:func:`plain_targets`):
    their attributes are torch's own, read straight from the TensorImpl (no subclass can
    override them), so the plain attribute reads are the TensorImpl reads, at C speed.
    """
    b = _Batch(tensors)
    device = pool.device
    cpu = device.type == "cpu"
    strided = torch.strided
    storage_key, pointer_valid = tc.storage_key, tc.storage_pointer_valid
    by_storage = pool_index()
    storage_offset = tc.impl_storage_offset
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], _Geometry] = {}
    add_storage, add_key, add_offset = b.storages.append, b.keys.append, b.offsets.append
    add_size, add_stride, add_dtype = b.sizes.append, b.strides.append, b.dtypes.append
    add_shape = b.shapes.append
    add_span, add_version, add_nbytes = b.spans.append, b.versions.append, b.nbytes.append
    dtypes: set[torch.dtype] = set()
    for t in tensors:
        if (not t.is_cpu if cpu else t.device != device) or t._base is not None:
            return None  # (a meta tensor is on neither)
        if t.layout is not strided or t.is_nested or t.is_quantized or t.is_inference():
            return None
        if t.is_conj() or t.is_neg():
            return None  # lazy conj/neg bits: the copy into itself would see them
        sz, stride = t.size(), t.stride()
        geo = known.get((sz, stride))
        if geo is None:
            geo = _geometry(t, tuple(sz), stride)
            if geo is None:
                return None
            known[geo[0], geo[1]] = geo
        size, stride, span, shape = geo
        storage = t.untyped_storage()
        if not pointer_valid(storage):
            return None  # a C++ functional tensor's placeholder: validate() names it
        key = storage_key(storage)
        if ((not storage.resizable() and tc.torch_allocated(storage) is not True)
                or (cpu and storage.is_shared())
                or (key in by_storage and pool_of_storage(key) is not None)):
            return None  # shared or external memory: the general path reports it external
        dtype = t.dtype
        offset = storage_offset(t)
        nbytes = storage.nbytes()
        item = dtype.itemsize
        if (offset + span) * item > nbytes:
            return None
        dtypes.add(dtype)
        add_storage(storage)
        add_key(key)
        add_offset(offset)
        add_size(size)
        add_stride(stride)
        add_shape(shape)
        add_dtype(dtype)
        add_span(span * item)
        add_version(t._version)
        add_nbytes(nbytes)
    if len(set(b.keys)) != len(b.keys):
        return None  # two targets share a storage
    for dtype in dtypes:
        check_dtype(dtype)
    return b


def adopt_plain(
    pool: PoolState, tensors: list[torch.Tensor], txn: Transaction, on_pinned: OnPinned
) -> AdoptionReport | None:
    """Adopt plain tensors in ``txn``; ``None`` (nothing done) when one needs the general path."""
    batch = _eligible(pool, tensors)
    if batch is None:
        return None
    # Only a tensor whose impl has another owner can be held outside Python (no views here).
    users = tc.tensor_impl_users
    maybe = [t for t in tensors if users(t) > 1]
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
    txn.originals.update(zip(keys, b.storages))
    txn.nbytes.update(zip(keys, b.nbytes))
    b.storages = []  # the transaction holds them now: its counts must see no other holder
    checkpoint("allocate")
    slices, starts = pool.allocate_spans(b.spans, b.shapes, b.dtypes)
    b.spans, b.shapes = [], []  # placed: not kept through the rest of the batch (peak heap)
    target = pool.storage
    key = pool.storage_key
    # In chunks, so a batch of thousands never holds all its source aliases at once: journal
    # the moves (write-ahead), move, check where each tensor landed, then copy into it from an
    # alias that still reads the original.
    journal = txn.journal
    for first in range(0, len(tensors), COPY_CHUNK):
        last = first + COPY_CHUNK
        chunk = tensors[first:last]
        with tc.no_torch_function():
            srcs = [t.detach() for t in chunk]
        checkpoint("rebind")
        sizes, strides = b.sizes[first:last], b.strides[first:last]
        places = list(map(floordiv, starts[first:last], map(_itemsize, b.dtypes[first:last])))
        # write-ahead, as columns over the batch's own lists: no record object per tensor
        journal.append(SetMoves(tensors, keys, b.offsets, b.sizes, b.strides, b.versions,
                                first, last))
        place_many(zip(chunk, repeat(target), places, sizes, strides))  # element offsets
        _check_moved(pool, key, chunk, places, sizes, strides, slices[first:last])
        checkpoint("copy")
        copy_all(chunk, srcs)
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
    pool.registry.bind_run([s.slice_id for s in slices], list(map(plain_ref, tensors)),
                           b.sizes, b.strides, b.dtypes)
    nbytes = b.nbytes
    expired, late = release(txn, name, pins, on_pinned)
    pinned = {at(k): v for k, v in (*pins.items(), *late.items())}
    return AdoptionReport(ItemTable(slices, nbytes, list(map(expired.__getitem__, keys)), pinned))


def _check_moved(
    pool: PoolState, key: int | None, tensors: list[torch.Tensor], places: list[int],
    sizes: list[tuple[int, ...]], strides: list[tuple[int, ...]], slices: Sequence[Slice],
) -> None:
    """:func:`check_placed` for exact tensors ``set_`` by this path: read back from each
    TensorImpl that it sits on the pool's storage at its place, with its size and stride (which
    fix its extent inside its slice); any difference gets check_placed's full verdict."""
    pool.check_invariants()
    with tc.no_torch_function():  # one C-level pass per read over the chunk just moved
        if not (all(map(eq, map(tc.storage_address, tensors), repeat(key)))
                and list(map(tc.impl_storage_offset, tensors)) == places
                and list(map(tc.impl_size, tensors)) == sizes
                and list(map(tc.impl_stride, tensors)) == strides):
            check_placed(pool, [(t, s.offset, s.end) for t, s in zip(tensors, slices)])
            raise PoolInvariantError(  # the geometry is in bounds, yet not what was asked
                f"a tensor moved into pool {pool.name!r} does not sit where it was placed: "
                "nothing was changed")


__all__ = ["adopt_plain", "plain_targets"]
