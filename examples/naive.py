"""The bug of the report, reproduced for comparison: a flat buffer that moves only the data.

Copying each member's ``_sharded_param_data`` into a flat buffer and pointing only that
attribute at it leaves ``sharded_param``'s local tensor (the storage the module and the
optimizer use) on the old per-parameter storage: the old storages stay alive next to the flat
buffer, and the optimizer's updates land where the all-gather no longer reads. Never use this;
it exists so the demo and the tests can show what :func:`adopt_group` fixes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flatpool.integrations.hsdp import ShardedParam


@torch.no_grad()
def naive_rebase(params: Sequence[ShardedParam]) -> torch.Tensor:
    """Rebase ``_sharded_param_data`` (only) onto one new flat buffer; return the buffer."""
    total = sum(p._sharded_param_data.numel() for p in params)
    first = params[0]._sharded_param_data
    flat = torch.empty(total, dtype=first.dtype, device=first.device)
    offset = 0
    for p in params:
        n = p._sharded_param_data.numel()
        piece = flat.narrow(0, offset, n)
        piece.copy_(p._sharded_param_data)
        p._sharded_param_data = piece
        offset += n
    return flat


__all__ = ["naive_rebase"]
