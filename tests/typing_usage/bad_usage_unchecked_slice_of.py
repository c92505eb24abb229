"""Type-checked misuse: slice_of() may answer None, used as a Slice without a check."""

from __future__ import annotations

import torch

from flatpool import FlatPool


def offset_of(pool: FlatPool, t: torch.Tensor) -> int:
    return pool.slice_of(t).offset  # expect: [union-attr]
