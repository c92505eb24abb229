"""flatpool: typed, verified contiguous storage pools for PyTorch.

A :class:`FlatPool` owns one storage and hands out typed :class:`Slice` views; *adopted* tensors
move into it in place (identity survives) and their original storage is proven dead.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from typing import Any

# First: _torch_compat refuses an unsupported torch before any module reads a private API.
from ._torch_compat import UnsupportedTorchError, check_supported

from ._aliasing import (  # noqa: E402
    ByteRange, byte_range, check_no_aliasing, local_tensor, overlaps, own_storage, same_storage,
    storage_of,
)
from . import checkpoint  # noqa: E402
from . import _fork  # noqa: E402,F401  (os.register_at_fork: locks, gc pause, signals)
from ._warn import warn  # noqa: E402
from .checkpoint import compact_copy  # noqa: E402
from ._devices import DeviceLike, allocator_counters, resolve_device  # noqa: E402
from .errors import (  # noqa: E402
    AdoptionError, AliasingError, DeviceError, ExternalMemoryWarning, FlatPoolDeprecationWarning,
    FlatPoolError, FlatPoolWarning, FlatStepWarning, ForeignSliceError, FreedSliceError,
    InvalidRequestError, InvalidTypeError, NpuFormatError, OrphanedSliceWarning,
    OriginalKeptAliveWarning, PinnedStorageError, PoolExhaustedError, PoolInvariantError,
    SliceError, UnfusedGroupWarning, UntestedTorchWarning,
)
from ._holder import Holder  # noqa: E402
from ._census import Census, StorageRecord, census  # noqa: E402
from ._interrupts import RollbackError  # noqa: E402
from .ownership._spec import AdoptedItem, AdoptionReport, AdoptSpec, OnPinned  # noqa: E402
from .pool import DEFAULT_ALIGNMENT, FlatPool, ShapeLike, live_pools  # noqa: E402
from .slices import Slice  # noqa: E402
from ._unreleased import UnreleasedOriginal  # noqa: E402

__all__ = [
    "checkpoint", "compact_copy", "Census", "StorageRecord", "census", "AdoptSpec", "AdoptedItem",
    "AdoptionReport", "Holder", "OnPinned", "DEFAULT_ALIGNMENT", "AdoptionError", "AliasingError",
    "ByteRange", "DeviceError", "ExternalMemoryWarning", "FlatPoolDeprecationWarning",
    "FlatPoolWarning", "FlatStepWarning", "OrphanedSliceWarning", "UnfusedGroupWarning",
    "OriginalKeptAliveWarning", "UntestedTorchWarning", "DeviceLike", "FlatPool", "FlatPoolError",
    "ForeignSliceError", "FreedSliceError", "InvalidRequestError", "InvalidTypeError",
    "NpuFormatError", "PinnedStorageError", "PoolExhaustedError", "PoolInvariantError",
    "RollbackError", "ShapeLike", "Slice", "SliceError", "UnreleasedOriginal",
    "UnsupportedTorchError", "allocator_counters", "byte_range", "check_no_aliasing", "live_pools",
    "local_tensor", "overlaps", "own_storage", "resolve_device", "same_storage", "storage_of",
]

try:
    __version__ = _dist_version("flatpool")  # pyproject.toml's: one source
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

_MOVED = {"FailAt": "flatpool.testing", "set_fault_hook": "flatpool.testing"}


def __getattr__(name: str) -> Any:
    """Names that moved, kept for one release with a DeprecationWarning."""
    if name in _MOVED:
        warn(
            f"flatpool.{name} moved to {_MOVED[name]}.{name}; the old name goes in the next "
            "release", FlatPoolDeprecationWarning)
        from . import testing

        return getattr(testing, name)
    raise AttributeError(f"module 'flatpool' has no attribute {name!r}")


checkpoint.install()  # torch.save / deepcopy of pooled tensors write their own bytes only
