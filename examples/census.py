"""Account for a group's shard storages: which are live, and which originals outlived a fusion.

A fusion step is correct only if, afterwards, the members' data lives in the flat buffers and
*nothing else*: the storages the shards had before must be dead. This module gives the two
measurements the demo and the tests print and assert:

* :func:`live_storages`: every distinct storage reachable from the members (padded data and its
  autograd base, the local tensor and its base, a storage-sharing wrapper), with its bytes;
* :class:`OriginalStorages`: weak references to the members' storages taken *before* fusion;
  :meth:`OriginalStorages.stale` lists those still alive after it (C++ references included).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from attrs import define
from torch.multiprocessing.reductions import StorageWeakRef

from flatpool import local_tensor, own_storage
from flatpool import _torch_compat as tc

from flatpool.integrations.hsdp import ShardedParam


def member_tensors(p: ShardedParam) -> list[torch.Tensor]:
    """Every tensor object through which member ``p`` can reach a shard storage."""
    out: list[torch.Tensor] = []
    todo: list[torch.Tensor] = [p._sharded_param_data, p.sharded_param]
    local = local_tensor(p.sharded_param)
    if local is not p.sharded_param:
        todo.append(local)
    seen: set[int] = set()
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append(t)
        with tc.no_torch_function():  # the tensor's own autograd base, past overrides
            base = tc.impl_base(t)
        if base is not None:
            todo.append(base)
    return out


@define(frozen=True)
class LiveStorage:
    """One distinct live storage reachable from a group."""

    key: int
    nbytes: int
    kind: str
    """``"flat"`` when it is one of the given flat buffers' storage, else ``"shard"``."""


def live_storages(
    params: Iterable[ShardedParam], flats: Sequence[torch.Tensor] = ()
) -> list[LiveStorage]:
    """Distinct storages reachable from ``params`` (and the ``flats``), largest first."""
    flat_keys = set()
    found: dict[int, torch.UntypedStorage] = {}
    for f in flats:
        s = own_storage(f)
        if s is not None:
            flat_keys.add(tc.storage_key(s))
            found[tc.storage_key(s)] = s
    for p in params:
        for t in member_tensors(p):
            s = own_storage(t)
            if s is not None and s.nbytes() > 0:
                found.setdefault(tc.storage_key(s), s)
    rows = [
        LiveStorage(k, s.nbytes(), "flat" if k in flat_keys else "shard") for k, s in found.items()
    ]
    return sorted(rows, key=lambda r: (r.kind, -r.nbytes))


@define(frozen=True)
class _Tracked:
    name: str
    ref: StorageWeakRef
    nbytes: int
    address: int


class OriginalStorages:
    """Weak references to members' shard storages, taken before a fusion step.

    Holding one never keeps a storage alive; :meth:`stale` afterwards names the originals that
    survived (each one is memory the fusion step failed to give back).
    """

    def __init__(self, params: Sequence[ShardedParam], names: Sequence[str] | None = None):
        self._tracked: list[_Tracked] = []
        seen: set[int] = set()
        for i, p in enumerate(params):
            name = names[i] if names is not None else f"[{i}]"
            for t in member_tensors(p):
                s = own_storage(t)
                if s is None or s.nbytes() == 0 or tc.storage_key(s) in seen:
                    continue
                seen.add(tc.storage_key(s))
                ref = StorageWeakRef(s)  # type: ignore[no-untyped-call]
                self._tracked.append(_Tracked(name, ref, s.nbytes(), s.data_ptr()))

    def __len__(self) -> int:
        return len(self._tracked)

    def stale(self) -> list[tuple[str, int]]:
        """``(member name, bytes)`` for every tracked original that is still alive."""
        return [(t.name, t.nbytes) for t in self._tracked if not t.ref.expired()]  # type: ignore[no-untyped-call]

    @property
    def stale_bytes(self) -> int:
        return sum(n for _, n in self.stale())

    def alive_storages(self) -> list[tuple[str, int, int]]:
        """``(member name, address, bytes)`` of the originals still alive: a
        :class:`flatpool.memory.StorageWatch`, so a memory attribution marks them stale."""
        return [(t.name, t.address, t.nbytes) for t in self._tracked
                if not t.ref.expired()]  # type: ignore[no-untyped-call]


__all__ = ["LiveStorage", "OriginalStorages", "live_storages", "member_tensors", "own_storage"]
