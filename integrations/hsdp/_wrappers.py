"""What the per-step validity check remembers between steps (a cache per group).

Telling a storage-less DTensor wrapper from one that left the pool is several times a member's
check, so "storage-less" is remembered per wrapper object and impl. The wrapper is held
strongly: ``swap_tensors`` refuses a parameter with a weak reference.
"""

from __future__ import annotations

import torch

from flatpool import Slice
from flatpool import _torch_compat as tc

from .layout import Bucket
from .members import has_memory

Row = tuple[int, Slice, int, int, tuple[int], torch.Size]
"""``(member index, slice, slice id, element offset, data shape, local shape)``."""


class WrapperKinds:
    """Per member: the wrapper last found storage-less; per bucket: the rows to check."""

    __slots__ = ("_known", "_rows")

    def __init__(self) -> None:
        self._known: dict[int, tuple[torch.Tensor, int, int]] = {}
        self._rows: dict[int, tuple[Bucket, list[Row]]] = {}

    def rows(self, bucket: Bucket) -> list[Row]:
        """The members of ``bucket`` that have a slice, as flat tuples (made once)."""
        got = self._rows.get(id(bucket))
        if got is None or got[0] is not bucket:
            rows = [(m.index, m.slice, m.slice.slice_id, m.offset, (m.numel,), m.sharded_size)
                    for m in bucket.members if m.slice is not None]
            got = self._rows[id(bucket)] = (bucket, rows)
        return got[1]

    def storage_less(self, index: int, wrapper: torch.Tensor, key: int) -> bool:
        """True when ``wrapper`` (whose storage key is ``key``) has no memory of its own."""
        known = self._known.get(index)
        if (known is not None and known[0] is wrapper and known[2] == key
                and known[1] == tc.impl_address(wrapper)):
            return True
        if has_memory(wrapper):
            return False
        self._known[index] = (wrapper, tc.impl_address(wrapper), key)
        return True
