"""``census``: list the distinct live storages reachable from roots, and who references them.

A storage outside every pool that holds the same bytes as a live slice is reported *stale*: a
hand-rolled fusion that left the originals alive. Gradients and optimizer state never are.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from attrs import define

from . import _torch_compat as tc
from ._aliasing import extent_of, local_tensor, own_storage
from ._devices import allocator_counters
from ._table import table
from .errors import InvalidTypeError
from .slices import Slice
from ._state import PoolState, live_states
from .pool import FlatPool
from ._gcpause import gc_paused
from ._interrupts import guarded_call

_LEGIT_ROLES = ("grad", "optimizer state")


@define(frozen=True)
class StorageRecord:
    """One live storage: where it lives, how big, which pool slice(s), who references it."""

    device: str
    nbytes: int
    pool: str | None
    slices: tuple[int, ...]
    referrers: tuple[str, ...]
    roles: tuple[str, ...]
    stale_of: str | None
    """For a stale storage: the pool slice whose bytes it duplicates."""

    @property
    def stale(self) -> bool:
        return self.stale_of is not None


@define(frozen=True)
class Census:
    records: tuple[StorageRecord, ...]
    allocator: dict[str, dict[str, int]]
    """Per accelerator device: the caching allocator's allocated/reserved bytes."""

    @property
    def stale(self) -> tuple[StorageRecord, ...]:
        return tuple(r for r in self.records if r.stale)

    @property
    def pool_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if r.pool is not None)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def render(self) -> str:
        rows = [("device", "bytes", "pool/slices", "status", "referenced as")]
        for r in sorted(self.records, key=lambda r: (r.pool is None, -r.nbytes)):
            where = f"{r.pool}:{','.join(map(str, r.slices))}" if r.pool else "-"
            status = f"STALE (copy of {r.stale_of})" if r.stale else (
                "pool" if r.pool else ", ".join(sorted(set(r.roles))) or "other")
            refs = ", ".join(r.referrers[:3]) + (f" (+{len(r.referrers) - 3})" if len(r.referrers) > 3 else "")
            rows.append((r.device, str(r.nbytes), where, status, refs))
        lines = table(rows)
        lines.append(
            f"{len(self.records)} storage(s), {self.total_bytes} bytes; in pools "
            f"{self.pool_bytes} bytes; stale {sum(r.nbytes for r in self.stale)} bytes "
            f"in {len(self.stale)} storage(s)")
        for dev, counters in self.allocator.items():
            lines.append(f"{dev} allocator: allocated {counters['allocated']} B, "
                         f"reserved {counters['reserved']} B")
        return "\n".join(lines)


def _walk(root: Any, name: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(name, role, tensor) for the tensors a root references."""
    if isinstance(root, torch.nn.Module):
        for n, p in root.named_parameters(remove_duplicate=False):
            yield f"{name}{n}", "parameter", p
            if p.grad is not None:
                yield f"{name}{n}.grad", "grad", p.grad
        for n, b in root.named_buffers(remove_duplicate=False):
            yield f"{name}{n}", "buffer", b
    elif isinstance(root, torch.optim.Optimizer):
        index = {id(p): f"{name}param[{g}][{i}]" for g, group in enumerate(root.param_groups)
                 for i, p in enumerate(group["params"])}
        for group in root.param_groups:
            for param in group["params"]:
                yield index[id(param)], "parameter", param
        for key, state in root.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    yield f"{index.get(id(key), name + 'state')}.{k}", "optimizer state", v
    elif isinstance(root, torch.Tensor):
        yield name.rstrip(".") or "tensor", "tensor", root
    elif isinstance(root, dict):
        for k, v in root.items():
            yield from _walk(v, f"{name}{k}.")
    elif isinstance(root, (list, tuple)):
        for i, v in enumerate(root):
            yield from _walk(v, f"{name}{i}.")
    else:
        for k, v in getattr(root, "__dict__", {}).items():
            if isinstance(v, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, dict, list, tuple)):
                yield from _walk(v, f"{name}{type(root).__name__}.{k}.")


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    return own_storage(local_tensor(t))


def census(*roots: Any, pools: Iterable[FlatPool] | None = None) -> Census:
    """Distinct live storages reachable from ``roots`` (modules, optimizers, tensors, dicts,
    lists, objects), or from every tensor in the process when no root is given.

    Holds every live pool's lock: the storage objects a census makes would otherwise pin a
    storage another thread's adoption is proving dead, and it never sees a half-moved pool.
    """
    pool_list: list[PoolState] | None = None
    if pools is not None:
        pool_list = []
        for p in pools:
            if not isinstance(p, FlatPool):
                raise InvalidTypeError(f"census(pools=...) takes pools, got {type(p).__name__}")
            pool_list.append(p._state)
    locked = all_locked({id(p): p for p in live_states() + (pool_list or [])}.values())
    # pause and locks taken and let go with signals deferred: an interrupt cannot leave either
    return guarded_call(lambda: _census(roots, pool_list), gc_paused(), locked)


LOCK_RETRY = 0.05
"""Seconds to wait for one pool's lock before letting go of the others and starting over."""


@contextmanager
def all_locked(pools: Iterable[PoolState]) -> Iterator[None]:
    """Hold every pool's lock, in one global order; one that does not come within
    :data:`LOCK_RETRY` makes us release all and retry, so two censuses cannot deadlock."""
    ordered = sorted(pools, key=id)
    pause = 0.001
    while True:
        held: list[PoolState] = []
        for p in ordered:
            if not p.lock.acquire(timeout=LOCK_RETRY):
                break
            held.append(p)
        else:
            break
        for p in reversed(held):
            p.lock.release()
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    try:
        yield
    finally:
        for p in reversed(held):
            p.lock.release()


def _census(roots: tuple[Any, ...], pools: list[PoolState] | None) -> Census:
    found: list[tuple[str, str, torch.Tensor]] = []
    if roots:
        for i, root in enumerate(roots):
            found.extend(_walk(root, "" if len(roots) == 1 else f"root{i}."))
    else:
        with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    found.append((f"{type(obj).__name__}{tuple(obj.shape)}", "tensor", obj))
    pool_list = pools if pools is not None else live_states()
    pool_keys = {p.storage_key: p for p in pool_list if p.storage_key is not None}

    groups: dict[int, dict[str, Any]] = {}
    sizes: dict[int, tuple[str, int]] = {}  # key -> (device, nbytes); no storage object kept
    for name, role, t in found:
        s = _storage(t)
        if s is None:
            continue
        key = tc.storage_key(s)
        if key not in sizes:
            sizes[key] = (str(s.device), s.nbytes())
        del s
        g = groups.setdefault(key, {"seen": set(), "names": [], "roles": [], "tensors": []})
        if name not in g["seen"]:  # a set: one storage may have thousands of names
            g["seen"].add(name)
            g["names"].append(name)
            g["roles"].append(role)
            g["tensors"].append(local_tensor(t))

    contents = _SliceContents(pool_list)

    records: list[StorageRecord] = []
    for key, g in groups.items():
        device, nbytes = sizes[key]
        pool = pool_keys.get(key)
        slices: tuple[int, ...] = ()
        stale_of: str | None = None
        if pool is not None:
            slices = tuple(sorted({sl.slice_id for t in g["tensors"]
                                   if (sl := pool.slice_of(t)) is not None}))
        elif any(r not in _LEGIT_ROLES for r in g["roles"]):
            stale_of = _duplicate_of(g["tensors"], g["roles"], contents)
        records.append(StorageRecord(
            device=device, nbytes=nbytes, pool=pool.name if pool else None,
            slices=slices, referrers=tuple(g["names"]), roles=tuple(g["roles"]), stale_of=stale_of,
        ))
    allocator: dict[str, dict[str, int]] = {}
    for dev in {torch.device(r.device) for r in records} | {p.device for p in pool_list}:
        counters = allocator_counters(dev)
        if counters is not None:
            allocator[str(dev)] = counters
    return Census(tuple(records), allocator)


def _duplicate_of(
    tensors: list[torch.Tensor], roles: list[str], contents: _SliceContents,
) -> str | None:
    for t, role in zip(tensors, roles):
        if role in _LEGIT_ROLES:
            continue
        with tc.no_torch_function():
            if tc.impl_is_meta(t):
                continue
            nbytes = tc.impl_numel(t) * tc.impl_element_size(t)
            if not contents.has_size(nbytes) or not tc.impl_is_contiguous(t):
                continue
            if tc.impl_untyped_storage(t).nbytes() < extent_of(t).end:
                continue  # storage resized away (FSDP frees unsharded parameters so): unreadable
            label = contents.copy_of(t.reshape(-1).view(torch.uint8))
            if label is not None:
                return label
    return None


_Fingerprint = tuple[int, ...]
_Entry = tuple[str, PoolState, Slice]  # ("pool:slice_id", pool, slice)


def _fingerprint(raw: torch.Tensor) -> _Fingerprint:
    """A summary of ``raw``'s bytes (their sum and ~17 sampled bytes): equal bytes give equal
    fingerprints, different bytes almost never; a few kernels however large ``raw`` is."""
    step = max(1, raw.numel() // 16)
    parts = (raw.sum(dtype=torch.int64).reshape(1), raw[::step], raw[-1:])
    return tuple(torch.cat([t.to(torch.int64) for t in parts]).tolist())


class _SliceContents:
    """The live slices of ``pools``, looked up by their bytes for the stale check: each slice
    is fingerprinted once, and a tensor compared byte for byte only with slices of its
    fingerprint (linear, where thousands of same-shaped members would make it quadratic)."""

    def __init__(self, pools: Iterable[PoolState]) -> None:
        self._by_size: dict[int, list[_Entry]] = {}
        for p in pools:
            if p.is_materialized:
                for slc in p.slices():
                    entry = (f"{p.name}:{slc.slice_id}", p, slc)
                    self._by_size.setdefault(slc.nbytes, []).append(entry)
        self._by_print: dict[tuple[int, torch.device], dict[_Fingerprint, list[_Entry]]] = {}

    def has_size(self, nbytes: int) -> bool:
        return nbytes in self._by_size

    def copy_of(self, raw: torch.Tensor) -> str | None:
        """The label of the first slice whose bytes equal ``raw``'s, or ``None``."""
        key = (raw.numel(), raw.device)
        index = self._by_print.get(key)
        if index is None:
            index = self._by_print[key] = {}
            for entry in self._by_size.get(raw.numel(), ()):
                pool, slc = entry[1], entry[2]
                if pool.device == raw.device:
                    index.setdefault(_fingerprint(pool.slice_bytes(slc)), []).append(entry)
        for label, pool, slc in index.get(_fingerprint(raw), ()):
            if torch.equal(pool.slice_bytes(slc), raw):
                return label
        return None
