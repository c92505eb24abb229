"""Build a :class:`Manifest` from live objects: pools, roots, flat buffers and watch lists.

Addresses come from storages, never a tensor's ``data_ptr()`` (views start inside, wrappers
override it). Stale copies are found by :func:`flatpool.census`, so the rule is census's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch

from .. import _torch_compat as tc
from .. import FlatPool, InvalidTypeError, census, live_pools, local_tensor, own_storage
from ._manifest import Manifest, OriginalEntry, PoolEntry, SliceEntry, StorageEntry
from ._walk import LEGIT_OWN_STORAGE, walk_roots
from ._watch import StorageWatch, WatchedStorages

Watches = Union[StorageWatch, Iterable[StorageWatch]]


def build_manifest(roots: object = None, *, pools: Iterable[FlatPool] | None = None,
                   flats: Sequence[torch.Tensor] = (), watch: Watches = (),
                   max_depth: int = 6) -> Manifest:
    """What flatpool can name in this process's memory, as a :class:`Manifest`.

    Args:
        roots: objects to walk for named tensors and pools (:func:`walk_roots`).
        pools: pools besides those found; ``None``: every live pool, as :func:`census` does.
        flats: flat buffers built by hand (not pools).
        watch: :class:`StorageWatch` lists whose survivors are stale originals (each pool
            adds the originals its adoptions left alive).
    """
    walked = walk_roots(roots, max_depth=max_depth)
    pool_list: list[FlatPool] = []
    for p in [*(live_pools() if pools is None else pools), *walked.pools]:
        if not isinstance(p, FlatPool):
            raise InvalidTypeError(f"pools must hold FlatPool objects, got {type(p).__name__}")
        if p.is_materialized and all(p is not q for q in pool_list):
            pool_list.append(p)
    by_pool_key: dict[int, FlatPool] = {tc.storage_key(p.storage): p for p in pool_list}
    slice_names: dict[tuple[int, int], list[str]] = {}

    groups: dict[int, _Group] = {}
    for found in walked.tensors:
        t = local_tensor(found.tensor)
        storage = own_storage(t)
        if storage is None:
            continue
        key = tc.storage_key(storage)
        pool = by_pool_key.get(key)
        if pool is not None:
            slc = pool.slice_of(t)
            if slc is not None:
                names = slice_names.setdefault((id(pool), slc.slice_id), [])
                if found.name not in names:
                    names.append(found.name)
            continue
        groups.setdefault(key, _Group(storage)).add(found.name, found.role, t)

    flat_entries: list[StorageEntry] = []
    for i, f in enumerate(flats):
        if not isinstance(f, torch.Tensor):
            raise InvalidTypeError(f"flats[{i}] is a {type(f).__name__}, not a tensor")
        storage = own_storage(local_tensor(f))
        if storage is None or tc.storage_key(storage) in by_pool_key:
            continue  # a pool's flat view: the pool covers it
        g = groups.pop(tc.storage_key(storage), None) or _Group(storage)
        if any(e.address == storage.data_ptr() for e in flat_entries):
            continue
        flat_entries.append(StorageEntry(
            f"flat[{i}]", str(storage.device), int(storage.data_ptr()), storage.nbytes(),
            tuple(g.names), ("flat buffer", *g.roles)))

    stale = _stale_copies(groups, pool_list)
    tensors = [
        StorageEntry(g.names[0], str(g.storage.device), int(g.storage.data_ptr()),
                     g.storage.nbytes(), tuple(g.names), tuple(g.roles), stale.get(key))
        for key, g in groups.items()
    ]
    return Manifest(
        pools=tuple(_pool_entry(p, slice_names) for p in pool_list),
        flats=tuple(flat_entries),
        tensors=tuple(tensors),
        originals=tuple(_originals(watch, pool_list)))


class _Group:
    """The tensors found on one storage outside the pools."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage
        self.names: list[str] = []
        self.roles: list[str] = []
        self.tensors: list[torch.Tensor] = []

    def add(self, name: str, role: str, t: torch.Tensor) -> None:
        if name not in self.names:
            self.names.append(name)
            self.roles.append(role)
            self.tensors.append(t)


def _stale_copies(groups: dict[int, _Group], pools: list[FlatPool]) -> dict[int, str]:
    """Storage key -> ``"pool:slice"`` for storages census calls stale copies of a slice."""
    if not pools:
        return {}
    candidates: list[tuple[int, torch.Tensor]] = [
        (key, t) for key, g in groups.items() for t, role in zip(g.tensors, g.roles)
        if role not in LEGIT_OWN_STORAGE
    ]
    if not candidates:
        return {}
    tensors = [t for _, t in candidates]
    result = census(*tensors, pools=pools)
    index = {("tensor" if len(tensors) == 1 else f"root{i}"): key
             for i, (key, _) in enumerate(candidates)}
    out: dict[int, str] = {}
    for record in result.records:
        if record.stale_of is None:
            continue
        for name in record.referrers:
            if name in index:
                out[index[name]] = record.stale_of
    return out


def _pool_entry(p: FlatPool, names: dict[tuple[int, int], list[str]]) -> PoolEntry:
    with p.lock:
        slices = tuple(
            SliceEntry(s.slice_id, s.offset, s.nbytes, str(s.dtype).replace("torch.", ""),
                       tuple(s.shape), p.slice_alignment(s.dtype),
                       tuple(names.get((id(p), s.slice_id), ())))
            for s in p.slices())
        storage = p.storage
        result = PoolEntry(p.name, str(p.device), int(storage.data_ptr()), p.capacity,
                           p.alignment, slices)
        return result  # not `return f()`: see flatpool._interrupts


def _watch_list(watch: Watches) -> list[StorageWatch]:
    if isinstance(watch, StorageWatch):
        return [watch]
    out = list(watch)
    for i, w in enumerate(out):
        if not isinstance(w, StorageWatch):
            raise InvalidTypeError(
                f"watch[{i}] is a {type(w).__name__} without alive_storages(): pass a "
                "WatchedStorages (or any object with alive_storages() -> (label, address, "
                "nbytes) triples)")
    return out


def _records(w: StorageWatch) -> list[tuple[str, int, int, str | None]]:
    if isinstance(w, WatchedStorages):
        return [(label, a, n, d) for label, a, n, d in w.alive_records()]
    out: list[tuple[str, int, int, str | None]] = []
    for item in w.alive_storages():
        label, address, nbytes = _triple(item, w)
        out.append((label, address, nbytes, None))
    return out


def _triple(item: Any, w: object) -> tuple[str, int, int]:
    ok = (isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], str)
          and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in item[1:]))
    if not ok:
        raise InvalidTypeError(
            f"{type(w).__name__}.alive_storages() gave {item!r:.80}; expected (label: str, "
            "address: int, nbytes: int) triples")
    return item[0], item[1], item[2]


def _originals(watch: Watches, pools: list[FlatPool]) -> list[OriginalEntry]:
    out: list[OriginalEntry] = []
    for w in _watch_list(watch):
        out.extend(OriginalEntry(label, a, n, None, "watch", d) for label, a, n, d in _records(w))
    for p in pools:  # what the pool's warn/force adoptions left alive (pinned or kept)
        out.extend(OriginalEntry(u.label, u.address, u.nbytes, p.name, "pool", u.device)
                   for u in p.unreleased_originals())
    return out
