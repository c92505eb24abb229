"""``KeyedColumn``: a read-only mapping of original keys to one value each, kept as two columns.

The release proof of a batch adoption reads a weak reference and an expired flag for every
original. As dicts they cost ~70 B and ~40 B an original at the batch's peak (an entry and an
int object each); as a key list shared with the transaction's originals, an ``array('q')`` of
references and a ``bytes`` of flags, 17 B. Lookups by key build the index on first use (only a
rollback after the release, and a late survivor, look one up).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

V = TypeVar("V", int, bool)


class KeyedColumn(Mapping[int, V], Generic[V]):
    """``keys[i] -> values[i]``; with ``flags`` the values read as ``bool`` (stored as bytes)."""

    __slots__ = ("_keys", "_values", "_flags", "_index")

    def __init__(self, keys: Sequence[int], values: Sequence[int], *, flags: bool = False) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        self._keys, self._values, self._flags = keys, values, flags
        self._index: dict[int, int] | None = None

    def _at(self, key: int) -> int:
        index = self._index
        if index is None:
            index = self._index = {k: i for i, k in enumerate(self._keys)}
        return index[key]

    def __getitem__(self, key: int) -> V:
        value = self._values[self._at(key)]
        return bool(value) if self._flags else value  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        try:
            self._at(key)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def key_list(self) -> Sequence[int]:
        """The keys, as stored (shared, not copied)."""
        return self._keys

    def in_order(self) -> Sequence[int]:
        """The values in key order, as stored (flags as bytes): no index, no object per key."""
        return self._values

    def values(self) -> Iterator[V]:  # type: ignore[override]
        out: Iterator[Any] = map(bool, self._values) if self._flags else iter(self._values)
        return out

    def items(self) -> Iterator[tuple[int, V]]:  # type: ignore[override]
        return zip(self._keys, self.values())


class Interned(dict[tuple[int, ...], tuple[int, ...]]):
    """Equal sizes and strides of a batch share one plain tuple (``torch.Size`` made a tuple):
    looked up at C speed with ``map(interned.__getitem__, ...)``."""

    def __missing__(self, key: tuple[int, ...]) -> tuple[int, ...]:
        value = self[key] = tuple(key)
        return value


__all__ = ["Interned", "KeyedColumn"]
