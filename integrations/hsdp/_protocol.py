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

    ``_sharded_param_data`` is the padded 1-D local shard (the all-gather input);
    ``sharded_param`` the DTensor parameter whose identity survives adoption. Read when present:
    ``padded_sharded_param_size`` (else ``sharded_size`` when the sharding is even),
    ``fsdp_placement``/``hsdp_placement``, ``_orig_size``, ``param_dtype``.
    """

    _sharded_param_data: torch.Tensor
    sharded_param: nn.Parameter
    sharded_size: torch.Size
    offload_to_cpu: bool
