"""The per-step validity check at pointer speed: C-level passes over arrays of what was read.

The full rules (:func:`.validity.is_valid`'s member loop) run a few microseconds of Python
bytecode per member. Once they pass, :func:`remember` keeps per bucket, as flat lists, what
they read: the pool's live-slices version, each member's data pointer and shape of its padded
data and of its local tensor, its wrapper's type, and for a wrapper with memory of its own its
storage key, element offset and shape; for a storage-less wrapper (torch's DTensor) its identity, impl and
placeholder storage key (the verdict :class:`.wrappers.WrapperKinds` remembers).
:func:`still_valid` reads the same things again, each read one ``map`` over the members checked
with ``all(map(eq, ...))``: the loop runs in C and builds no list of results (10,000
``torch.Size`` objects alive at once would cost a garbage-collector pass every 700).

Where it can run, the data, local tensors and wrappers of a bucket are instead read in one
vectorized pass over their TensorImpls (:func:`flatpool.torch_compat.impl_same`: impl
pointer, storage key, element offset, sizes and dtype word, compared word for word with what
was read when the rules passed, a word at a time over all members; for wrapped members the
objects' addresses too, so the storage-less wrappers are the ones remembered). The members'
tensors are taken in one attribute pass (wrapped members: data, local tensor and wrapper,
member after member). The slices are judged by the pool's live-slices version (one compare:
a slice freed, or freed and allocated again, bumps it). The lists above serve when the read
cannot run (no layout found at import, another thread alive, a tensor type with a sizes policy
of its own). Equal words say more than the rules ask: the same storage (the live pool's: no
other can have its address), the same element offset and dtype (so the same data pointer), the
same shape.

Equal reads are the full rules' verdict again, the empty-shard and wrapper rules included: a
non-empty tensor is judged by its data pointer (inside the live pool's storage no other
allocation owns the address), an empty one (pointer 0) by storage key and element offset.
Anything different, or a member that can no longer be read so, answers ``None``: the caller
runs the full rules, which decide (and remember again when they pass).
"""

from __future__ import annotations

import operator
from itertools import chain, repeat
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from attrs import define

from flatpool import torch_compat as tc

from .group import GroupBuffers
from .layout import Bucket
from .members import PLAIN
from .protocol import ShardedParam

_eq, _is = operator.eq, operator.is_
_data = operator.attrgetter("_sharded_param_data")
_wrapper = operator.attrgetter("sharded_param")
_local = operator.attrgetter("_local_tensor")
_WRAPPED_READ = operator.attrgetter("_sharded_param_data", "sharded_param._local_tensor",
                                    "sharded_param")


def _plain_tensors(ps: Sequence[Any]) -> Iterable[Any]:
    """The data of every member, then every parameter (its own local tensor)."""
    return chain(map(_data, ps), map(_wrapper, ps))


def _wrapped_tensors(ps: Sequence[Any]) -> Iterable[Any]:
    """Data, local tensor and wrapper, member after member: one pass touches each member's
    objects once (on 10,000 FSDP2 members three passes cost a third more or worse, the
    objects being out of cache by the next pass; for plain members, whose objects stay in
    cache, the tuple a member costs more than the second pass)."""
    return chain.from_iterable(map(_WRAPPED_READ, ps))


_UNREADABLE = (AttributeError, TypeError, IndexError, KeyError, RuntimeError)
"""What reading a changed member may raise (a non-tensor where a tensor was): not valid here."""


@define(frozen=True, eq=False)
class Reads:
    """What the full rules read of one tensor per member when they last passed."""

    ptrs: list[int]
    sizes: list[torch.Size]
    empty: list[tuple[int, int]]
    """``(position, element offset)`` of the empty tensors: judged by storage key and offset."""


@define(frozen=True, eq=False)
class BucketReads:
    """One bucket's members as arrays, in the bucket's order."""

    bucket: Bucket
    key: int
    base: int
    indices: list[int]
    span: tuple[int, int] | None
    """``params[a:b]`` are the members, when they are consecutive."""
    live: int
    """The pool's :attr:`~flatpool.state.PoolState.live_version` then (bumped before every
    change of its live slices): equal now, every member's slice is still the live handle of its
    id, read in one compare instead of a look at every slice."""
    data: Reads
    types: list[type]
    own_local: bool
    """The local tensor is ``wrapper._local_tensor`` (else the wrapper itself)."""
    local: Reads
    wrapper_keys: list[int]
    with_memory: list[int]
    """Positions whose wrapper sits on the pool (memory of its own): offset and shape checked."""
    at: list[int]
    shapes: list[torch.Size]
    storage_less: list[int]
    """Positions whose wrapper has no memory: identity and impl checked."""
    objects: list[torch.Tensor]
    impls: list[int]
    raw: tc.ImplSnapshot | None = None
    """The impl words of every member's data, local tensor and (when it is not its own local
    tensor) wrapper, in ``tensors``' order, compared in one vectorized read
    when it can run (:func:`flatpool.torch_compat.impl_same`); else the per-field lists serve."""
    tensors: Callable[[Sequence[Any]], Iterable[Any]] = _plain_tensors
    """The members' tensors in ``raw``'s order."""
    addresses: Any = None
    """With ``raw``, where member wrappers: the addresses of the objects read (the storage-less
    wrappers, which ``objects`` holds, must be the same objects)."""


def _reads(ts: list[torch.Tensor], offsets: list[int]) -> Reads:
    ptrs = list(map(tc.impl_data_ptr, ts))
    return Reads(ptrs, list(map(tc.impl_size, ts)),
                 [(i, at) for i, (p, at) in enumerate(zip(ptrs, offsets)) if p == 0])


def _snapshot(data: list[torch.Tensor], locals_: list[torch.Tensor],
              wrappers: list[torch.Tensor], key: int) -> tuple[tc.ImplSnapshot | None, Any]:
    """The impl words of the data, local tensors (and wrappers) in one snapshot, member after
    member, and (with wrappers) the objects' addresses; the wrappers' geometry is not relied on
    (only their storage key and impl pointer)."""
    ts = data + locals_
    if not all(map(_eq, map(tc.storage_address, ts), repeat(key))):
        return None, None  # (the rules passed, so each is on the pool: never trust less)
    each = list(chain.from_iterable(zip(data, locals_, wrappers))) if wrappers else ts
    snap = tc.impl_snapshot_by_column(each, geometry=ts)
    return snap, (tc.object_addresses(each) if snap is not None and wrappers else None)


def _members(params: Sequence[ShardedParam], r: BucketReads) -> list[Any]:
    if r.span is not None and isinstance(params, (list, tuple)):
        return list(params[r.span[0]:r.span[1]])
    return list(map(params.__getitem__, r.indices))


def _bucket(b: Bucket, params: Sequence[ShardedParam]) -> BucketReads | None:
    """What the full rules read of bucket ``b`` (which they just passed), or ``None`` when its
    members are of mixed kinds (plain and wrapped: the full rules serve those)."""
    key, base, live = b.pool.storage_key, b.pool.base_address, b.pool.live_version
    members = [m for m in b.members if m.slice is not None]
    if key is None or base is None or not members:
        return None
    indices = [m.index for m in members]
    span = (indices[0], indices[-1] + 1) if indices == list(
        range(indices[0], indices[-1] + 1)) else None
    ps = [params[i] for i in indices]
    at = [m.offset for m in members]
    wrappers = list(map(_wrapper, ps))
    types = list(map(type, wrappers))
    plain = {t in PLAIN for t in types}
    if len(plain) != 1:
        return None
    own_local = not plain.pop()
    locals_: list[torch.Tensor] = wrappers
    if own_local:
        found = [getattr(w, "_local_tensor", None) for w in wrappers]
        locals_ = [t for t, w in zip(found, wrappers) if isinstance(t, torch.Tensor) and t is not w]
        if len(locals_) != len(wrappers):
            return None
    keys = list(map(tc.storage_address, wrappers)) if own_local else []
    data = list(map(_data, ps))
    with_memory = [i for i, k in enumerate(keys) if k == key]
    less = [i for i, k in enumerate(keys) if k != key]
    raw, addresses = _snapshot(data, locals_, wrappers if own_local else [], key)
    return BucketReads(
        bucket=b, key=key, base=base, indices=indices, span=span,
        live=live,
        data=_reads(data, at), types=types, own_local=own_local,
        local=_reads(locals_, at), wrapper_keys=keys, with_memory=with_memory,
        at=[at[i] for i in with_memory],
        shapes=[tc.impl_size(wrappers[i]) for i in with_memory],
        storage_less=less, objects=[wrappers[i] for i in less],
        impls=[tc.impl_address(wrappers[i]) for i in less],
        raw=raw, tensors=_wrapped_tensors if own_local else _plain_tensors, addresses=addresses)


def remember(buffers: GroupBuffers, params: Sequence[ShardedParam]) -> None:
    """Keep what the full rules read, right after they passed for ``buffers`` and ``params``."""
    with tc.no_torch_function():
        try:
            reads = [_bucket(b, params) for b in buffers.buckets]
        except _UNREADABLE:
            reads = [None]
    buffers.wrapper_kinds.fast = (
        tuple(r for r in reads if r is not None) if all(r is not None for r in reads) else None)


def _same(ts: list[torch.Tensor], r: Reads, key: int) -> bool:
    if not (all(map(_eq, map(tc.impl_data_ptr, ts), r.ptrs))
            and all(map(_eq, map(tc.impl_size, ts), r.sizes))):
        return False
    for i, at in r.empty:
        t = ts[i]
        if tc.storage_address(t) != key or tc.impl_storage_offset(t) != at:
            return False
    return True


def _bucket_same(r: BucketReads, params: Sequence[ShardedParam]) -> bool:
    pool = r.bucket.pool
    if (pool.live_version != r.live or pool.storage_key != r.key
            or pool.base_address != r.base):
        return False
    ps: Sequence[Any] = (params if r.span == (0, len(params)) and isinstance(params, list)
                         else _members(params, r))
    n = len(ps)
    if n != len(r.indices):
        return False  # fewer parameters than members (``map`` would stop at the shorter)
    fast: bool | None = None
    if r.raw is not None:  # one pass over the members, then one vectorized read
        fast = tc.impl_same(r.tensors(ps), (3 if r.own_local else 2) * n, r.raw, r.addresses)
        if fast is False:
            return False
    if not r.own_local:  # the parameter is its own local tensor (its type is read with it)
        if fast is not None:
            return fast
        wrappers = list(map(_wrapper, ps))
        return (_same(list(map(_data, ps)), r.data, r.key)
                and all(map(_is, map(type, wrappers), r.types))
                and _same(wrappers, r.local, r.key))
    wrappers = list(map(_wrapper, ps)) if not fast or r.with_memory else []
    if not fast and not (
            _same(list(map(_data, ps)), r.data, r.key)
            and all(map(_is, map(type, wrappers), r.types))
            and _same(list(map(_local, wrappers)), r.local, r.key)
            and all(map(_eq, map(tc.storage_address, wrappers), r.wrapper_keys))):
        return False
    if r.with_memory:
        mem = list(map(wrappers.__getitem__, r.with_memory))
        if not (all(map(_eq, map(tc.impl_storage_offset, mem), r.at))
                and all(map(_eq, map(tc.impl_size, mem), r.shapes))):
            return False
    if r.storage_less and not fast:  # (fast: the same objects and impls, by their addresses)
        less = (wrappers if len(r.storage_less) == len(wrappers)
                else list(map(wrappers.__getitem__, r.storage_less)))
        if not (all(map(_is, less, r.objects))
                and all(map(_eq, map(tc.impl_key, less), r.impls))):
            return False
    return True


def still_valid(buffers: GroupBuffers, params: Sequence[ShardedParam]) -> bool | None:
    """``True`` when every member reads as when the full rules last passed; ``None`` when
    something differs (the full rules then decide)."""
    reads = buffers.wrapper_kinds.fast
    if reads is None or len(reads) != len(buffers.buckets):
        return None
    with tc.no_torch_function():
        try:
            for r, b in zip(reads, buffers.buckets):
                if r.bucket is not b or not _bucket_same(r, params):
                    return None
        except _UNREADABLE:
            return None
    return True


__all__ = ["BucketReads", "Reads", "remember", "still_valid"]
