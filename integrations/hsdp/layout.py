"""Value types describing where a fusion group's shards live after adoption."""

from __future__ import annotations

import torch
from attrs import define

from flatpool import FlatPool, Slice


@define(frozen=True)
class MemberLayout:
    """One member's place in its bucket's flat buffer (``offset``, ``numel`` in elements),
    and the shapes a fused all-gather needs to cut its output back into parameters."""

    index: int
    """Position of the member in the list given to ``adopt_group``."""
    offset: int
    numel: int
    padded_size: torch.Size
    sharded_size: torch.Size
    orig_size: torch.Size
    shard_dim: int
    slice: Slice | None = None


@define(frozen=True)
class Bucket:
    """The members of one dtype and the pool that holds their shards, in all-gather order."""

    dtype: torch.dtype
    pool: FlatPool
    members: tuple[MemberLayout, ...]

    @property
    def numel(self) -> int:
        """Elements of the flat buffer (``pool.capacity`` in elements of ``dtype``)."""
        return self.pool.capacity // self.dtype.itemsize

    def flat(self) -> torch.Tensor:
        """The whole bucket as one 1-D tensor: the zero-copy all-gather input."""
        return self.pool.flat(self.dtype)


__all__ = ["Bucket", "MemberLayout"]
