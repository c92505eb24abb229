"""Is a fused group still fused? And bringing back the members that were moved out.

A member is in place when its padded data, local tensor and (if it has memory) its wrapper sit
on its bucket's pool storage at its slice, with its layout's shapes, and the slice lies inside
the storage. Decided by storage identity and element offset, never ``data_ptr()`` (0 when empty,
overridden, shared by a ``from_numpy`` alias). :func:`is_valid` is the per-step form;
:func:`member_problems` says what is wrong by the same rules (a property test holds them equal).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flatpool import AdoptionError, AdoptSpec, FlatPool, InvalidRequestError, OnPinned
from flatpool import _torch_compat as tc

from .group import GroupBuffers, adopt_spec
from .layout import MemberLayout
from .members import PLAIN, data_of, has_memory, impl_device, impl_dtype, impl_size, is_meta
from .members import local_of, member_name
from ._protocol import ShardedParam


def _place(t: torch.Tensor, key: int, offset: int, size: tuple[int, ...],
           itemsize: int | None = None) -> str | None:
    """What is wrong with ``t`` versus ``(pool key, element offset, size[, itemsize])``, or None."""
    with tc.no_torch_function():
        if tc.impl_is_meta(t):
            return "is on the meta device"
        if tc.storage_address(t) != key:
            return "is on a storage outside the pool"
        if itemsize is not None and tc.impl_element_size(t) != itemsize:
            return (f"has {tc.impl_element_size(t)}-byte elements ({tc.impl_dtype(t)}), not "
                    f"{itemsize}: it starts at another byte than its slice")
        if tc.impl_storage_offset(t) != offset:
            return f"starts at element {tc.impl_storage_offset(t)} of the pool, not {offset}"
        if tuple(tc.impl_size(t)) != size:
            return f"has shape {tuple(tc.impl_size(t))}, not {size}"
    return None


def member_problems(p: ShardedParam, m: MemberLayout, pool: FlatPool,
                    itemsize: int | None = None) -> list[str]:
    """What of member ``p`` is not where layout ``m`` puts it (empty when it is)."""
    if m.slice is None:
        return []  # a member with no element has no slice and nothing to keep in place
    key = pool.storage_key
    if key is None or pool.live_slice(m.slice.slice_id) is not m.slice:
        return ["its slice is gone"]
    held = pool.storage_nbytes
    if m.slice.end > held:
        return [f"its slice ends at byte {m.slice.end}, past the end of the pool's storage "
                f"(shrunk to {held} bytes through a tensor on it)"]
    out = []
    data = data_of(p, m.index)
    wrong = _place(data, key, m.offset, (m.numel,), itemsize)
    if wrong:
        out.append(f"_sharded_param_data {wrong}")
    wrapper = p.sharded_param
    local = local_of(wrapper)
    wrong = _place(local, key, m.offset, tuple(m.sharded_size), itemsize)
    if wrong:
        out.append(f"the local tensor {wrong}")
    if local is not wrapper and has_memory(wrapper):
        wrong = _place(wrapper, key, m.offset, tuple(m.sharded_size), itemsize)
        if wrong:
            out.append(f"the parameter wrapper (it has memory of its own) {wrong}")
    return out


def problems(buffers: GroupBuffers, params: Sequence[ShardedParam]) -> dict[int, list[str]]:
    """Per member index, what is wrong; empty when the group is fully valid."""
    out: dict[int, list[str]] = {}
    for b in buffers.buckets:
        for m in b.members:
            found = member_problems(params[m.index], m, b.pool, b.dtype.itemsize)
            if found:
                out[m.index] = found
    return out


def is_valid(buffers: GroupBuffers, params: Sequence[ShardedParam]) -> bool:
    """:func:`problems` without its words, run before each all-gather."""
    if not buffers.adopted:
        return False
    kinds = buffers.wrapper_kinds
    with tc.no_torch_function():
        for b in buffers.buckets:
            key, held = b.pool.storage_key, b.pool.storage_nbytes
            if key is None:
                return False
            item = b.dtype.itemsize
            live = b.pool.live_slice
            for index, slc, sid, at, flat, sharded in kinds.rows(b):
                if live(sid) is not slc or slc.end > held:
                    return False
                p = params[index]
                wrapper: torch.Tensor = p.sharded_param
                local: Any = wrapper  # (local_of) a plain parameter is its own local tensor
                if type(wrapper) not in PLAIN:
                    local = getattr(wrapper, "_local_tensor", None)
                    if not isinstance(local, torch.Tensor):
                        local = wrapper
                if not (_at(p._sharded_param_data, key, at, flat, item)
                        and _at(local, key, at, sharded, item)):
                    return False
                if local is not wrapper:  # a wrapper with memory must sit there too
                    if tc.storage_address(wrapper) == key:
                        if not _at(wrapper, key, at, sharded, item):
                            return False
                    elif not kinds.storage_less(index, wrapper, tc.storage_address(wrapper)):
                        return False
    return True


def _at(t: torch.Tensor, key: int, offset: int, size: tuple[int, ...], itemsize: int) -> bool:
    """:func:`_place`'s rule without its words (call under ``no_torch_function()``)."""
    return (not tc.impl_is_meta(t) and tc.storage_address(t) == key
            and tc.impl_element_size(t) == itemsize and tc.impl_storage_offset(t) == offset
            and tc.impl_size(t) == size)


def _repair_spec(p: ShardedParam, m: MemberLayout, pool: FlatPool) -> AdoptSpec | None:
    """A spec when member ``p``'s data left the pool; ``None`` when only a local tensor or
    wrapper moved (``pool.readopt()`` brings those back); else a typed error, nothing moved."""
    assert m.slice is not None
    key = pool.storage_key
    if key is None or pool.live_slice(m.slice.slice_id) is not m.slice:
        raise InvalidRequestError(
            f"member {m.index}: its slice was freed; adopt the group anew with adopt_group()")
    data = data_of(p, m.index)
    wrapper = p.sharded_param
    local = local_of(wrapper)
    with tc.no_torch_function():
        moved_to = None if is_meta(data) else tc.storage_address(data)
    if moved_to == key or moved_to is None:
        wrong = _place(data, key, m.offset, (m.numel,))
        if wrong:
            raise InvalidRequestError(
                f"member {m.index}: its _sharded_param_data {wrong}; give it its slice's view "
                "again (or its own storage) before re-adopting. Nothing was changed.")
        return None
    others = [("local tensor", local)]
    if local is not wrapper and has_memory(wrapper) and not is_meta(wrapper):
        others.append(("parameter wrapper", wrapper))
    along = False
    for what, t in others:
        with tc.no_torch_function():
            where = tc.storage_address(t)
        if where not in (key, moved_to):
            raise AdoptionError(
                f"member {m.index}: its _sharded_param_data and its {what} moved to two "
                "different storages, so which values are current is unknown; point them at one "
                "storage (as reset_sharded_param does) and call again. Nothing was changed.")
        along = along or where == moved_to
    spec = adopt_spec(p, m.slice)
    # The parameter is named only when something of it moved with the data.
    return spec if along else AdoptSpec(spec.tensor, holders=spec.holders, slice=spec.slice)


def readopt_group(
    buffers: GroupBuffers, params: Sequence[ShardedParam], *, on_pinned: OnPinned = "raise"
) -> int:
    """Bring members that moved back into their slices; return how many moved. Idempotent.

    The current values are copied into the slice and every holder rebound, with the release
    proof of a first adoption, one all-or-nothing step per bucket (a local tensor or wrapper
    that moved alone comes back through the registry first). Raises a
    :class:`flatpool.FlatPoolError` when a member cannot be brought back; a changed dtype,
    device or size needs :func:`needs_replan` instead.
    """
    if not buffers.adopted:
        return 0
    moved = 0
    for b in buffers.buckets:
        stale = [m for m in b.members if member_problems(params[m.index], m, b.pool)]
        if not stale:
            continue
        plans = [(m, _repair_spec(params[m.index], m, b.pool)) for m in stale]
        if any(spec is None for _, spec in plans):
            report = b.pool.readopt(on_pinned=on_pinned)
            buffers.kept.note(b.pool, report, [])
        specs = [spec for _, spec in plans if spec is not None]
        if specs:
            report = b.pool.readopt(specs, on_pinned=on_pinned)
            buffers.kept.note(b.pool, report, [member_name(params[m.index], m.index)
                                               for m, spec in plans if spec is not None])
        left = {m.index: member_problems(params[m.index], m, b.pool) for m in stale}
        left = {i: found for i, found in left.items() if found}
        if left:
            raise AdoptionError(
                f"re-adoption left member(s) not in place: {left}; the pool's registry does not "
                "know the objects they hold now. Call adopt_group() on the group anew.")
        moved += len(stale)
    return moved


def needs_replan(buffers: GroupBuffers, params: Sequence[ShardedParam]) -> str | None:
    """Why the group's pools no longer fit its members (``.double()``, ``.to()``), or ``None``."""
    if not buffers.adopted:
        return None
    for b in buffers.buckets:
        device = b.pool.device
        for m in b.members:
            data = data_of(params[m.index], m.index)
            if is_meta(data):
                return f"member {m.index} is on meta again"
            if impl_dtype(data) != b.dtype:
                return f"member {m.index} is {impl_dtype(data)} now, its pool {b.dtype}"
            if impl_device(data) != device:
                return f"member {m.index} is on {impl_device(data)} now, its pool on {device}"
            if tuple(impl_size(data)) != (m.numel,):
                return f"member {m.index} has {tuple(impl_size(data))} elements now, not {m.numel}"
    return None


__all__ = ["is_valid", "member_problems", "needs_replan", "problems", "readopt_group"]
