"""Type-checked misuse: a Slice handle passed where a tensor is expected."""

from __future__ import annotations

import torch

from flatpool import FlatPool

pool = FlatPool()
weight = pool.allocate((4, 4), torch.float32)
torch.nn.init.zeros_(weight)  # expect: [arg-type]
