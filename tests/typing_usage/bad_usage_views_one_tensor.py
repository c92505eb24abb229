"""Type-checked misuse: one tensor as ``views`` (a tensor iterates over its rows)."""

from __future__ import annotations

import torch

from flatpool import AdoptSpec

t = torch.zeros(4, 4)
spec = AdoptSpec(t, views=t)  # expect: [arg-type]
