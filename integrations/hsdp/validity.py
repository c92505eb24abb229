"""Is a fused group still fused? And bringing back the members that were moved out.

A group stays valid only while *every* member's padded data, local tensor and (for a
storage-sharing wrapper) the wrapper itself sit on the member's slice. HyperParallel's own
check looks at the first member's data pointer only, which misses a later member moved by
``reset_sharded_param`` (``load_state_dict(assign=True)``, ``to_empty``) and misses a wrapper or
local tensor left behind. The check here is by storage identity and byte offset, per member,
at about a microsecond each.

The per-step check (:func:`is_valid`) compares raw data pointers: while a pool's storage is
alive no other allocation can own an address inside it, so a tensor whose data pointer is the
slice's address does alias the slice. The slower :func:`problems` says *what* is wrong, by
storage identity, when the fast check fails.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from flatpool import FlatPool, byte_range, local_tensor, own_storage, storage_of

from .group import GroupBuffers, adopt_spec
from .layout import MemberLayout
from .protocol import ShardedParam


def _at(t: torch.Tensor, pool: FlatPool, key: int, byte_offset: int) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        if t.is_meta:
            return False
    return int(storage_of(t)._cdata) == key and byte_range(t).start == byte_offset


def member_problems(p: ShardedParam, m: MemberLayout, pool: FlatPool) -> list[str]:
    """What of member ``p`` is not where layout ``m`` puts it (empty when it is)."""
    assert m.slice is not None
    if not pool.is_materialized or not pool.is_live(m.slice):
        return ["its slice is gone"]
    key = int(pool.storage._cdata)
    start = m.slice.offset
    out = []
    data = p._sharded_param_data
    if not _at(data, pool, key, start) or data.numel() != m.numel:
        out.append("_sharded_param_data left its slice")
    if data._base is not None and not _at(data._base, pool, key, byte_range(data._base).start):
        out.append("_sharded_param_data is a view of a storage outside the pool")
    local = local_tensor(p.sharded_param)
    if not _at(local, pool, key, start) or tuple(local.shape) != tuple(m.sharded_size):
        out.append("the local tensor left its slice")
    if local._base is not None and int(storage_of(local._base)._cdata) != key:
        out.append("the local tensor is a view of a storage outside the pool")
    wrapper = own_storage(p.sharded_param)
    if local is not p.sharded_param and wrapper is not None and int(wrapper._cdata) != key:
        out.append("the parameter wrapper shares a storage outside the pool")
    return out


def problems(buffers: GroupBuffers, params: Sequence[ShardedParam]) -> dict[int, list[str]]:
    """Per member index, what is wrong; empty when the group is fully valid."""
    out: dict[int, list[str]] = {}
    for b in buffers.buckets:
        for m in b.members:
            found = member_problems(params[m.index], m, b.pool)
            if found:
                out[m.index] = found
    return out


_data_ptr = torch._C.TensorBase.data_ptr  # the real address, past subclass overrides


def _outside(t: torch.Tensor | None, lo: int, hi: int) -> bool:
    """``t`` is a tensor (an autograd base, a wrapper) whose data lies outside ``[lo, hi)``."""
    return t is not None and not lo <= _data_ptr(t) < hi


def _shares_storage(wrapper: torch.Tensor) -> bool:
    """A wrapper with data of its own (``_make_subclass``), not a storage-less DTensor."""
    traceable: bool = is_traceable_wrapper_subclass(wrapper)
    return not traceable


def is_valid(buffers: GroupBuffers, params: Sequence[ShardedParam]) -> bool:
    """True when the group was adopted and *every* member still aliases its slice.

    Runs before each all-gather: per member a handful of pointer reads (about a microsecond),
    covering the padded data, the local tensor, their autograd bases and a storage-sharing
    wrapper, as :func:`problems` does by storage identity.
    """
    if not buffers.adopted:
        return False
    for b in buffers.buckets:
        pool = b.pool
        if not pool.is_materialized:
            return False
        lo = pool.storage.data_ptr()
        hi = lo + pool.capacity
        for m in b.members:
            slc = m.slice
            if slc is None or not pool.is_live(slc):
                return False
            at = lo + slc.offset
            p = params[m.index]
            data = p._sharded_param_data
            if _data_ptr(data) != at or data.numel() != m.numel or _outside(data._base, lo, hi):
                return False
            param = p.sharded_param
            local = getattr(param, "_local_tensor", param)
            if _data_ptr(local) != at or _outside(local._base, lo, hi):
                return False
            if local is not param and _shares_storage(param) and _outside(param, lo, hi):
                return False  # a storage-sharing wrapper (HyperParallel) left the pool
    return True


def readopt_group(buffers: GroupBuffers, params: Sequence[ShardedParam]) -> int:
    """Bring members that moved back into their slices; return how many moved. Idempotent.

    The member's *current* values (a freshly loaded or re-initialized shard) are copied into
    its slice and every holder is rebound, with the same release proof as the first adoption:
    the storage the member had moved to must die.
    """
    if not buffers.adopted:
        return 0
    moved = 0
    for b in buffers.buckets:
        stale = [m for m in b.members if member_problems(params[m.index], m, b.pool)]
        if not stale:
            continue
        # The member knows its holders *now* (FSDP2 may have installed a new Parameter object,
        # e.g. load_state_dict(assign=True)), so name them explicitly for the existing slices.
        b.pool.readopt([adopt_spec(params[m.index], m.slice) for m in stale])
        moved += len(stale)
    return moved


__all__ = ["is_valid", "member_problems", "problems", "readopt_group"]
