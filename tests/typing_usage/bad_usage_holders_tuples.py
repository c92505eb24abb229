"""Type-checked misuse: ``(owner, key)`` pairs as ``holders``, which take ``Holder`` objects."""

from __future__ import annotations

import torch

from flatpool import AdoptSpec

m = torch.nn.Linear(4, 4)
spec = AdoptSpec(m.weight, holders=[(m, "weight")])  # expect: [list-item]
