"""The manifest: what a process knows about its memory, as plain data that outlives it.

Built in the training process, written to JSON, read anywhere to attribute a snapshot of the
same process at the same moment (its addresses mean nothing otherwise).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from attrs import define

from ._errors import ManifestError, shown
from ._files import write_atomic

FORMAT = "flatpool-memory-manifest"
VERSION = 1

GapKind = Literal["padding", "free"]


@define(frozen=True)
class SliceEntry:
    """A live slice of a pool: ``[offset, offset + nbytes)`` of the pool's storage."""

    slice_id: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    alignment: int
    """The slice's start alignment (``max(pool alignment, element size)``)."""
    tensors: tuple[str, ...] = ()
    """Names of the root tensors lying in this slice (adopted or allocated there)."""

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@define(frozen=True)
class Gap:
    """Bytes of a pool outside every slice: alignment ``padding`` before a slice, or ``free``."""

    offset: int
    nbytes: int
    kind: GapKind

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@define(frozen=True)
class PoolEntry:
    """A materialized :class:`flatpool.FlatPool`: its storage range and layout."""

    name: str
    device: str
    address: int
    capacity: int
    alignment: int
    slices: tuple[SliceEntry, ...] = ()

    @property
    def end(self) -> int:
        return self.address + self.capacity

    @property
    def used_bytes(self) -> int:
        return sum(s.nbytes for s in self.slices)

    @property
    def adopted_bytes(self) -> int:
        """Bytes of slices in which a named root tensor lies."""
        return sum(s.nbytes for s in self.slices if s.tensors)

    def gaps(self) -> tuple[Gap, ...]:
        """Every byte range outside the slices, in order: ``padding`` when no slice can start
        in it (lost to alignment), else ``free``."""
        out: list[Gap] = []
        pos = 0
        for s in sorted(self.slices, key=lambda s: s.offset):
            if s.offset > pos:
                out.append(self._gap(pos, s.offset))
            pos = max(pos, s.end)
        if self.capacity > pos:
            out.append(self._gap(pos, self.capacity))
        return tuple(out)

    def _gap(self, start: int, end: int) -> Gap:
        first_start = -(-start // self.alignment) * self.alignment
        return Gap(start, end - start, "padding" if first_start >= end else "free")


@define(frozen=True)
class StorageEntry:
    """A storage outside every pool: reachable from the roots, or a declared flat buffer."""

    label: str
    device: str
    address: int
    nbytes: int
    names: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    stale_of: str | None = None
    """``"pool:slice_id"`` when the storage duplicates that live slice (census's stale check)."""

    @property
    def end(self) -> int:
        return self.address + self.nbytes


OriginalSource = Literal["watch", "pool"]


@define(frozen=True)
class OriginalEntry:
    """A storage that should be dead but is alive (watched, or kept alive by a pool)."""

    label: str
    address: int
    nbytes: int
    pool: str | None = None
    source: OriginalSource = "watch"
    device: str | None = None

    @property
    def end(self) -> int:
        return self.address + self.nbytes


@define(frozen=True)
class Manifest:
    pools: tuple[PoolEntry, ...] = ()
    flats: tuple[StorageEntry, ...] = ()
    tensors: tuple[StorageEntry, ...] = ()
    originals: tuple[OriginalEntry, ...] = ()

    def pool(self, name: str) -> PoolEntry:
        for p in self.pools:
            if p.name == name:
                return p
        raise ManifestError(f"no pool named {name!r} (have {[p.name for p in self.pools]})",
                            "pools")

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "pools": [
                {"name": p.name, "device": p.device, "address": p.address,
                 "capacity": p.capacity, "alignment": p.alignment,
                 "slices": [{"id": s.slice_id, "offset": s.offset, "nbytes": s.nbytes,
                             "dtype": s.dtype, "shape": list(s.shape),
                             "alignment": s.alignment, "tensors": list(s.tensors)}
                            for s in p.slices]}
                for p in self.pools
            ],
            "flats": [_storage_dict(f) for f in self.flats],
            "tensors": [_storage_dict(t) for t in self.tensors],
            "originals": [
                {"label": o.label, "address": o.address, "nbytes": o.nbytes, "pool": o.pool,
                 "source": o.source, "device": o.device}
                for o in self.originals
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the manifest as JSON, atomically (temporary file, then rename)."""
        write_atomic(path, (self.to_json() + "\n").encode())

    @staticmethod
    def from_dict(data: object) -> Manifest:
        return _parse(data)

    @staticmethod
    def from_json(text: str) -> Manifest:
        try:
            data = json.loads(text)
        except RecursionError as exc:  # json nests by recursion: a hostile file can outdo it
            raise ManifestError(
                "not a manifest: JSON nested deeper than Python's recursion limit (a manifest "
                "nests 4 levels; write one with Manifest.write())") from exc
        except ValueError as exc:  # JSONDecodeError, or an int over sys.get_int_max_str_digits
            raise ManifestError(f"not JSON a manifest can hold: {exc}") from exc
        return _parse(data)

    @staticmethod
    def read(path: str | os.PathLike[str]) -> Manifest:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ManifestError(f"cannot read manifest {os.fspath(path)!r}: {exc}") from exc
        return Manifest.from_json(text)


def _storage_dict(s: StorageEntry) -> dict[str, Any]:
    return {"label": s.label, "device": s.device, "address": s.address, "nbytes": s.nbytes,
            "names": list(s.names), "roles": list(s.roles), "stale_of": s.stale_of}


# -- parsing ---------------------------------------------------------------------------------
def _parse(data: object) -> Manifest:
    d = _obj(data, "")
    if d.get("format") != FORMAT:
        raise ManifestError(f"expected {FORMAT!r}, got {shown(d.get('format'))}: not a flatpool "
                            "memory manifest (write one with Manifest.write())", "format")
    if d.get("version") != VERSION:
        raise ManifestError(f"unsupported version {shown(d.get('version'))} (this flatpool reads "
                            f"{VERSION})", "version")
    pools = tuple(_pool(p, f"pools[{i}]") for i, p in enumerate(_list(d, "pools", "")))
    flats = tuple(_storage(s, f"flats[{i}]") for i, s in enumerate(_list(d, "flats", "")))
    tensors = tuple(_storage(s, f"tensors[{i}]") for i, s in enumerate(_list(d, "tensors", "")))
    originals = tuple(_original(o, f"originals[{i}]")
                      for i, o in enumerate(_list(d, "originals", "")))
    return Manifest(pools, flats, tensors, originals)


def _obj(value: object, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ManifestError(f"expected an object, got {type(value).__name__}", field or "manifest")
    return value


def _path(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def _list(d: Mapping[str, Any], key: str, field: str) -> Sequence[Any]:
    value = d.get(key, [])
    if not isinstance(value, list):
        raise ManifestError(f"expected a list, got {type(value).__name__}", _path(field, key))
    return value


def _int(d: Mapping[str, Any], key: str, field: str) -> int:
    if key not in d:
        raise ManifestError("missing", _path(field, key))
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(f"expected an int >= 0, got {shown(value)}", _path(field, key))
    return value


def _str(d: Mapping[str, Any], key: str, field: str, *, optional: bool = False) -> Any:
    value = d.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ManifestError("missing" if key not in d else
                            f"expected a string, got {type(value).__name__}", _path(field, key))
    return value


def _strs(d: Mapping[str, Any], key: str, field: str) -> tuple[str, ...]:
    items = _list(d, key, field)
    for i, v in enumerate(items):
        if not isinstance(v, str):
            raise ManifestError(f"expected a string, got {type(v).__name__}",
                                f"{_path(field, key)}[{i}]")
    return tuple(items)


def _pool(value: object, field: str) -> PoolEntry:
    d = _obj(value, field)
    slices = []
    for i, raw in enumerate(_list(d, "slices", field)):
        sf = f"{field}.slices[{i}]"
        s = _obj(raw, sf)
        shape = _list(s, "shape", sf)
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in shape):
            raise ManifestError(f"expected a list of ints >= 0, got {shown(shape)}", f"{sf}.shape")
        slices.append(SliceEntry(
            _int(s, "id", sf), _int(s, "offset", sf), _int(s, "nbytes", sf), _str(s, "dtype", sf),
            tuple(shape), max(1, _int(s, "alignment", sf)), _strs(s, "tensors", sf)))
    entry = PoolEntry(_str(d, "name", field), _str(d, "device", field), _int(d, "address", field),
                      _int(d, "capacity", field), max(1, _int(d, "alignment", field)),
                      tuple(slices))
    for i, slc in enumerate(entry.slices):
        if slc.end > entry.capacity:
            raise ManifestError(f"slice [{slc.offset}, {slc.end}) lies beyond the pool's "
                                f"capacity {entry.capacity}", f"{field}.slices[{i}]")
    return entry


def _storage(value: object, field: str) -> StorageEntry:
    d = _obj(value, field)
    return StorageEntry(
        _str(d, "label", field), _str(d, "device", field), _int(d, "address", field),
        _int(d, "nbytes", field), _strs(d, "names", field), _strs(d, "roles", field),
        _str(d, "stale_of", field, optional=True))


def _original(value: object, field: str) -> OriginalEntry:
    d = _obj(value, field)
    source = d.get("source", "watch")
    if source not in ("watch", "pool"):
        raise ManifestError(f"expected 'watch' or 'pool', got {shown(source)}", f"{field}.source")
    return OriginalEntry(
        _str(d, "label", field), _int(d, "address", field), _int(d, "nbytes", field),
        _str(d, "pool", field, optional=True), source,
        _str(d, "device", field, optional=True))
