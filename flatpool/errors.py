"""The one exception hierarchy of flatpool.

Every failing public call raises a :class:`FlatPoolError` and leaves what it touched as it
was; bad-argument errors also derive from ``ValueError``/``TypeError`` so existing handlers work.
"""

from __future__ import annotations

from collections.abc import Sequence


class FlatPoolError(Exception):
    """Base class of every error flatpool raises on purpose."""


class InvalidRequestError(FlatPoolError, ValueError):
    """An argument has the right type but a value flatpool cannot accept."""


class InvalidTypeError(FlatPoolError, TypeError):
    """An argument has the wrong type (a string where a ``torch.dtype`` is needed, ...)."""


class DeviceError(FlatPoolError, RuntimeError):
    """A device is unknown, unavailable, or its backend failed to load."""


class NpuFormatError(FlatPoolError, ValueError):
    """An NPU tensor or storage is in a private torch_npu format (named by ``npu_format``)
    whose bytes are not its elements in torch's order; convert to ND first."""

    def __init__(self, message: str, *, npu_format: str) -> None:
        super().__init__(message)
        self.npu_format = npu_format


class PoolExhaustedError(FlatPoolError, MemoryError):
    """A request does not fit into the pool's free space."""

    def __init__(self, message: str, *, requested: int, free: int, largest_free: int) -> None:
        super().__init__(message)
        self.requested = requested
        self.free = free
        self.largest_free = largest_free


class SliceError(FlatPoolError, ValueError):
    """A slice handle is used where it is not valid: freed, or of another pool."""


class FreedSliceError(SliceError):
    """The slice was freed (or relocated away); its handle may no longer be used."""


class ForeignSliceError(SliceError):
    """The slice belongs to another pool."""


class AliasingError(FlatPoolError, ValueError):
    """Tensors share memory where they must not. ``offenders`` lists every pair found."""

    def __init__(self, message: str, offenders: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.offenders: tuple[tuple[str, str], ...] = tuple(offenders)


class AdoptionError(FlatPoolError, RuntimeError):
    """An adoption could not be carried out; everything was rolled back."""


class PinnedStorageError(AdoptionError):
    """An original storage is still referenced by something the caller did not name;
    ``holders`` maps each pinned original to what a gc scan found. Rolled back."""

    def __init__(self, message: str, holders: dict[str, tuple[str, ...]]) -> None:
        super().__init__(message)
        self.holders = holders


class PoolInvariantError(FlatPoolError, RuntimeError):
    """An operation would leave a pool inconsistent (a bug, or a tensor that lied); rolled back."""


class FlatPoolWarning(UserWarning):
    """Base class of every warning flatpool issues; filter it to silence flatpool only."""


class OriginalKeptAliveWarning(FlatPoolWarning):
    """An adoption went ahead but a reference the caller holds kept an original alive."""


class ExternalMemoryWarning(FlatPoolWarning):
    """An adopted original's memory belongs to another owner (numpy, DLPack): not freed."""


class UntestedTorchWarning(FlatPoolWarning):
    """The installed torch is newer than the newest release flatpool was tested on."""


class FlatStepWarning(FlatPoolWarning):
    """A flat optimizer step stepped some parameters per parameter, or ran other math than asked."""


class UnfusedGroupWarning(FlatPoolWarning):
    """A fusion hook could not fuse a group; the step went on with it unfused."""


class OrphanedSliceWarning(FlatPoolWarning):
    """Every parameter adopted into a slice is gone (replaced): nothing trains on those bytes."""


class FlatPoolDeprecationWarning(FlatPoolWarning, DeprecationWarning):
    """A flatpool name or argument that goes in a later release."""
