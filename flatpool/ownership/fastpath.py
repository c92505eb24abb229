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

import weakref
from collections.abc import Sequence

import torch

from .. import torch_compat as tc
from ..requests import check_dtype
from ..state import PoolState, pool_of_storage
from .copying import COPY_CHUNK, copy_all
from .faults import checkpoint
from .moves import SetMove, place_many
from .proof import held_outside_python
from .settle import Outside, check_placed, keep_unreleased, release, settle_pins
from .spec import AdoptionReport, AdoptSpec, ItemTable, OnPinned
from .transaction import Transaction
from .validate import label, self_overlapping

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_targets(targets: object) -> list[torch.Tensor] | None:
    """The tensors of ``targets`` when each is an exact tensor or parameter (or a bare spec of
    one), else ``None``: the lean path's batches, told apart before any spec is built."""
    items = [targets] if isinstance(targets, (torch.Tensor, AdoptSpec)) else targets
    if not isinstance(items, (list, tuple)) or not items:
        return None
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


class _Item:
    """What the lean path knows of one tensor (a slotted object: thousands are made)."""

    __slots__ = ("t", "key", "storage", "offset", "size", "stride", "dtype", "shape", "version")

    def __init__(
        self, t: torch.Tensor, key: int, storage: torch.UntypedStorage, offset: int,
        size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
        shape: tuple[int, ...], version: int,
    ) -> None:
        self.t, self.key, self.offset, self.size, self.stride = t, key, offset, size, stride
        self.storage: torch.UntypedStorage | None = storage
        self.dtype, self.shape, self.version = dtype, shape, version


def _eligible(pool: PoolState, tensors: list[torch.Tensor]) -> list[_Item] | None:
    """Per-tensor facts, or ``None`` when any tensor needs the general path.

    The targets are exact ``torch.Tensor``/``nn.Parameter`` objects (:func:`plain_targets`):
    their attributes are torch's own, read straight from the TensorImpl (no subclass can
    override them), so the plain attribute reads are the TensorImpl reads, at C speed.
    """
    items: list[_Item] = []
    seen: set[int] = set()
    device = pool.device
    cpu = device.type == "cpu"
    strided = torch.strided
    storage_key, pointer_valid = tc.storage_key, tc.storage_pointer_valid
    for t in tensors:
        if (not t.is_cpu if cpu else t.device != device) or t._base is not None:
            return None  # (a meta tensor is on neither)
        if t.layout is not strided or t.is_nested or t.is_quantized or t.is_inference():
            return None
        if tc.has_math_bits(t):
            return None  # lazy conj/neg bits: the copy into itself would see them
        size, stride = tuple(t.size()), t.stride()
        if 0 in size:
            return None
        storage = t.untyped_storage()
        if not pointer_valid(storage):
            return None  # a C++ functional tensor's placeholder: validate() names it
        key = storage_key(storage)
        if (key in seen or (not storage.resizable() and tc.torch_allocated(storage) is not True)
                or (cpu and storage.is_shared()) or pool_of_storage(key) is not None):
            return None  # shared or external memory: the general path reports it external
        seen.add(key)
        dtype = t.dtype
        offset = int(t.storage_offset())
        if t.is_contiguous():
            span, shape = t.numel(), size
        else:
            span = 1
            for sz, st in zip(size, stride):
                if st < 0:
                    return None
                span += (sz - 1) * st
            with tc.no_torch_function():
                if self_overlapping(t):
                    return None  # the general path refuses it with the reason
            shape = (span,)  # a strided original keeps its strides in a flat run
        if (offset + span) * dtype.itemsize > storage.nbytes():
            return None
        items.append(_Item(t, key, storage, offset, size, stride, dtype, shape, t._version))
    for it in items:
        check_dtype(it.dtype)
    return items


def adopt_plain(
    pool: PoolState, tensors: list[torch.Tensor], txn: Transaction, on_pinned: OnPinned
) -> AdoptionReport | None:
    """Adopt plain tensors in ``txn``; ``None`` (nothing done) when one needs the general path."""
    items = _eligible(pool, tensors)
    if items is None:
        return None
    held = {id(t) for t in held_outside_python([it.t for it in items])}
    outside = {it.key: [it.t] for it in items if id(it.t) in held}
    return _adopt(pool, items, txn, on_pinned, outside)


def _adopt(
    pool: PoolState, items: list[_Item], txn: Transaction, on_pinned: OnPinned, outside: Outside
) -> AdoptionReport:
    originals = txn.originals
    for it in items:
        assert it.storage is not None
        originals[it.key] = it.storage
        txn.nbytes[it.key] = it.storage.nbytes()
        it.storage = None
    checkpoint("allocate")
    slices = pool.allocate_many([(it.shape, it.dtype) for it in items])
    target = pool.storage
    tensors = [it.t for it in items]
    # In chunks, so a batch of thousands never holds all its source aliases at once: journal
    # the moves (write-ahead), move, check where each tensor landed, then copy into it from an
    # alias that still reads the original.
    for first in range(0, len(items), COPY_CHUNK):
        chunk = items[first:first + COPY_CHUNK]
        placed = slices[first:first + COPY_CHUNK]
        with tc.no_torch_function():
            srcs = [it.t.detach() for it in chunk]
        checkpoint("rebind")
        txn.journal.extend(
            SetMove(it.t, it.key, it.offset, it.size, it.stride, it.version) for it in chunk)
        place_many((it.t, target, slc.offset // it.dtype.itemsize, it.size, it.stride)
                   for it, slc in zip(chunk, placed))
        check_placed(pool, [(it.t, slc.offset, slc.end) for it, slc in zip(chunk, placed)])
        checkpoint("copy")
        copy_all([it.t for it in chunk], srcs)
        del srcs
    tc.set_versions(tensors, [it.version for it in items])

    index = {it.key: i for i, it in enumerate(items)}

    def name(key: int) -> str:
        return label(tensors[index[key]], index[key])

    keys = [it.key for it in items]
    pins = settle_pins(txn, keys, name, outside, on_pinned, lambda: [items, tensors])
    keep_unreleased(pool, txn, name, pins, outside)
    ref = weakref.ref
    pool.registry.bind_many(  # make_record()'s tuples, inline: one per tensor of the batch
        (s.slice_id, [(ref(it.t), 0, it.size, it.stride, it.dtype, None, None, False, True)])
        for it, s in zip(items, slices)
    )
    nbytes = txn.nbytes
    expired, late = release(txn, name, pins, on_pinned)
    pinned = {index[k]: v for k, v in (*pins.items(), *late.items())}
    return AdoptionReport(ItemTable(slices, [nbytes[k] for k in keys],
                                    [expired[k] for k in keys], pinned))


__all__ = ["adopt_plain", "plain_targets"]
