"""All-gather a whole bucket in one collective and cut the result into full parameters.

:func:`per_param_all_gather` is the reference, one collective per member; tests assert both
give identical tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from flatpool import _torch_compat as tc

from .layout import Bucket, MemberLayout
from ._protocol import ShardedParam


def _unshard(rows: torch.Tensor, m: MemberLayout) -> torch.Tensor:
    """``rows`` is ``(world_size, m.numel)``: every rank's padded shard of member ``m``."""
    world = rows.shape[0]
    pieces = rows.reshape(world, *m.padded_size).unbind(0)
    full = torch.cat(pieces, dim=m.shard_dim)
    return full.narrow(m.shard_dim, 0, m.orig_size[m.shard_dim]).contiguous()


@torch.no_grad()
def fused_all_gather(
    bucket: Bucket, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Gather ``bucket``'s flat buffer in one collective; full parameters in member order."""
    flat = bucket.flat()
    world = dist.get_world_size(group)
    out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    tc.all_gather_single(out, flat, group=group)
    rows = out.view(world, flat.numel())
    return [_unshard(rows[:, m.offset : m.offset + m.numel], m) for m in bucket.members]


@torch.no_grad()
def per_param_all_gather(
    params: Sequence[ShardedParam],
    members: Sequence[MemberLayout],
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """The non-fused reference: one all-gather of ``_sharded_param_data`` per member."""
    world = dist.get_world_size(group)
    result = []
    for m in members:
        data = params[m.index]._sharded_param_data.reshape(-1)
        out = torch.empty(world * data.numel(), dtype=data.dtype, device=data.device)
        tc.all_gather_single(out, data.contiguous(), group=group)
        result.append(_unshard(out.view(world, data.numel()), m))
    return result
