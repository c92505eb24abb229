"""The shape of a sharded parameter that a fusion group manages.

HyperParallel's ``TorchHSDPParamV2`` was adapted from PyTorch FSDP2's ``FSDPParam``; both keep,
per parameter, the same few attributes. The layer is written against this protocol only, so
it serves both (and the test double in ``tests/integrations``) without importing either.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ShardedParam(Protocol):
    """What :func:`flatpool.integrations.hsdp.adopt_group` reads and rebinds on each group member.

    Attributes:
        _sharded_param_data: 1-D tensor over the *padded* local shard; the all-gather input.
            Uneven sharding pads dim 0 of the shard up to ``padded_sharded_param_size``.
            Always an autograd view (``_base`` set) on FSDP2, so it must be *replaced*, not
            rebound with ``set_``.
        sharded_param: the ``nn.Parameter``-wrapped DTensor installed on the module and held
            by the optimizer. Its identity must survive adoption. ``sharded_param._local_tensor``
            is a ``narrow`` of the padded data shaped ``sharded_size``.
        sharded_size: shape of the unpadded local shard.
        padded_sharded_param_size: shape of the padded local shard.
        offload_to_cpu: CPU offload keeps shards on the host; fusion is skipped then.
    """

    _sharded_param_data: torch.Tensor
    sharded_param: nn.Parameter
    sharded_size: torch.Size
    padded_sharded_param_size: torch.Size
    offload_to_cpu: bool


__all__ = ["ShardedParam"]
