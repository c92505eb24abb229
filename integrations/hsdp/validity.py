"""Is a fused group still fused? And bringing back the members that were moved out.

A group stays valid only while *every* member's padded data, local tensor and (for a
storage-sharing wrapper) the wrapper itself sit on the member's slice. HyperParallel's own
check looks at the first member's data pointer only, which misses a later member moved by
``reset_sharded_param`` (``load_state_dict(assign=True)``, ``to_empty``) and misses a wrapper or
local tensor left behind. The check here is by storage identity and byte offset, per member,
at about a microsecond each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def is_valid(buffers: GroupBuffers, params: Sequence[ShardedParam]) -> bool:
    """True when the group was adopted and *every* member still aliases its slice."""
    return buffers.adopted and not problems(buffers, params)


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
