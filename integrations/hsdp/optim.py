"""Flat optimizer steps for a ``fully_shard``-ed module fused by this layer.

Each param group's shards already live in one pool per dtype (:class:`FusedModule`'s
buckets); :func:`flat_optimizer` hands those pools to :class:`flatpool.optim.FlatOptimizer`,
which puts the sharded gradients and the optimizer state at the same offsets of companion
pools and makes ``optimizer.step()`` step each bucket with one kernel call. FSDP2 adds each
reduce-scatter result into an existing sharded ``.grad`` (``grad._local_tensor += ...``), so with
the pooled gradients installed when the backward reaches the root's output, the gradients are
written straight into the gradient pool, gradient accumulation included; those FSDP2 did not
write (an unused group, a frozen layer) are given back as ``None`` when the backward ends. The
layer's own hooks re-adopt moved shards before every forward (and adopt groups skipped on meta);
the flat optimizer plans again from the pools it finds then (torchtitan builds the optimizer
before that first forward).

Only :class:`FusedModule`'s public ``module`` and ``buffers`` are read.
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
    """A :class:`FlatOptimizer` over ``fused``'s pools, with its gradient hook on the root
    module. ``kwargs`` go to :class:`FlatOptimizer` (``fused=``, ``verify=``)."""
    return FlatOptimizer(optimizer, lambda: fused_pools(fused), module=fused.module, **kwargs)


__all__ = ["flat_optimizer", "fused_pools"]
