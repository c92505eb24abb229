"""Type-checked misuse: a string where a torch.dtype is needed."""

from __future__ import annotations

from flatpool import FlatPool

pool = FlatPool()
shard = pool.allocate((1024,), "float32")  # expect: [arg-type]
