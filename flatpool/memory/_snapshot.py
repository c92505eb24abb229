"""Read a caching-allocator snapshot into checked, typed segments and blocks.

Every malformed entry raises :class:`SnapshotError` naming its path. Pickles are read with an
unpickler that refuses every class: snapshots hold only builtins, and anything else could run code.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any, Union

from attrs import define

from ._errors import SnapshotError, shown

ACTIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")
"""States of a block that holds memory (in use, or freed but still used by a stream)."""
STATES = ACTIVE_STATES + ("inactive",)

MAX_BLOCKS = 2_000_000
"""Blocks a snapshot may list (about 0.7 GB parsed); ``max_blocks=``/``--max-blocks`` raise it."""


@define(frozen=True)
class Block:
    """One allocator block: ``[address, address + size)`` in state ``state``."""

    address: int
    size: int
    requested_size: int
    state: str
    where: str | None = None
    """The first non-torch frame of the allocation's stack trace, when it was recorded."""

    @property
    def end(self) -> int:
        return self.address + self.size

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


@define(frozen=True)
class Segment:
    """Memory one device allocation returned (``cudaMalloc``/``aclrtMalloc``), cut into blocks."""

    address: int
    total_size: int
    blocks: tuple[Block, ...]
    device: int | None = None
    segment_type: str | None = None

    @property
    def end(self) -> int:
        return self.address + self.total_size

    @property
    def active_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.active)


@define(frozen=True)
class Snapshot:
    """Checked segments, sorted by (device, address); blocks sorted by address."""

    segments: tuple[Segment, ...]
    source: str = "allocator"
    """``"allocator"`` for a device snapshot, ``"cpu census"`` for :func:`cpu_snapshot`'s record."""

    @property
    def active_bytes(self) -> int:
        return sum(s.active_bytes for s in self.segments)

    @property
    def reserved_bytes(self) -> int:
        return sum(s.total_size for s in self.segments)

    @property
    def block_count(self) -> int:
        return sum(len(s.blocks) for s in self.segments)


SnapshotSource = Union[Snapshot, Mapping[str, Any], Sequence[Any], str, os.PathLike[str]]


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(
            f"the pickle refers to {module}.{name}; an allocator snapshot holds only dicts, "
            "lists, strings and numbers, so this is not one (nothing was executed)")


def read_pickle(path: str | os.PathLike[str]) -> Any:
    """Unpickle ``path`` refusing every class (see the module docstring)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot file {os.fspath(path)!r}: {exc}") from exc
    try:
        return _DataOnlyUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except Exception as exc:  # UnpicklingError, EOFError, ValueError, ... on a non-pickle
        raise SnapshotError(
            f"{os.fspath(path)!r} is not a pickled allocator snapshot "
            f"({type(exc).__name__}: {exc}); write one with torch.cuda.memory._dump_snapshot()"
        ) from exc


def load_snapshot(source: SnapshotSource, *, max_blocks: int = MAX_BLOCKS) -> Snapshot:
    """A checked :class:`Snapshot` from a snapshot dict, a segment list or a pickle path."""
    if isinstance(source, Snapshot):
        return source
    if isinstance(source, (str, os.PathLike)):
        return parse_snapshot(read_pickle(source), max_blocks=max_blocks)
    return parse_snapshot(source, max_blocks=max_blocks)


def _check_size(raw: Sequence[Any], max_blocks: int) -> None:
    """Refuse more than ``max_blocks`` blocks, or one entry listed twice, before building:
    a pickle's memo lets a small file name one block a million times."""
    seen_segments: set[int] = set()
    seen_blocks: set[int] = set()
    total = 0
    for i, seg in enumerate(raw):
        if id(seg) in seen_segments:
            raise SnapshotError("the same segment entry is listed more than once (a pickle "
                                "that repeats one object through its memo is not an allocator "
                                "snapshot)", f"segments[{i}]")
        seen_segments.add(id(seg))
        blocks = seg.get("blocks") if isinstance(seg, Mapping) else None
        if not isinstance(blocks, Sequence) or isinstance(blocks, (str, bytes)):
            continue  # reported with its path by _segment
        total += len(blocks)
        if total > max_blocks:
            raise SnapshotError(
                f"more than {max_blocks:,} blocks (the limit; real allocator snapshots list "
                "far fewer): refusing to expand it. Raise it with max_blocks= (CLI: "
                "--max-blocks) if this snapshot is genuine", "segments")
        for j, b in enumerate(blocks):
            if isinstance(b, Mapping):
                if id(b) in seen_blocks:
                    raise SnapshotError(
                        "the same block entry is listed more than once (a pickle that repeats "
                        "one object through its memo is not an allocator snapshot)",
                        f"segments[{i}].blocks[{j}]")
                seen_blocks.add(id(b))


def parse_snapshot(data: object, *, max_blocks: int = MAX_BLOCKS) -> Snapshot:
    """Check ``data`` (a snapshot dict or a list of segments) and type it."""
    source = "allocator"
    if isinstance(data, Mapping):
        if "segments" not in data:
            keys = ", ".join(sorted(k if isinstance(k, str) else shown(k, 30) for k in data)[:8])
            keys = keys or "none"
            raise SnapshotError(
                f"missing; a snapshot dict has a 'segments' list (keys found: {keys})", "segments")
        raw = data["segments"]
        tag = data.get("flatpool_source")
        if isinstance(tag, str):
            source = tag
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        raw = data
    else:
        raise SnapshotError(
            f"expected a snapshot dict with 'segments' (or a list of segments), got "
            f"{type(data).__name__}")
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise SnapshotError(f"expected a list, got {type(raw).__name__}", "segments")
    _check_size(raw, max_blocks)
    named: dict[int, str | None] = {}  # frames list (by identity) -> its name, for this parse
    segments = [_segment(seg, f"segments[{i}]", named) for i, seg in enumerate(raw)]
    segments.sort(key=lambda s: (s.device if s.device is not None else -1, s.address))
    for prev, nxt in zip(segments, segments[1:]):
        if prev.device == nxt.device and nxt.address < prev.end:
            raise SnapshotError(
                f"segments [{prev.address:#x}, {prev.end:#x}) and [{nxt.address:#x}, "
                f"{nxt.end:#x}) overlap on one device", "segments"
            )
    return Snapshot(tuple(segments), source)


def _int(value: object, field: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SnapshotError(f"expected an int, got {type(value).__name__}: {shown(value)}", field)
    out = int(value)
    if out < minimum:
        raise SnapshotError(f"must be >= {minimum}, got {out}", field)
    return out


def _dict(value: object, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SnapshotError(f"expected a dict, got {type(value).__name__}", field)
    return value


def _required(d: Mapping[str, Any], key: str, field: str) -> Any:
    if key not in d:
        raise SnapshotError("missing", f"{field}.{key}")
    return d[key]


def _segment(value: object, field: str, named: dict[int, str | None]) -> Segment:
    d = _dict(value, field)
    address = _int(_required(d, "address", field), f"{field}.address")
    total = _int(_required(d, "total_size", field), f"{field}.total_size")
    raw_blocks = _required(d, "blocks", field)
    if not isinstance(raw_blocks, Sequence) or isinstance(raw_blocks, (str, bytes)):
        raise SnapshotError(f"expected a list, got {type(raw_blocks).__name__}", f"{field}.blocks")
    device = d.get("device")
    dev = None if device is None else _int(device, f"{field}.device")
    kind = d.get("segment_type")
    blocks: list[Block] = []
    cursor = address
    for j, raw in enumerate(raw_blocks):
        b = _block(raw, f"{field}.blocks[{j}]", cursor, named)
        if b.address < address or b.end > address + total:
            raise SnapshotError(
                f"block [{b.address:#x}, {b.end:#x}) lies outside its segment "
                f"[{address:#x}, {address + total:#x})", f"{field}.blocks[{j}]"
            )
        cursor = b.end
        blocks.append(b)
    blocks.sort(key=lambda b: b.address)
    for prev, nxt in zip(blocks, blocks[1:]):
        if nxt.address < prev.end:
            raise SnapshotError(
                f"blocks at {prev.address:#x} ({prev.size} B) and {nxt.address:#x} overlap",
                f"{field}.blocks")
    return Segment(address, total, tuple(blocks), dev, kind if isinstance(kind, str) else None)


def _block(value: object, field: str, cursor: int, named: dict[int, str | None]) -> Block:
    d = _dict(value, field)
    size = _int(_required(d, "size", field), f"{field}.size")
    state = _required(d, "state", field)
    if not isinstance(state, str) or state not in STATES:
        raise SnapshotError(f"expected one of {', '.join(STATES)}, got {shown(state)}",
                            f"{field}.state")
    address = _int(d["address"], f"{field}.address") if "address" in d else cursor
    requested = d.get("requested_size")
    req = size if requested is None else _int(requested, f"{field}.requested_size")
    frames = d.get("frames")
    if id(frames) not in named:  # one frames list shared by many blocks is read once
        named[id(frames)] = _where(frames, f"{field}.frames")
    return Block(address, size, req, state, named[id(frames)])


MAX_FRAMES = 256
"""Frames of one block searched for one outside torch (a shared list must not cost its length)."""


def _frame_field(frame: Mapping[str, Any], key: str, kind: type, field: str) -> str:
    """``frame[key]`` as text; a value of another type is a :class:`SnapshotError`."""
    value = frame.get(key)
    if value is None:
        return "?"
    if isinstance(value, bool) or not isinstance(value, kind):
        raise SnapshotError(f"expected {'a string' if kind is str else 'an int'}, got "
                            f"{type(value).__name__}: {shown(value)}", f"{field}.{key}")
    if isinstance(value, int) and abs(value) >= 1 << 63:
        raise SnapshotError(f"expected a line number, got {shown(value)}", f"{field}.{key}")
    return str(value)


def _where(frames: object, field: str) -> str | None:
    """``file:line (function)`` of the first frame outside torch, for naming unknown blocks."""
    if frames is None:
        return None
    if not isinstance(frames, Sequence) or isinstance(frames, (str, bytes)):
        raise SnapshotError(f"expected a list, got {type(frames).__name__}", field)
    fallback: str | None = None
    for k, frame in enumerate(frames[:MAX_FRAMES]):
        if not isinstance(frame, Mapping):
            continue
        filename = _frame_field(frame, "filename", str, f"{field}[{k}]")
        line = _frame_field(frame, "line", int, f"{field}[{k}]")
        name = _frame_field(frame, "name", str, f"{field}[{k}]")
        text = f"{os.path.basename(filename)}:{line} ({name})"
        fallback = fallback or text
        if "/torch/" not in filename and not filename.startswith("??"):
            return text
    return fallback
