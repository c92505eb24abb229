"""The shape of a sharded parameter that a fusion group manages.

HyperParallel's ``TorchHSDPParamV2`` and FSDP2's ``FSDPParam`` share these attributes, so the
layer serves both without importing either.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ShardedParam(Protocol):
    """What :func:`flatpool.integrations.hsdp.adopt_group` reads and rebinds on each group member.

    Attributes:
        _sharded_param_data: 1-D tensor over the *padded* local shard; the all-gather input.
            On FSDP2 an autograd view (``_base`` set) of the padded tensor.
        sharded_param: the ``nn.Parameter``-wrapped DTensor installed on the module and held
            by the optimizer. Its identity survives adoption. ``sharded_param._local_tensor``
            is a ``narrow`` of the padded data shaped ``sharded_size``.
        sharded_size: shape of the unpadded local shard.
        offload_to_cpu: CPU offload keeps shards on the host; fusion is skipped then.

    Read when present (the layer never requires them):

    * ``padded_sharded_param_size``: shape of the padded local shard. HyperParallel's even-only
      ``TorchHSDPParamV2`` has no such attribute; ``sharded_size`` stands in for it when the
      data holds exactly ``sharded_size`` elements (even sharding), otherwise adoption refuses
      the member with :class:`flatpool.InvalidRequestError`.
    * ``fsdp_placement`` (FSDP2) / ``hsdp_placement`` (HyperParallel): ``Shard(dim)``, default 0.
    * ``_orig_size``: the unsharded shape, for cutting a fused all-gather's output.
    * ``param_dtype``: the communication dtype (HyperParallel's cast buffer).
    """

    _sharded_param_data: torch.Tensor
    sharded_param: nn.Parameter
    sharded_size: torch.Size
    offload_to_cpu: bool


__all__ = ["ShardedParam"]
