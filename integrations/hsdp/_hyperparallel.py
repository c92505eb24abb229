"""HyperParallel's comm-fusion flat buffer, backed by flatpool: what the drop-in lines call.

Each init may run many times (``lazy_init``, ``load_state_dict``, ``to_empty``): the first that
finds materialized shards adopts them, later ones re-adopt what moved. The state lives in one
attribute read with ``getattr(..., None)``: V1's ``__init__`` calls the init before any patched
attribute is set. :class:`V1Lines`/:class:`BucketLines` hold docs/integration.md's drop-in lines
as typed mixins (a test compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flatpool import OnPinned
from flatpool._devices import DeviceLike

from .failsafe import keep_fused
from .group import GroupBuffers, adopt_group, bucket_members
from ._kept import KeptAlive
from ._protocol import ShardedParam
from .validity import is_valid


def fuse(params: Sequence[ShardedParam], previous: GroupBuffers | None, *,
         device: DeviceLike | None, world_size: int | None, name: str = "hsdp",
         on_pinned: OnPinned = "warn") -> GroupBuffers:
    """Build the group's (or bucket's) flat buffer the first time, repair it every later time.

    ``previous`` is what the last call returned. A group of several dtypes is skipped, as
    HyperParallel skips it (its buffer has one dtype). Runs inside HyperParallel's forward, so
    it is fail-safe (:mod:`flatpool.integrations.hsdp.failsafe`) unless ``on_pinned="raise"``.
    """
    def build(policy: OnPinned, kept: KeptAlive) -> GroupBuffers:
        dtypes = list(bucket_members(params))
        if len(dtypes) > 1:
            return GroupBuffers(skipped=(
                f"shards of {len(dtypes)} dtypes ({', '.join(map(str, dtypes))}): "
                "HyperParallel's flat buffer has one dtype"), kept=kept)
        return adopt_group(params, device=device, world_size=world_size, name=name,
                           on_pinned=policy, kept=kept)

    start = previous if previous is not None else GroupBuffers(skipped="not built yet")
    out, _ = keep_fused(start, params, build, on_pinned=on_pinned, where=name)
    return out


def flat_buffer(buffers: GroupBuffers | None) -> torch.Tensor | None:
    """The flat buffer HyperParallel all-gathers from (the pool as one 1-D tensor), or None."""
    if buffers is None or not buffers.adopted or len(buffers.buckets) != 1:
        return None
    return buffers.buckets[0].flat()


def cast_buffer(
    params: Sequence[ShardedParam], flat: torch.Tensor | None, current: torch.Tensor | None = None
) -> torch.Tensor | None:
    """V1's ``_flat_cast_buffer``: ``flat`` in the members' ``param_dtype``, or ``None``."""
    if flat is None:
        return None
    dtype = next((d for d in (getattr(p, "param_dtype", None) for p in params) if d is not None),
                 None)
    if dtype is None or dtype == flat.dtype:
        return None
    if (current is not None and current.dtype == dtype and current.numel() == flat.numel()
            and current.device == flat.device):
        return current
    return torch.empty(flat.numel(), dtype=dtype, device=flat.device)


def is_fused(buffers: GroupBuffers | None, params: Sequence[ShardedParam]) -> bool:
    """The per-step validity; also lets go of kept originals that died."""
    if buffers is None:
        return False
    if len(buffers.kept):
        buffers.kept.refresh()
    return is_valid(buffers, params)


class V1Lines:
    """``HSDPParamGroup``'s flat-buffer methods, V1 and ``enable_zero_copy`` shapes."""

    hsdp_params: Sequence[Any]
    device: torch.device | None
    shard_world_size: int
    _flatpool: GroupBuffers
    _flat_param_buffer: torch.Tensor | None
    _flat_cast_buffer: torch.Tensor | None

    def _init_flat_param_buffer(self) -> None:
        self._flatpool = fuse(self.hsdp_params, getattr(self, "_flatpool", None),
                              device=self.device, world_size=self.shard_world_size)
        self._flat_param_buffer = flat_buffer(self._flatpool)
        self._flat_cast_buffer = cast_buffer(self.hsdp_params, self._flat_param_buffer,
                                             getattr(self, "_flat_cast_buffer", None))

    def _is_flat_buffer_valid(self) -> bool:
        return is_fused(getattr(self, "_flatpool", None), self.hsdp_params)


class BucketLines:
    """``AllGatherBucket``'s flat-buffer methods, the newest shape."""

    hsdp_params: Sequence[Any]
    shard_world_size: int
    _flatpool: GroupBuffers
    flat_param_buffer: torch.Tensor | None

    def init_flat_param_buffer(self, device: torch.device | None) -> None:
        self._flatpool = fuse(self.hsdp_params, getattr(self, "_flatpool", None),
                              device=device, world_size=self.shard_world_size)
        self.flat_param_buffer = flat_buffer(self._flatpool)

    def is_flat_buffer_valid(self) -> bool:
        return is_fused(getattr(self, "_flatpool", None), self.hsdp_params)
