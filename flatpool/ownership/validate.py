"""Check what a caller asked to adopt, before anything moves.

Everything is read from the TensorImpl (a subclass's Python ``shape`` may be a global shape,
its ``__torch_function__`` may raise) and every refusal is a typed error naming the tensor and
what to pass instead. Messages are built only when raised: this runs once per tensor.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from typing import Union

import torch

from .. import torch_compat as tc
from ..aliasing import ByteRange, check_no_wrapper, check_strided, extent_of, local_tensor, own_storage
from ..errors import InvalidRequestError, InvalidTypeError
from ..requests import check_dtype
from ..state import PoolState, pool_of_storage
from .spec import AdoptSpec

Adoptable = Union[torch.Tensor, AdoptSpec]
AdoptTargets = Union[Adoptable, Sequence[Adoptable]]


def normalize(targets: AdoptTargets) -> list[AdoptSpec]:
    """``targets`` as a list of specs (a tensor, a spec, or a list/tuple of them)."""
    if isinstance(targets, (torch.Tensor, AdoptSpec)):
        items: Sequence[Adoptable] = [targets]
    elif isinstance(targets, (list, tuple)):
        items = targets
    else:
        raise InvalidTypeError(
            "adopt() takes a tensor, an AdoptSpec, or a list/tuple of them, got "
            f"{type(targets).__name__}"
        )
    specs: list[AdoptSpec] = []
    for i, t in enumerate(items):
        if isinstance(t, AdoptSpec):
            if not isinstance(t.tensor, torch.Tensor):
                raise InvalidTypeError(
                    f"target #{i}: AdoptSpec.tensor must be a tensor, got {type(t.tensor).__name__}"
                )
            specs.append(t)
        elif isinstance(t, torch.Tensor):
            specs.append(AdoptSpec(t))
        else:
            raise InvalidTypeError(
                f"target #{i} is a {type(t).__name__}; adopt() takes tensors or AdoptSpecs"
            )
    if not specs:
        raise InvalidRequestError("adopt() was given nothing to adopt")
    return specs


def label(t: torch.Tensor, i: int) -> str:
    """How errors name target ``i``: its type, local (TensorImpl) shape and dtype."""
    try:
        inner = local_tensor(t)
        with tc.no_torch_function():
            size, dtype = tuple(tc.impl_size(inner)), tc.impl_dtype(inner)
        return f"#{i} {type(t).__name__}{size} {str(dtype).replace('torch.', '')}"
    except Exception:  # a tensor too broken to describe still gets a name
        return f"#{i} {type(t).__name__}"


EXACT_OVERLAP_ELEMENTS = 1 << 22
"""Up to this many elements, strides that interleave (sizes (2, 3), strides (3, 2)) are checked
element by element; beyond it such a tensor is refused as unproven."""


def overlap(t: torch.Tensor) -> str | None:
    """Why two index tuples of ``t`` may reach the same element: ``"expanded"`` (a stride 0 over
    a size above 1), ``"shared"`` (interleaved strides, and elements found shared),
    ``"unproven"`` (interleaved strides over too many elements to check), else ``None``.
    Call under no_torch_function."""
    dims = sorted((st, sz) for sz, st in zip(tc.impl_size(t), tc.impl_stride(t)) if sz > 1)
    if any(st == 0 for st, _ in dims):
        return "expanded"
    span = 1
    for st, sz in dims:
        if st < span:
            break  # interleaved strides: nested spans no longer decide it
        span = st * sz
    else:
        return None
    n = math.prod(sz for _, sz in dims)
    if n > EXACT_OVERLAP_ELEMENTS:
        return "unproven"
    offsets = torch.zeros((), dtype=torch.int64)
    for st, sz in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(sz, dtype=torch.int64) * st).flatten()
    return "shared" if int(torch.unique(offsets).numel()) < n else None


def self_overlapping(t: torch.Tensor) -> bool:
    """:func:`overlap` says anything. Call under no_torch_function."""
    return overlap(t) is not None


class Primary:
    """A validated primary: the tensor holding the data, its storage and its byte extent."""

    __slots__ = ("spec", "index", "inner", "storage", "extent", "shape", "dtype", "contiguous",
                 "external")
    spec: AdoptSpec
    index: int
    extent: ByteRange
    dtype: torch.dtype
    contiguous: bool
    external: bool

    def __init__(self, spec: AdoptSpec, index: int) -> None:
        self.spec, self.index = spec, index
        self.inner: torch.Tensor = spec.tensor
        self.storage: torch.UntypedStorage | None = None
        self.extent = ByteRange(0, 0)
        self.shape: tuple[int, ...] = ()
        self.dtype = torch.uint8
        self.contiguous = True
        self.external = False

    @property
    def label(self) -> str:
        return label(self.spec.tensor, self.index)


def data_storage(t: torch.Tensor, extent: ByteRange, what: str) -> torch.UntypedStorage:
    """The storage that holds ``t``'s bytes, refusing what would crash or adopt garbage.

    A placeholder (C++ functional tensor, FakeTensor) is refused by type; a real storage smaller
    than ``t``'s extent (``untyped_storage().resize_(0)``, as FSDP frees unsharded parameters)
    by value, before anything is allocated or moved. ``t`` is already known to be strided,
    not a wrapper subclass and not meta.
    """
    with tc.no_torch_function():
        storage = tc.impl_untyped_storage(t)
    if tc.is_functional(t):
        raise InvalidTypeError(
            f"{what} is a functional tensor (made by torch.func.functionalize or compile "
            "tracing): its storage is a placeholder and its data lives in the tensor it wraps; "
            "adopt the real tensor, outside the functionalized region"
        )
    if storage.device.type == "meta":
        raise InvalidTypeError(
            f"{what} has only metadata (a {type(t).__name__} made under FakeTensorMode, or "
            "another tensor on a meta storage): there is no data to adopt; adopt real tensors "
            "outside the fake mode"
        )
    if not tc.storage_pointer_valid(storage):
        raise InvalidTypeError(
            f"{what} ({type(t).__name__}) has no real storage (a placeholder that crashes when "
            "read): adopt the tensor that holds its data"
        )
    if storage.nbytes() < extent.end:
        raise InvalidRequestError(
            f"{what} reaches byte {extent.end} of a storage that holds only "
            f"{storage.nbytes()} bytes (freed with untyped_storage().resize_(), as FSDP does "
            "for unsharded parameters): there is no data to adopt; resize the storage back "
            "(or let the framework re-materialize it) first, or adopt the tensor that has the data"
        )
    return storage


def validate(pool: PoolState, spec: AdoptSpec, index: int) -> Primary:
    """Check one primary; everything the adoption needs to know about it."""
    p = Primary(spec, index)
    inner = p.inner = local_tensor(spec.tensor)
    check_strided(inner, p.label)
    check_no_wrapper(inner, p.label)
    with tc.no_torch_function():
        if tc.impl_is_quantized(inner):
            check_dtype(tc.impl_dtype(inner), p.label)  # raises the same error as allocate()
        if tc.impl_is_meta(inner):
            raise InvalidRequestError(
                f"{p.label} is a meta tensor (or a fake one) and has no data to adopt; use "
                "pool.materialize_into() to give it pool storage"
            )
        device = tc.impl_device(inner)
        if device != pool.device:
            raise InvalidRequestError(
                f"{p.label} is on {device} but pool {pool.name!r} is on {pool.device}; "
                "move it to the pool's device first or use a pool on its device"
            )
        numel = tc.impl_numel(inner)
        if numel == 0:
            raise InvalidRequestError(f"{p.label} is empty: zero-size tensors stay outside the pool")
        if tc.impl_is_inference(inner):
            raise InvalidRequestError(
                f"{p.label} is an inference tensor (made under torch.inference_mode()); it "
                "cannot be rebound in place: adopt a clone() made outside inference mode"
            )
        p.dtype = check_dtype(tc.impl_dtype(inner), p.label)
        p.contiguous = tc.impl_is_contiguous(inner)
        why = None if p.contiguous else overlap(inner)
        if why == "expanded":
            raise InvalidRequestError(
                f"{p.label} overlaps itself (an expanded/broadcast view, strides "
                f"{tuple(tc.impl_stride(inner))}); adopt the tensor it was expanded from"
            )
        if why == "shared":
            raise InvalidRequestError(
                f"{p.label} overlaps itself (strides {tuple(tc.impl_stride(inner))} over sizes "
                f"{tuple(tc.impl_size(inner))} reach some elements twice: an as_strided view); "
                "adopt the tensor it views, or a contiguous() copy"
            )
        if why == "unproven":
            raise InvalidRequestError(
                f"{p.label} has interleaved strides {tuple(tc.impl_stride(inner))} over sizes "
                f"{tuple(tc.impl_size(inner))}: more than {EXACT_OVERLAP_ELEMENTS} elements to "
                "check that no two share memory; adopt a contiguous() copy"
            )
        p.extent = extent_of(inner)
        p.shape = (tuple(tc.impl_size(inner)) if p.contiguous
                   else (p.extent.nbytes // p.dtype.itemsize,))
    storage = data_storage(inner, p.extent, p.label)
    key = tc.storage_key(storage)
    if inner is not spec.tensor:
        wrapper = own_storage(spec.tensor)
        if wrapper is not None and tc.storage_key(wrapper) != key:
            raise InvalidRequestError(
                f"{p.label} has a storage of its own that is not its _local_tensor's: the "
                "wrapper does not view its shard, and adopting the local tensor would leave the "
                "wrapper reading other memory; rebuild the wrapper around its local tensor"
            )
    owner = pool_of_storage(key)
    if owner is not None and p.extent.end <= owner.capacity:
        where = "this pool" if owner is pool else f"pool {owner.name!r}"
        raise InvalidRequestError(
            f"{p.label} already lives in {where}; use readopt() to bring moved members back"
        )
    # Memory another owner may keep: numpy's (from_numpy), a buffer's (frombuffer), or shared
    # memory other processes map (share_memory_; CUDA storages always say shared: skipped).
    # torch marks such storages non-resizable; it also marks a storage t.numpy() once viewed,
    # whose memory is its own, but it does not say which allocator made a storage: every
    # non-resizable storage counts as external (the safe answer: nothing is reported freed).
    p.external = not storage.resizable() or (device.type == "cpu" and storage.is_shared())
    p.storage = storage
    return p


__all__ = ["AdoptTargets", "Adoptable", "Primary", "data_storage", "label", "normalize",
           "self_overlapping", "validate"]
