"""``Slice``: an immutable, typed handle on a byte range of one pool."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch
from attrs import define, field

import flatpool  # for ``pool``'s annotation only: the package, whose FlatPool exists by the time
# anyone resolves it (``typing.get_type_hints``); importing flatpool.pool here would be a circle


@define(frozen=True)
class Slice:
    """A typed region ``[offset, offset + nbytes)`` of a pool's storage.

    It holds no tensor (:meth:`tensor` views the *current* storage, so no old storage is kept
    alive); ``slice_id`` is never reused in a pool, so a stale handle is caught.
    """

    pool: flatpool.FlatPool = field(repr=lambda p: repr(p.name))
    slice_id: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def end(self) -> int:
        """One past the last byte of the slice."""
        return self.offset + self.nbytes

    @property
    def is_live(self) -> bool:
        """``False`` once the slice was freed (or its pool relocated it under a new handle)."""
        return self.pool._state.is_live(self)

    def tensor(self) -> torch.Tensor:
        """A view of the slice on the pool's storage (materializing the pool if needed)."""
        return self.pool._state.view(self)

    def bytes(self) -> torch.Tensor:
        """The slice's bytes as a 1-D ``uint8`` view."""
        return self.pool._state.slice_bytes(self)

    # -- copying: a handle is a value; its pool's memory cannot be duplicated ------------------
    def __copy__(self) -> Slice:
        """The same handle: equal to the original, live as long as it is."""
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Slice:
        """The same handle: a deep copy cannot duplicate the pool's memory."""
        return self

    def __reduce__(self) -> Any:
        from .errors import InvalidTypeError

        raise InvalidTypeError(
            f"slice {self.slice_id} of pool {self.pool.name!r} cannot be pickled: it is a handle "
            "on a live pool's memory, which another process cannot see. Save its values "
            "(slice.tensor().clone()) or its layout (offset, shape, dtype) instead")


_new = object.__new__
_FIELDS = ("pool", "slice_id", "offset", "shape", "dtype")
_setters = tuple(getattr(Slice, f).__set__ for f in _FIELDS)  # the slots' own descriptors


def slice_run(
    pool: flatpool.FlatPool, ids: Sequence[int], offsets: Sequence[int],
    shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
) -> list[Slice]:
    """``[Slice(pool, i, o, s, d) ...]`` for a batch, fields set through the slot descriptors
    (the frozen ``__init__`` costs several times more; it runs nothing else, so equal values)."""
    out = [_new(Slice) for _ in ids]
    for setter, column in zip(_setters, (repeat(pool), ids, offsets, shapes, dtypes)):
        for _ in map(setter, out, column):
            pass
    return out
