"""Zero-copy materialization: give meta shards their storage directly in the pool.

The usual ``to_empty`` flow allocates one storage per shard and fusion copies them: twice the
memory at the peak. Here each Parameter is swapped (identity kept) for a DTensor whose local
tensor already is its slice, so no other shard storage ever exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatpool import FlatPool, InvalidRequestError, InvalidTypeError
from flatpool import _torch_compat as tc
from flatpool._devices import DeviceLike, resolve_device

from .group import GroupBuffers, plan_buckets
from .layout import Bucket, MemberLayout
from .members import data_of, impl_requires_grad, is_meta
from ._protocol import ShardedParam


def materialize_group(
    params: Sequence[ShardedParam],
    *,
    device: DeviceLike,
    alignment: int = 1,
    name: str = "group",
) -> GroupBuffers:
    """Allocate every meta member of a group straight into one pool per dtype.

    Every member must be a meta torch DTensor. The memory is left uninitialized, like
    ``to_empty``. Nothing is changed when a member is refused.
    """
    params = list(params)
    if not params:
        return GroupBuffers(skipped="empty group: nothing to fuse")
    not_meta = [i for i, p in enumerate(params) if not is_meta(data_of(p, i))]
    if not_meta:
        raise InvalidRequestError(
            f"members {not_meta} are not on meta; use adopt_group() for materialized shards")
    not_dtensor = [i for i, p in enumerate(params) if not isinstance(p.sharded_param, DTensor)]
    if not_dtensor:
        raise InvalidTypeError(
            f"members {not_dtensor}: zero-copy materialization needs torch DTensor parameters "
            "(FSDP2); materialize other wrappers (HyperParallel's) with to_empty() or lazy init "
            "and fuse them with adopt_group()")
    plans = plan_buckets(params, resolve_device(device), alignment, name)
    for _, pool, _ in plans:
        pool.materialize()
    for _, pool, layouts in plans:
        for m in layouts:
            if m.slice is not None:
                _install(params[m.index], pool, m)
    return GroupBuffers(buckets=tuple([Bucket(d, pool, tuple(ls)) for d, pool, ls in plans]))


@torch.no_grad()
def _install(p: ShardedParam, pool: FlatPool, m: MemberLayout) -> None:
    assert m.slice is not None
    old = p.sharded_param
    assert isinstance(old, DTensor)
    grad = impl_requires_grad(old)
    local = pool.view_at(m.slice.offset, tuple(m.sharded_size), m.slice.dtype)
    new_dt = DTensor(local, old._spec, requires_grad=grad)  # type: ignore[no-untyped-call]
    tc.swap_tensors(old, nn.Parameter(new_dt, requires_grad=grad))
    p._sharded_param_data = pool.view_at(m.slice.offset, (m.numel,), m.slice.dtype)
