"""Is every adopted tensor object in place? The rule, and the pool-wide answers built on it.

A bound object is *in place* when its TensorImpl sits exactly where its binding put it: on the
pool's storage (by storage identity: a same-address alias on another storage is not), at its
offset, with its shape, strides and dtype, inside bytes the storage still holds (a shrunk
storage's tail is freed memory). :func:`is_valid` is exactly "nothing moved and no slice
orphaned": there is no faster form that could disagree.
"""

from __future__ import annotations

import torch

from .. import _torch_compat as tc
from .._registry import Binding, ParamRef
from ..slices import Slice
from .._state import PoolState

Moved = tuple[Slice, Binding, torch.Tensor]
"""A bound object that is not in place: its slice, its binding, the object now."""


def in_place(pool_key: int, slc: Slice, b: Binding, obj: torch.Tensor | None) -> bool:
    """``obj`` (what ``b`` binds now) sits exactly where ``b`` says inside ``slc``, by its
    TensorImpl; a gone object (``None``) has nothing to keep in place."""
    if obj is None:
        return True
    with tc.no_torch_function():
        if tc.impl_is_meta(obj):
            return False  # (a storage-less wrapper's placeholder storage is never the pool's)
        dtype = tc.impl_dtype(obj)
        result = (
            tc.storage_address(obj) == pool_key
            and tc.impl_storage_offset(obj) * dtype.itemsize == slc.offset + b.byte_offset
            and tuple(tc.impl_size(obj)) == b.shape
            and tuple(tc.impl_stride(obj)) == b.stride
            and dtype == b.dtype
        )
        return result  # not `return f()`: see flatpool._interrupts


def moved(pool: PoolState) -> list[Moved]:
    """Every bound object that is not in place (see the module): what ``readopt`` brings back."""
    with pool.lock:
        key = pool.storage_key
        if key is None:
            return []
        held = pool.storage_nbytes
        out: list[Moved] = []
        for slice_id, bound in pool.registry.items():
            slc = pool.live_slice(slice_id)
            if slc is None:
                continue
            for b in bound:
                obj = b.current()
                if obj is not None and (slc.end > held or not in_place(key, slc, b, obj)):
                    out.append((slc, b, obj))
        return out


def orphaned(pool: PoolState) -> list[Slice]:
    """Live slices that had adopted *parameters* none of which lives now (a module replaced
    them, ``load_state_dict(assign=True)``): memory nothing uses."""
    with pool.lock:
        out = []
        for slice_id, bound in pool.registry.items():
            slc = pool.live_slice(slice_id)
            if (slc is not None and any(type(b.ref) is ParamRef for b in bound)  # parameters
                    and all(b.current() is None for b in bound)):
                out.append(slc)
        return out


def is_valid(pool: PoolState) -> bool:
    """Nothing :func:`moved` and nothing :func:`orphaned`, in one locked look."""
    with pool.lock:
        result = not moved(pool) and not orphaned(pool)
        return result  # not `return f()`: see flatpool._interrupts
