"""Typed access to storage weak references, the basis of every release proof.

``StorageWeakRef`` (torch.multiprocessing.reductions) sees C++ references too: a storage whose
weak reference expired is freed, whoever held it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef as _TorchStorageWeakRef


class StorageRef(Protocol):
    cdata: int

    def expired(self) -> bool: ...


_make = cast(Callable[[torch.UntypedStorage], StorageRef], _TorchStorageWeakRef)
_upgrade = cast(Callable[[int], torch.UntypedStorage], torch.UntypedStorage._new_with_weak_ptr)
_new_storage = cast(Callable[..., torch.UntypedStorage], torch.UntypedStorage)


def weak_storage(storage: torch.UntypedStorage) -> StorageRef:
    return _make(storage)


def upgrade(ref: StorageRef) -> torch.UntypedStorage | None:
    """The storage again, if it is still alive."""
    if ref.expired():
        return None
    return _upgrade(ref.cdata)


def new_storage(nbytes: int, device: torch.device) -> torch.UntypedStorage:
    return _new_storage(nbytes, device=device)


__all__ = ["Any", "StorageRef", "new_storage", "upgrade", "weak_storage"]
