"""``FlatPool.is_valid()`` at pointer speed: C-level passes over what the full check last read.

The full check (:func:`.readopt.moved`) resolves every binding through its record (a weak
reference, or the holder's owner and key) and compares storage key, offset, shape, stride and
dtype, in Python bytecode per binding. When it finds nothing moved, :func:`remember` keeps, as
flat lists, how to find each bound object again and what it read of it: data pointer, shape,
stride and dtype (an empty tensor, whose pointer is 0 anywhere, is judged by storage key and
offset). :func:`still_in_place` repeats those reads as ``map`` passes compared with
``all(map(eq, ...))``: no bytecode per binding, no list of results (which would cost
garbage-collector passes). A non-empty tensor is judged by its data pointer: inside the pool's
live storage no other allocation owns an address, and a tensor there aliases its slice.

Where it can run, one vectorized read of every bound object's TensorImpl (storage key,
offset, sizes, strides, dtype word: :func:`flatpool.torch_compat.impl_unchanged`) replaces the
four passes. The same read applies :class:`~flatpool.registry.ParamRef`'s rule (held by
nothing but the pool) to every parameter bound without a holder, from the Python and impl
reference counts, instead of a Python call per reference; one that reads dead, or counts that
cannot be read, send the check to the references' calls and the full rules (which drop it).
Those parameters are found without a Python call each: every reference's slot word is read at
once (:func:`flatpool.torch_compat.slot_unchanged`; the references are kept alive by these
lists), their counts are then exact, and the impl words' gather indices are computed once here,
read only after the impls compared equal.

The lists are trusted only for the registry version and the pool's live-slices version (each
bumped before every change) and the storage they were made for; any difference, a binding gone
or no longer readable answers ``None``, and the full check decides (and remembers again). Bindings whose object is
gone for good (a dead weak reference) are left out; a holder that may hold a tensor again later
(its owner alive, the place empty) keeps every check on the full path.
"""

from __future__ import annotations

import operator
import weakref
from itertools import chain, repeat
from collections.abc import Callable
from typing import Any

import torch
from attrs import define

from .. import torch_compat as tc
from ..registry import REF_CLASSES, ParamRef, Ref, current, held_param
from ..slices import Slice
from ..state import PoolState

_eq, _is = operator.eq, operator.is_
_call: Callable[[Ref], Any] = getattr(operator, "call", None) or (lambda f: f())
_UNREADABLE = (AttributeError, TypeError, IndexError, KeyError, RuntimeError)


@define(frozen=True, eq=False)
class PoolReads:
    """What the full check read of every binding of one pool, as lists in one order: the
    unheld bindings (``refs``), those found through an attribute, through an item, then the
    parameters' (``params``: last, so that a read through their slots can append them)."""

    version: int
    live: int
    """The pool's :attr:`~flatpool.state.PoolState.live_version` then: equal now, every slice
    read is still the live handle of its id (one compare, not one per slice)."""
    key: int
    base: int
    slice_ids: list[int]
    slices: list[Slice]
    refs: list[Ref]
    params: list[ParamRef]
    """A parameter's reference answers ``None`` once its model dropped it, which the full check
    judges: called in the per-field passes, its rule read from reference counts in the
    vectorized one."""
    attr_owners: list[Ref]
    attr_keys: list[Any]
    item_owners: list[Ref]
    item_keys: list[Any]
    ptrs: list[int]
    sizes: list[torch.Size]
    strides: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    empty: list[tuple[int, int]]
    """``(position, byte offset in the storage)`` of the empty tensors."""
    raw: tc.ImplSnapshot | None = None
    """The same objects' impl words (storage key, offset, sizes, strides, dtype), compared in
    one vectorized read when it can run (:func:`flatpool.torch_compat.impl_unchanged`)."""
    slotted: tc.SlotSnapshot | None = None
    """``raw`` with the parameters read through their ``ParamRef`` slots and every gather
    index precomputed (:func:`flatpool.torch_compat.slot_unchanged`): no Python call per
    parameter, no index arithmetic per call."""


_SLOT = tc.slot_word(ParamRef, "_obj")
"""The word of a :class:`ParamRef` holding its parameter, or ``None`` (slot reads off)."""
_SLOTTED = frozenset(c for c in REF_CLASSES if _SLOT is not None and tc.slot_word(c, "_obj") == _SLOT)
"""The reference classes whose held object sits in that same word (``TensorRef`` adds no slot)."""

_kept: weakref.WeakKeyDictionary[PoolState, PoolReads] = weakref.WeakKeyDictionary()


def _gone_for_good(ref: Ref) -> bool:
    return isinstance(ref, (weakref.ref, ParamRef)) and ref() is None


def remember(pool: PoolState) -> None:
    """Keep what the full check read; call under ``pool.lock`` right after it found nothing
    moved."""
    key, base, live = pool.storage_key, pool.base_address, pool.live_version
    _kept.pop(pool, None)
    if key is None or base is None:
        return
    ids: list[int] = []
    slices: list[Slice] = []
    refs: list[Ref] = []
    params: list[ParamRef] = []
    attrs: tuple[list[Ref], list[Any]] = ([], [])
    items: tuple[list[Ref], list[Any]] = ([], [])
    objs: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    at: tuple[list[int], ...] = ([], [], [], [])
    for slice_id, records in pool.registry.items():
        slc = pool.live_slice(slice_id)
        if slc is None:
            continue
        ids.append(slice_id)
        slices.append(slc)
        for rec in records:
            ref = rec[0] if rec[5] is None else rec[5]
            obj = current(rec)
            if obj is None:
                if _gone_for_good(ref):
                    continue
                return  # a place that is empty now may hold a tensor again: full checks only
            kind = 0 if rec[5] is None else (2 if rec[7] else 1)
            if kind == 0 and isinstance(ref, ParamRef):
                kind = 3
                params.append(ref)
            elif kind == 0:
                refs.append(ref)
            else:
                (items if kind == 2 else attrs)[0].append(ref)
                (items if kind == 2 else attrs)[1].append(rec[6])
            objs[kind].append(obj)
            at[kind].append(slc.offset + rec[1])
    every = objs[0] + objs[1] + objs[2] + objs[3]
    where = at[0] + at[1] + at[2] + at[3]
    distinct = len(set(map(id, every))) == len(every)  # (one slot per parameter: counts exact)
    with tc.no_torch_function():
        ptrs = list(map(tc.impl_data_ptr, every))
        on_pool = all(map(operator.eq, map(tc.storage_address, every), repeat(key)))
        raw = tc.impl_snapshot(every, strides=True) if on_pool and distinct else None
        _kept[pool] = PoolReads(
            version=pool.registry.version, live=live, key=key, base=base, slice_ids=ids, slices=slices,
            refs=refs, params=params, attr_owners=attrs[0], attr_keys=attrs[1], item_owners=items[0],
            item_keys=items[1], ptrs=ptrs, sizes=list(map(tc.impl_size, every)),
            strides=list(map(tc.impl_stride, every)), dtypes=list(map(tc.impl_dtype_of, every)),
            empty=[(i, w) for i, (p, w) in enumerate(zip(ptrs, where)) if p == 0],
            raw=raw, slotted=None if raw is None or _SLOT is None or not params or not (
                set(map(type, params)) <= _SLOTTED)  # (the classes the slot was probed on)
            else tc.slot_snapshot(raw, params, _SLOT))


def _each(r: PoolReads, call_params: bool | None = True) -> Any:
    """The bound objects now, in the lists' order, lazily (a C-level chain of maps); the
    parameters as their references hold them unless ``call_params``, none if ``None``."""
    held = (map(_call, r.refs), map(getattr, map(_call, r.attr_owners), r.attr_keys),
            map(operator.getitem, map(_call, r.item_owners), r.item_keys))
    if call_params is None:
        return chain(*held)
    return chain(*held, map(_call if call_params else held_param, r.params))


def _objects(r: PoolReads) -> list[torch.Tensor]:
    return list(_each(r))


def still_in_place(pool: PoolState) -> bool | None:
    """``True`` when every binding reads as when the full check last passed; ``None`` when
    something differs or changed (the full check then decides)."""
    r = _kept.get(pool)
    if r is None:
        return None
    with pool.lock:
        if (pool.registry.version != r.version or pool.storage_key != r.key
                or pool.base_address != r.base or pool.live_version != r.live):
            return None
        with tc.no_torch_function():
            try:
                fast = None
                if r.slotted is not None:  # the parameters through their slots
                    n = len(r.ptrs) - len(r.params)
                    fast = tc.slot_unchanged(_each(r, None), n, r.slotted)
                if fast is None and r.raw is not None:  # one vectorized read, when it can run
                    a, counts = len(r.ptrs) - len(r.params), tc.counts_readable()  # (else: call)
                    fast = tc.impl_unchanged(_each(r, not counts), len(r.ptrs), r.raw,
                                             (a, len(r.ptrs)) if counts else (0, 0))
                if fast is not None:
                    return True if fast else None
                objs = _objects(r)
                if len(objs) != len(r.ptrs):
                    return None
                if not (all(map(_eq, map(tc.impl_data_ptr, objs), r.ptrs))
                        and all(map(_eq, map(tc.impl_size, objs), r.sizes))
                        and all(map(_eq, map(tc.impl_stride, objs), r.strides))
                        and all(map(_is, map(tc.impl_dtype_of, objs), r.dtypes))):
                    return None
                for i, byte in r.empty:
                    t = objs[i]
                    if (tc.storage_address(t) != r.key
                            or tc.impl_storage_offset(t) * r.dtypes[i].itemsize != byte):
                        return None
            except _UNREADABLE:
                return None
    return True


__all__ = ["PoolReads", "remember", "still_in_place"]
