"""flatpool: typed, verified contiguous storage pools for PyTorch.

A :class:`FlatPool` owns one contiguous storage on a device and hands out typed
:class:`Slice` views. Tensors can be *adopted* into slices: their data moves into the pool,
every object that viewed the original is rebound in place (identity survives), and the
original storage is released with proof that it died.
"""

from .aliasing import (
    ByteRange,
    byte_range,
    check_no_aliasing,
    local_tensor,
    overlaps,
    own_storage,
    same_storage,
    storage_of,
)
from . import checkpoint
from .checkpoint import compact_copy
from .devices import DeviceLike, allocator_counters, resolve_device
from .errors import (
    AdoptionError,
    AliasingError,
    DeviceError,
    FlatPoolError,
    ForeignSliceError,
    FreedSliceError,
    InvalidRequestError,
    InvalidTypeError,
    PinnedStorageError,
    PoolExhaustedError,
    SliceError,
)
from .ownership.census import Census, StorageRecord, census
from .ownership.faults import FailAt, set_fault_hook
from .ownership.spec import AdoptedItem, AdoptionReport, AdoptSpec, Holder, OnPinned
from .pool import DEFAULT_ALIGNMENT, FlatPool, ShapeLike, live_pools
from .slices import Slice

__all__ = [
    "checkpoint",
    "compact_copy",
    "Census",
    "StorageRecord",
    "census",
    "AdoptSpec",
    "AdoptedItem",
    "AdoptionReport",
    "Holder",
    "OnPinned",
    "set_fault_hook",
    "FailAt",
    "DEFAULT_ALIGNMENT",
    "AdoptionError",
    "AliasingError",
    "ByteRange",
    "DeviceError",
    "DeviceLike",
    "FlatPool",
    "FlatPoolError",
    "ForeignSliceError",
    "FreedSliceError",
    "InvalidRequestError",
    "InvalidTypeError",
    "PinnedStorageError",
    "PoolExhaustedError",
    "ShapeLike",
    "Slice",
    "SliceError",
    "allocator_counters",
    "byte_range",
    "check_no_aliasing",
    "live_pools",
    "local_tensor",
    "overlaps",
    "own_storage",
    "resolve_device",
    "same_storage",
    "storage_of",
]

__version__ = "0.1.0"

checkpoint.install()  # torch.save / deepcopy of pooled tensors write their own bytes only
