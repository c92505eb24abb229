"""Flat optimizer steps for a ``fully_shard``-ed module fused by this layer.

The bucket pools go to :class:`flatpool.optim.FlatOptimizer`; FSDP2 adds reduce-scatter results
into the existing ``.grad``, so pooled gradients receive them in place. Only
:class:`FusedModule`'s public ``module`` and ``buffers`` are read.
"""

from __future__ import annotations

from typing import Any

import torch

from flatpool import FlatPool
from flatpool.optim import FlatOptimizer

from .fsdp2 import FusedModule


def fused_pools(fused: FusedModule) -> list[FlatPool]:
    """Every pool of every adopted group of ``fused``, in group and bucket order."""
    return [b.pool for buf in fused.buffers if buf.adopted for b in buf.buckets]


def flat_optimizer(fused: FusedModule, optimizer: torch.optim.Optimizer, **kwargs: Any) -> FlatOptimizer:
    """A :class:`FlatOptimizer` over ``fused``'s pools, hooked on the root module."""
    return FlatOptimizer(optimizer, lambda: fused_pools(fused), module=fused.module, **kwargs)


__all__ = ["flat_optimizer", "fused_pools"]
