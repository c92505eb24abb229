"""Originals an adoption left alive (``on_pinned="warn"``/``"force"``), as the pool remembers them.

Held weakly when others hold them; held by the pool when only a holder outside Python (a
DLPack consumer) does, until that holder lets go of the moved tensor's TensorImpl.
"""

from __future__ import annotations

import torch
from attrs import define

from . import _torch_compat as tc
from ._registry import Ref, tensor_ref


@define(frozen=True)
class UnreleasedOriginal:
    """An adopted original that an ``on_pinned="warn"``/``"force"`` adoption left alive."""

    label: str
    nbytes: int
    address: int
    """Data pointer of the original storage (for attributing allocator snapshots)."""
    device: str
    kept_by_pool: bool
    """The pool keeps it for a holder outside Python, until ``pool.release_kept()``."""


class Trace:
    """An unreleased original: a weak reference, or a strong one the pool keeps."""

    __slots__ = ("info", "weak", "storage", "tensor_ref")

    def __init__(
        self, info: UnreleasedOriginal, storage: torch.UntypedStorage, tensor: torch.Tensor | None
    ) -> None:
        self.info: UnreleasedOriginal = info
        self.weak: int = tc.weak_storage(storage)
        self.storage: torch.UntypedStorage | None = storage if info.kept_by_pool else None
        self.tensor_ref: Ref | None = tensor_ref(tensor) if tensor is not None else None

    def alive(self) -> bool:
        return not tc.weak_expired(self.weak)

    def __del__(self) -> None:
        tc.weak_free(self.weak)

    def release_if_free(self) -> bool:
        """Let go of a kept original once its moved tensor has no other owner; True if now."""
        if self.storage is None:
            return False
        tensor = self.tensor_ref() if self.tensor_ref is not None else None
        if tensor is None or tc.tensor_impl_users(tensor) <= 1:
            self.storage = None
            return True
        return False
