"""Watch lists: storages that should be dead, checked without keeping them alive.

Anything with ``alive_storages()`` is a watch list (:class:`StorageWatch`), so this package
imports neither the HSDP layer nor the pool's record of kept originals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, Union, runtime_checkable

import torch
from attrs import define
from torch.multiprocessing.reductions import StorageWeakRef

from .. import _torch_compat as tc
from .. import InvalidTypeError, local_tensor, own_storage


@runtime_checkable
class StorageWatch(Protocol):
    """A source of storages that should be dead: ``(label, address, nbytes)`` of survivors."""

    def alive_storages(self) -> Iterable[tuple[str, int, int]]: ...


@define(frozen=True)
class _Watched:
    label: str
    ref: StorageWeakRef
    address: int
    nbytes: int
    device: str


WatchInput = Union[Mapping[str, Union[torch.Tensor, Iterable[torch.Tensor]]],
                   Iterable[torch.Tensor]]


class WatchedStorages:
    """Weak references to the storages behind tensors (a :class:`StorageWatch`), each once,
    taken before a step that should free them; wrappers are seen through to their shard."""

    def __init__(self, tensors: WatchInput = ()) -> None:
        self._watched: list[_Watched] = []
        self._keys: set[int] = set()
        if isinstance(tensors, torch.Tensor):
            raise InvalidTypeError("WatchedStorages() needs a mapping or an iterable of "
                                   "tensors, got a single tensor: pass [tensor]")
        if isinstance(tensors, Mapping):
            for label, value in tensors.items():
                group = [value] if isinstance(value, torch.Tensor) else list(value)
                self.watch(str(label), *group)
        else:
            for i, t in enumerate(tensors):
                self.watch(f"[{i}]", t)

    def watch(self, label: str, *tensors: torch.Tensor) -> None:
        """Watch the storages of ``tensors`` under ``label``."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(f"{label}: expected a torch.Tensor, got {type(t).__name__}")
            storage = own_storage(local_tensor(t))
            if storage is None:
                continue
            key = tc.storage_key(storage)
            if key in self._keys:
                continue
            self._keys.add(key)
            ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
            self._watched.append(_Watched(label, ref, int(storage.data_ptr()), storage.nbytes(),
                                          str(storage.device)))

    def __len__(self) -> int:
        return len(self._watched)

    def alive_storages(self) -> list[tuple[str, int, int]]:
        """``(label, address, nbytes)`` of every watched storage still holding memory, read now."""
        return [(label, address, nbytes) for label, address, nbytes, _ in self.alive_records()]

    def alive_records(self) -> list[tuple[str, int, int, str]]:
        """:meth:`alive_storages` with each storage's device (``"cpu"``, ``"cuda:0"``)."""
        out: list[tuple[str, int, int, str]] = []
        for w in self._watched:
            if w.ref.expired():  # type: ignore[no-untyped-call]
                continue
            current = _current(w)
            if current is not None and current[1] > 0:
                out.append((w.label, current[0], current[1], w.device))
        return out

    @property
    def alive_bytes(self) -> int:
        return sum(n for _, _, n in self.alive_storages())


def _current(w: _Watched) -> tuple[int, int] | None:
    """(address, nbytes) of a live watched storage, looked up without keeping it alive."""
    revive = getattr(torch.UntypedStorage, "_new_with_weak_ptr", None)
    if revive is None:  # older torch: the address recorded when it was watched
        return w.address, w.nbytes
    storage = revive(w.ref.cdata)
    if storage is None:
        return None
    try:
        return int(storage.data_ptr()), int(storage.nbytes())
    finally:
        del storage
