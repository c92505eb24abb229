"""Every private torch API flatpool uses, each behind a named function that says why.

torch moves these between releases. Keeping them in one module makes the supported range this
file's business (feature-detected where a release changed a signature) and keeps the rest of
flatpool on typed, public calls. Nothing else in flatpool or its integrations touches
``torch._C``, ``_cdata``, ``_unsafe_*`` or reference counts.

Geometry readers take the *TensorImpl's* answer: a subclass may override ``shape``/``size()``
in Python (HyperParallel's DTensor answers with the global shape) or route methods through
``__torch_function__`` (and raise). Callers read under :func:`no_torch_function`, and the
readers are ``torch._C.TensorBase``'s own unbound methods, which skip Python overrides.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
import os
import sys
import traceback
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from itertools import chain, compress, repeat
from operator import attrgetter, is_, itemgetter
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
from attrs import define
from torch.torch_version import TorchVersion

from ._warn import warn
from .errors import FlatPoolError, UntestedTorchWarning

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, ReduceOp, Work

SUPPORTED_TORCH = (2, 7)
"""Oldest torch release the whole test suite passes on (see docs/compatibility.md): older ones
are refused at import."""
NEWEST_TESTED = (2, 15)
"""Newest torch release the whole test suite passed on. A newer one imports with one
:class:`~flatpool.errors.UntestedTorchWarning`, if every private API flatpool needs is there."""
SILENCE_ENV = "FLATPOOL_IGNORE_UNTESTED_TORCH"
"""Set to ``1`` to silence the warning about a torch newer than :data:`NEWEST_TESTED`."""

# Every private torch API flatpool reads, probed by name before any module reads one: a release
# that dropped one fails with an error naming it, not with an AttributeError deep inside adopt.
_NEEDED_APIS = (
    "torch._C.TensorBase._base", "torch._C.TensorBase._version",
    "torch._C._DisableTorchDispatch", "torch._C.DisableTorchFunctionSubclass",
    "torch._C._storage_address", "torch._C._storage_Use_Count",
    "torch._C._current_graph_task_id", "torch._C._autograd._unsafe_set_version_counter",
    "torch._C._get_tensor_metadata", "torch._C._set_tensor_metadata",
    "torch._C._swap_tensor_impl", "torch.Tensor._use_count", "torch.Tensor._make_subclass",
    "torch.UntypedStorage._weak_ref", "torch.UntypedStorage._expired",
    "torch.UntypedStorage._new_with_weak_ptr", "torch.UntypedStorage._free_weak_ref",
    "torch._is_functional_tensor", "torch._foreach_copy_",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
)


class UnsupportedTorchError(FlatPoolError, ImportError):
    """The installed torch is older than flatpool supports, or lacks a private API it needs."""


def _dotted(name: str) -> object:
    """The object ``name`` denotes (``a.b.c``), importing modules on the way; AttributeError or
    ImportError when it is not there."""
    parts = name.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part) and inspect.ismodule(obj):
            importlib.import_module(".".join(parts[: i + 1]))  # a submodule not yet imported
        obj = getattr(obj, part)
    return obj


def missing_apis(names: Sequence[str] = _NEEDED_APIS) -> list[str]:
    """The names in ``names`` this torch does not have."""
    missing = []
    for name in names:
        try:
            _dotted(name)
        except (AttributeError, ImportError):
            missing.append(name)
    return missing


def check_supported() -> None:
    """At import: refuse a torch below the floor or one that lacks a private API flatpool needs
    (one clear error each), and warn once for a torch newer than the newest tested release."""
    version = TorchVersion(torch.__version__)
    lo = ".".join(map(str, SUPPORTED_TORCH))
    tested = ".".join(map(str, NEWEST_TESTED))
    if version < lo:  # TorchVersion compares as versions: '2.10' > '2.7', '2.7.0rc1' < '2.7'
        raise UnsupportedTorchError(
            f"flatpool supports torch >= {lo}; this is torch {torch.__version__}. "
            f"Install a supported release (pip install 'torch>={lo}')."
        )
    missing = missing_apis()
    if missing:
        raise UnsupportedTorchError(
            f"torch {torch.__version__} lacks {', '.join(missing)}, which flatpool needs (tested "
            f"on torch {lo} to {tested}). Install a tested release (pip install "
            f"'torch>={lo},<{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}') or a newer flatpool."
        )
    # X.Y.dev0 sorts before every X.Y release and pre-release: a 2.16 nightly is untested too
    first_untested = f"{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}.dev0"
    if version >= first_untested and os.environ.get(SILENCE_ENV) != "1":
        warn(
            f"flatpool was tested on torch {lo} to {tested}; this is torch {torch.__version__}. "
            f"Every private API it needs is present, so it goes ahead; please report a failure. "
            f"Set {SILENCE_ENV}=1 to silence this warning.",
            UntestedTorchWarning,
        )


check_supported()  # before the probes below: an old torch lacks some of what they read

from torch.utils._python_dispatch import (  # noqa: E402
    is_traceable_wrapper_subclass as _is_traceable,
)


# -- collectives ---------------------------------------------------------------------------
# Recent torch renamed the single-tensor collectives (``all_gather_into_tensor`` ->
# ``all_gather_single``, ``reduce_scatter_tensor`` -> ``reduce_scatter_single``); in 2.13 and 2.14
# the old names print a FutureWarning on every call (2.15 keeps them as quiet aliases).
# Feature-detected: a release without the new names gets the old ones.
def _collective(new: str, old: str) -> Callable[..., Work | None]:
    import torch.distributed as dist

    return cast(Callable[..., "Work | None"], getattr(dist, new, None) or getattr(dist, old))


def all_gather_single(output: torch.Tensor, input: torch.Tensor, *,
                      group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Every rank's ``input`` concatenated into ``output`` (torch's recommended call on each
    release: no FutureWarning)."""
    return _collective("all_gather_single", "all_gather_into_tensor")(
        output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp.RedOpType,
                          group: ProcessGroup | None = None,
                          async_op: bool = False) -> Work | None:
    """``input`` reduced with ``op`` over the ranks, this rank's part into ``output``."""
    return _collective("reduce_scatter_single", "reduce_scatter_tensor")(
        output, input, op=op, group=group, async_op=async_op)


# -- reading a tensor's TensorImpl ----------------------------------------------------------
_Base = torch._C.TensorBase


def outside_inference() -> AbstractContextManager[Any]:
    """Leave ``torch.inference_mode()`` for the block, if the caller is in it: flatpool's own
    tensors (the pool's storage, rebound tensors) must never become inference tensors.

    (``inference_mode(False)`` also switches grad mode on, so only use it when needed.)"""
    if torch.is_inference_mode_enabled():
        return cast(AbstractContextManager[Any], torch.inference_mode(False))
    return nullcontext()


def no_torch_dispatch() -> AbstractContextManager[Any]:
    """Stop ``__torch_dispatch__`` for the block: aten ops run natively on a subclass's own
    TensorImpl (what a storage-sharing wrapper's pass-through dispatch does)."""
    return cast(AbstractContextManager[Any], torch._C._DisableTorchDispatch())


def no_torch_function() -> AbstractContextManager[Any]:
    """Stop subclasses' ``__torch_function__`` for the block (it may raise or lie)."""
    return cast(AbstractContextManager[Any], torch._C.DisableTorchFunctionSubclass())


impl_size: Callable[[torch.Tensor], torch.Size] = _Base.size
impl_stride: Callable[[torch.Tensor], tuple[int, ...]] = _Base.stride
impl_storage_offset: Callable[[torch.Tensor], int] = cast(Callable[[torch.Tensor], int],
                                                      _Base.storage_offset)
impl_data_ptr: Callable[[torch.Tensor], int] = _Base.data_ptr
impl_numel: Callable[[torch.Tensor], int] = _Base.numel
impl_element_size: Callable[[torch.Tensor], int] = _Base.element_size
impl_is_contiguous: Callable[[torch.Tensor], bool] = _Base.is_contiguous
impl_untyped_storage: Callable[[torch.Tensor], torch.UntypedStorage] = _Base.untyped_storage
impl_is_inference: Callable[[torch.Tensor], bool] = _Base.is_inference
impl_is_conj: Callable[[torch.Tensor], bool] = _Base.is_conj
impl_detach: Callable[[torch.Tensor], torch.Tensor] = _Base.detach
impl_is_neg: Callable[[torch.Tensor], bool] = _Base.is_neg
storage_data_ptr: Callable[[torch.UntypedStorage], int] = torch._C.StorageBase.data_ptr  # type: ignore[attr-defined]
storage_nbytes: Callable[[torch.UntypedStorage], int] = torch._C.StorageBase.nbytes  # type: ignore[attr-defined]
storage_resizable: Callable[[torch.UntypedStorage], bool] = torch._C.StorageBase.resizable  # type: ignore[attr-defined]
storage_is_shared: Callable[[torch.UntypedStorage], bool] = torch._C.StorageBase.is_shared  # type: ignore[attr-defined]
storage_key_of: Callable[[torch.UntypedStorage], int] = operator.attrgetter("_cdata")
"""The C-level reads of a batch's facts (``map`` over a chunk, no bytecode per tensor): the
unbound methods of ``torch._C.TensorBase``/``StorageBase`` themselves, so no subclass override
or ``__torch_function__`` runs; ``storage_key_of`` is :func:`storage_key` as a C callable."""
impl_set_: Callable[..., torch.Tensor] = _Base.set_
impl_key: Callable[[torch.Tensor], int] = cast(Callable[[torch.Tensor], int],
                                              operator.attrgetter("_cdata"))
""":func:`impl_address` as a C callable, for ``map`` over many tensors (no bytecode per tensor)."""
impl_dtype_of: Callable[[torch.Tensor], torch.dtype] = _Base.__dict__["dtype"].__get__
""":func:`impl_dtype` as a C callable (the descriptor's own ``__get__``), for ``map``."""

_getters: dict[str, Any] = {
    name: _Base.__dict__[name].__get__
    for name in ("dtype", "device", "is_meta", "layout", "is_quantized", "requires_grad",
                 "is_leaf", "_base", "_version", "is_sparse", "is_nested", "is_mkldnn")
    if name in _Base.__dict__
}


def _getter(name: str) -> Callable[[torch.Tensor], Any]:
    """The descriptor's own ``__get__`` (C): called with the tensor alone (a getset
    descriptor ignores the owner argument), so no Python frame per read."""
    get: Callable[[torch.Tensor], Any] = _getters[name]
    return get


impl_dtype: Callable[[torch.Tensor], torch.dtype] = _getter("dtype")
impl_device: Callable[[torch.Tensor], torch.device] = _getter("device")
impl_is_meta: Callable[[torch.Tensor], bool] = _getter("is_meta")
impl_layout: Callable[[torch.Tensor], torch.layout] = _getter("layout")
impl_is_quantized: Callable[[torch.Tensor], bool] = _getter("is_quantized")
impl_requires_grad: Callable[[torch.Tensor], bool] = _getter("requires_grad")
impl_is_leaf: Callable[[torch.Tensor], bool] = _getter("is_leaf")
impl_base: Callable[[torch.Tensor], torch.Tensor | None] = _getter("_base")
impl_version: Callable[[torch.Tensor], int] = _getter("_version")
impl_is_nested: Callable[[torch.Tensor], bool] = _getter("is_nested")


def is_wrapper_subclass(t: torch.Tensor) -> bool:
    """A traceable wrapper subclass (torch DTensor, TwoTensor): its own storage is a placeholder."""
    wrapper: bool = _is_traceable(t)  # a TypeGuard mypy over-narrows on
    return wrapper


_use_count = cast(Callable[[torch.Tensor], int], getattr(torch.Tensor, "_use_count"))


impl_use_count: Callable[[torch.Tensor], int] = _use_count
""":func:`tensor_impl_users` as a C callable, for ``map`` over a batch."""


def tensor_impl_users(t: torch.Tensor) -> int:
    """Owners of ``t``'s TensorImpl: its Python object, plus every C++ holder (an autograd view's
    base link, a saved tensor, a DLPack capsule). DLPack consumers hold raw pointers into the
    storage, so an unexplained owner must stop a move that would free it."""
    return _use_count(t)


# -- storages ------------------------------------------------------------------------------
def storage_key(storage: torch.UntypedStorage) -> int:
    """An identity for a live storage: its StorageImpl address (unique while it lives)."""
    return int(storage._cdata)


storage_address: Callable[[torch.Tensor], int] = getattr(torch._C, "_storage_address")
"""The key of ``t``'s storage without making a Python storage object (cheap, no gc): bound
once, since per-step validity checks call it several times a member (0.2 us, not 0.8)."""


def storage_users(storage: torch.UntypedStorage) -> int:
    """Owners of a StorageImpl: every TensorImpl on it and every Python storage object."""
    return int(torch._C._storage_Use_Count(storage._cdata))


def storage_has_data(storage: torch.UntypedStorage) -> bool:
    """False for placeholder storages: reading them crashes or reads nothing.

    A C++ functional tensor's or a wrapper subclass's storage raises on ``data_ptr()``; a
    ``FakeTensor``'s is a meta storage (checked first: its ``data_ptr()`` warns). A real storage
    with bytes has a non-null pointer; one resized to 0 bytes has none and no bytes (callers
    compare ``nbytes()`` with the extent they need)."""
    if storage.device.type == "meta":
        return False
    return storage_pointer_valid(storage)


UNREADABLE_STORAGE = (RuntimeError, NotImplementedError, TypeError)
"""What reading a placeholder storage's pointer raises (a C++ functional tensor's, a wrapper
subclass's)."""


def storage_pointer_valid(storage: torch.UntypedStorage) -> bool:
    """:func:`storage_has_data` without the meta check (the device read costs half a
    microsecond): for tensors already known not to be meta or fake."""
    try:
        ptr = storage.data_ptr()
    except UNREADABLE_STORAGE:
        return False
    return ptr != 0 or storage.nbytes() == 0


def is_functional(t: torch.Tensor) -> bool:
    """A C++ functional tensor (``torch.func.functionalize``, compile tracing): its storage is a
    placeholder; the data lives in the tensor it wraps."""
    check = cast(Callable[[torch.Tensor], bool], getattr(torch, "_is_functional_tensor"))
    return bool(check(t))


def _refcount_in_a_call(obj: object) -> int:
    return sys.getrefcount(obj)


_CALL_REFS = _refcount_in_a_call(object())
"""What a count taken inside a called function adds to the caller's own references: the
parameter and ``getrefcount``'s argument (2), and on Python 3.10 also the caller's stack slot,
which 3.11+ moves into the callee (3). Measured with a function of :func:`python_refs`' shape."""


_TRACERS_FILL_LOCALS = sys.version_info < (3, 11)
"""Python 3.10 copies a function frame's locals into its ``f_locals`` dict before each call of
a ``sys.settrace`` function (pdb, the interrupt tests' line tracer); the dict then holds a
reference to every local until the next event refreshes it."""


def python_refs(obj: object) -> int:
    """``obj``'s Python references as the caller sees them (this call's own not counted, nor
    the copies a Python 3.10 trace function leaves in frames' ``f_locals``).

    torch may hold one more while C++ also owns the object's impl: see
    :data:`PRESERVED_STORAGE_REF` and :data:`PRESERVED_TENSOR_REF`."""
    if _TRACERS_FILL_LOCALS and sys.gettrace() is not None:
        return _refs_beside_locals_copies(obj)
    return sys.getrefcount(obj) - _CALL_REFS


def _refs_beside_locals_copies(obj: object) -> int:
    # Refresh the f_locals copy of every function frame on this stack (reading f_locals does),
    # so the count and the copies agree; then count, and take away the copies' references.
    # This frame's own copy holds obj once (traced lines refresh it, so it is not searched).
    # Only C-level iteration: as many traced lines whatever the stack depth.
    here = sys._getframe(0)
    here.f_locals  # noqa: B018 - the read refreshes the copy
    frames = list(map(itemgetter(0), traceback.walk_stack(here.f_back)))
    del here
    optimized = map(inspect.CO_OPTIMIZED.__and__, map(attrgetter("f_code.co_flags"), frames))
    copies = list(map(attrgetter("f_locals"), compress(frames, optimized)))
    del frames
    # Beyond the caller's: python_refs' stack slot and parameter, this parameter, the
    # argument of getrefcount (_CALL_REFS, Python 3.10), and this frame's copy.
    refs = sys.getrefcount(obj) - _CALL_REFS - 3
    return refs - sum(map(is_, chain.from_iterable(map(dict.values, copies)), repeat(obj)))


def _preserved_refs() -> tuple[int, int]:
    """Measure PyObject preservation for (storages, tensors): torch 2.10+ keeps a Python object
    alive with a strong reference while C++ also owns its impl (1); older releases resurrect it
    when the last Python reference goes instead (0)."""
    with outside_inference():  # an inference tensor has no autograd view link to its base
        t = torch.empty(0)
        s = t.untyped_storage()
        shared = python_refs(s)  # users: t's impl and s
        del t
        storage = shared - python_refs(s)
        t = torch.empty(0)
        alone = python_refs(t)
        v = t.view(0)  # the view's impl now also owns t's impl
        tensor = python_refs(t) - alone
        del v, t, s
    return storage, tensor


PRESERVED_STORAGE_REF, PRESERVED_TENSOR_REF = _preserved_refs()
"""References torch itself holds on a storage's / tensor's Python object while its impl has
other C++ owners (0 or 1, measured at import): pin counts subtract them."""


def in_backward() -> bool:
    """True while autograd runs a backward pass (in a backward hook, say)."""
    return int(torch._C._current_graph_task_id()) != -1


# Raw storage weak references: the pair costs under a microsecond, where a
# ``StorageWeakRef`` object costs several once thousands of them feed the cycle collector.
_weak_ref = cast(Callable[[torch.UntypedStorage], int], torch.UntypedStorage._weak_ref)
_expired = cast(Callable[[int], bool], torch.UntypedStorage._expired)
_from_weak = cast(Callable[[int], torch.UntypedStorage], torch.UntypedStorage._new_with_weak_ptr)
_free_weak = cast(Callable[[int], None], torch.UntypedStorage._free_weak_ref)


def weak_storage(storage: torch.UntypedStorage) -> int:
    return _weak_ref(storage)


def weak_expired(ref: int) -> bool:
    return bool(_expired(ref))


def weak_upgrade(ref: int) -> torch.UntypedStorage | None:
    """The storage again, if it still lives."""
    if _expired(ref):
        return None
    return _from_weak(ref)


def weak_free(ref: int) -> None:
    _free_weak(ref)


# Bulk forms, one C-level pass each (a batch adoption proves 100,000 originals dead at once).
def weak_storages(storages: Iterable[torch.UntypedStorage]) -> Iterator[int]:
    """:func:`weak_storage` of each storage, lazily (no list of them at a batch's peak)."""
    return map(_weak_ref, storages)


def weak_expired_each(refs: Iterable[int]) -> Iterator[bool]:
    """:func:`weak_expired` of each reference, lazily."""
    return map(_expired, refs)


def weak_free_each(refs: Iterable[int]) -> None:
    """:func:`weak_free` of each reference."""
    deque(map(_free_weak, refs), maxlen=0)


_storage_use_count = cast(Callable[[int], int], getattr(torch._C, "_storage_Use_Count"))
_ONE_HOLDER = next(map(sys.getrefcount, [object()]))
"""What ``getrefcount`` reads in a ``map`` pass over a container for an object that container
alone holds (the pass's own reference included), measured, not assumed."""


def storages_held_once(storages: Iterable[torch.UntypedStorage]) -> bool:
    """Every storage is used by nothing but its one Python object, which nothing but the
    iterated container holds: two C-level passes. ``False`` means only "look closer" (the
    per-storage count decides); ``True`` is what that count would say of each."""
    return storages_used_as(list(storages), 1, 1)


def storages_used_as(storages: list[torch.UntypedStorage], users: int, refs: int) -> bool:
    """Every storage of the list has exactly ``users`` owners of its StorageImpl and ``refs``
    Python references beside the list's own: two C-level passes (``False`` also wherever a
    3.10 tracer's ``f_locals`` copies would skew the counts: "look closer")."""
    if _TRACERS_FILL_LOCALS and sys.gettrace() is not None:
        return False  # a 3.10 tracer's f_locals copies: only the per-object count sees them
    return (all(map(operator.eq, map(_storage_use_count, map(storage_key_of, storages)),
                    repeat(users)))
            and all(map(operator.eq, map(sys.getrefcount, storages), repeat(_ONE_HOLDER + refs))))


def tensors_referenced(tensors: list[torch.Tensor], refs: int) -> bool:
    """Every tensor object of the list has exactly ``refs`` Python references beside the list's
    own (one C-level pass; ``False`` under a 3.10 tracer, as :func:`storages_used_as`)."""
    if _TRACERS_FILL_LOCALS and sys.gettrace() is not None:
        return False
    return all(map(operator.eq, map(sys.getrefcount, tensors), repeat(_ONE_HOLDER + refs)))


def new_storage(nbytes: int, device: torch.device) -> torch.UntypedStorage:
    return cast(Callable[..., torch.UntypedStorage], torch.UntypedStorage)(nbytes, device=device)


# -- version counters ----------------------------------------------------------------------
_set_version_counter = cast(Callable[..., None], torch._C._autograd._unsafe_set_version_counter)


def _probe_tuple_form() -> bool:
    probe = torch.empty(0)
    try:
        _set_version_counter((probe,), (0,))
    except TypeError:
        return False
    return True


_TUPLE_FORM = _probe_tuple_form()  # torch 2.4-2.6 take one (Tensor, int) per call


def set_versions(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Put version counters back after ``set_``/``copy_`` bumped them: the values did not change,
    and a pending backward that saved the tensor must not fail as "modified in place"."""
    if not tensors:
        return
    if _TUPLE_FORM:
        _set_version_counter(tuple(tensors), tuple(versions))
        return
    for t, v in zip(tensors, versions):
        _set_version_counter(t, v)


# -- bulk ops ------------------------------------------------------------------------------
def foreach_copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all ``i`` in one call (a Python loop costs microseconds each).

    A dtype torch has no copy kernel for (torch 2.8: ``float4_e2m1fn_x2``) is copied as
    same-size integers: flatpool moves bytes, not values."""
    try:
        torch._foreach_copy_(list(dst), list(src))
    except NotImplementedError:
        if not any(_no_copy_kernel(d.dtype, d.device.type) for d in dst):
            raise
        torch._foreach_copy_([_copyable(d) for d in dst], [_copyable(t) for t in src])


def clone(t: torch.Tensor) -> torch.Tensor:
    """``t.clone()``, also for a dtype torch has no copy kernel for (see :func:`foreach_copy`)."""
    try:
        return t.clone()
    except NotImplementedError:
        if not _no_copy_kernel(t.dtype, t.device.type):
            raise
        return _copyable(t).clone().view(t.dtype)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copyable(t: torch.Tensor) -> torch.Tensor:
    if _no_copy_kernel(t.dtype, t.device.type):
        return t.view(_SAME_SIZE_INT[t.element_size()])
    return t


@functools.cache
def _no_copy_kernel(dtype: torch.dtype, device_type: str) -> bool:
    try:
        a = torch.empty(1, dtype=dtype, device=device_type)
        b = torch.empty(1, dtype=dtype, device=device_type)
    except (RuntimeError, NotImplementedError, TypeError):
        return False  # the caller re-raises what it caught
    try:
        a.copy_(b)  # two tensors: a copy onto itself is skipped before any kernel runs
    except NotImplementedError:
        return dtype.itemsize in _SAME_SIZE_INT
    return False


_get_tensor_metadata = cast(Callable[[torch.Tensor], dict[str, bool]],
                            getattr(torch._C, "_get_tensor_metadata"))
_set_tensor_metadata = cast(Callable[[torch.Tensor, dict[str, bool]], None],
                            getattr(torch._C, "_set_tensor_metadata"))


def copy_tensor_flags(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give ``dst`` ``src``'s lazy conj/neg bits (a copy of the bytes alone would drop them)."""
    _set_tensor_metadata(dst, _get_tensor_metadata(src))


def fsdp_state_param_groups(state: object) -> list[Any]:
    """The param groups of an FSDP2 ``FSDPState``: torch 2.12+ keeps a list
    (``_fsdp_param_groups``; there the old singular name is a property that raises when there
    are several), torch 2.7-2.11 one optional group (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if "_fsdp_param_group" in dir(state):
        group = getattr(state, "_fsdp_param_group")
        return [] if group is None else [group]
    raise UnsupportedTorchError(
        f"this torch {torch.__version__} keeps FSDP2's param groups where flatpool does not "
        "look (neither FSDPState._fsdp_param_groups nor _fsdp_param_group)"
    )


def swap_tensors(a: torch.Tensor, b: torch.Tensor) -> None:
    cast(Callable[[torch.Tensor, torch.Tensor], None], torch.utils.swap_tensors)(a, b)


__all__ = [
    "NEWEST_TESTED", "PRESERVED_STORAGE_REF", "all_gather_single", "reduce_scatter_single", "PRESERVED_TENSOR_REF", "SILENCE_ENV", "SUPPORTED_TORCH",
    "UnsupportedTorchError", "check_supported", "missing_apis",
    "clone", "foreach_copy", "impl_base", "impl_data_ptr", "impl_device", "impl_dtype",
    "copy_tensor_flags", "fsdp_state_param_groups", "impl_address", "impl_element_size", "impl_is_contiguous", "impl_is_inference", "impl_is_leaf",
    "impl_is_meta", "impl_is_nested", "impl_is_quantized", "impl_layout", "impl_numel",
    "impl_requires_grad", "impl_set_", "impl_size", "impl_storage_offset", "impl_stride",
    "impl_untyped_storage", "impl_version", "in_backward", "is_wrapper_subclass",
    "outside_inference",
    "is_functional", "new_storage", "no_torch_dispatch", "no_torch_function", "python_refs",
    "impl_dtype_of", "impl_key", "set_versions", "storage_address", "storage_has_data",
    "storage_key",
    "storage_pointer_valid", "storage_users", "UNREADABLE_STORAGE", "subclass_alias", "swap_impl", "swap_tensors",
    "tensor_impl_users",
    "weak_expired", "weak_free", "weak_storage", "weak_upgrade",
]


def subclass_alias(cls: type[torch.Tensor], t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A ``cls`` object on ``t``'s storage and geometry, built the way ``Tensor._make_subclass``
    builds a storage-sharing wrapper (HyperParallel's DTensor): its TensorImpl carries the
    dispatch keys of ``cls`` (the Python key when it defines ``__torch_dispatch__``), so an impl
    swap onto a wrapper object keeps how the wrapper dispatches."""
    make = cast(Callable[..., torch.Tensor], torch.Tensor._make_subclass)
    return make(cls, t, requires_grad)


def impl_address(t: torch.Tensor) -> int:
    """The address of ``t``'s TensorImpl: tells whether an impl swap happened. (``_cdata`` is
    a property a subclass's ``__torch_function__`` sees, and may refuse, unless disabled.)"""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return int(t._cdata)
    with torch._C.DisableTorchFunctionSubclass():
        result = int(t._cdata)
        return result  # not `return f()`: see flatpool.ownership.interrupts


def swap_impl(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the TensorImpls behind two Python tensor objects in one C call.

    Each object keeps its identity, class, ``__dict__`` and weak references; only what it *is*
    (storage, geometry, autograd view link, version counter) moves. flatpool uses it to move an
    autograd view off its base (``set_`` would leave the base pinning the original) and a
    storage-less meta tensor onto real storage, where ``set_`` refuses.
    """
    torch._C._swap_tensor_impl(a, b)


# -- hostile inputs round 3 (adoption engine): view links, math bits ---------------------
def _links_of(make: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> int:
    base = torch.zeros(2, dtype=dtype)
    before = tensor_impl_users(base)
    view = make(base)
    links = tensor_impl_users(base) - before
    del view
    return links


_MATH_VIEW_LINKS = _links_of(lambda b: b.conj(), torch.complex64)
"""Owners of its base's TensorImpl one conj view adds (measured: 2 on torch 2.13, its
backward and forward-mode view records each keep the base; a narrow view keeps 1)."""
_NEG_VIEW_LINKS = _links_of(lambda b: b._neg_view(), torch.float32)
_REAL_VIEW_LINKS = _links_of(lambda b: b.real, torch.complex64)


_is_conj = cast(Callable[[torch.Tensor], bool], _Base.is_conj)
_is_neg = cast(Callable[[torch.Tensor], bool], _Base.is_neg)


def view_links(view: torch.Tensor, base: torch.Tensor) -> int:
    """How many owners of ``base``'s TensorImpl the autograd view ``view`` accounts for."""
    if _is_conj(view) != _is_conj(base):
        return _MATH_VIEW_LINKS
    if _is_neg(view) != _is_neg(base):
        return _NEG_VIEW_LINKS
    if impl_dtype(base).is_complex and not impl_dtype(view).is_complex:
        return _REAL_VIEW_LINKS
    return 1


def has_math_bits(t: torch.Tensor) -> bool:
    """``t`` reads its bytes through a lazy conj or neg bit."""
    return _is_conj(t) or _is_neg(t)


_grad_slot = _Base.__dict__["grad"]
_hook_slots = tuple(_Base.__dict__[n] for n in ("_backward_hooks", "_post_accumulate_grad_hooks")
                    if n in _Base.__dict__)


def carry_leaf_state(obj: torch.Tensor, old: torch.Tensor) -> None:
    """After :func:`swap_impl`: give ``obj``'s new TensorImpl the ``.grad`` and the hooks
    (``register_hook``, ``register_post_accumulate_grad_hook``) its old one, now ``old``'s,
    had. Both live on the impl's autograd meta; the hook dicts stay on the Python object, and
    assigning them again registers them on the impl it has now."""
    with torch._C.DisableTorchFunctionSubclass():  # a subclass may route these properties
        if not (impl_is_leaf(old) and impl_requires_grad(old) and impl_requires_grad(obj)):
            return
        grad = _grad_slot.__get__(old, type(old))
        if grad is not None:
            _grad_slot.__set__(obj, grad)
        for slot in _hook_slots:
            hooks = slot.__get__(obj, type(obj))
            if hooks is not None:
                slot.__set__(obj, hooks)


_detach = cast(Callable[[torch.Tensor], torch.Tensor], _Base.detach)


def counter_alias(t: torch.Tensor) -> torch.Tensor:
    """A new plain tensor (no autograd link) sharing ``t``'s storage *and version counter*
    (``detach()`` shares the counter); ``set_`` it elsewhere and the counter stays shared."""
    return _detach(t)



_UNREAL_MODES = frozenset({"FakeTensorMode", "FunctionalTensorMode", "ProxyTorchDispatchMode"})
"""Dispatch modes under which tensors made are not real ones (fake, functional, traced). A
mode that passes ops through (one counting allocations, say) is no obstacle."""


def unreal_dispatch_mode() -> object | None:
    """An active dispatch mode whose tensors have no real storage (``FakeTensorMode``,
    ``FunctionalTensorMode``, ``make_fx``'s proxy mode), or ``None``."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if any(k.__name__ in _UNREAL_MODES for k in type(mode).__mro__):
            found: object = mode
            return found
    return None


def in_functorch_transform() -> bool:
    """True inside ``torch.func.grad``/``vmap``/``jacrev``...: tensors made there are wrapped
    at the transform's level (``TensorWrapper``, which has no storage)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


# Which allocator a CPU storage's memory came from. ``t.numpy()`` marks a storage
# non-resizable for good, as torch.from_numpy / frombuffer storages are; only the latter's
# memory belongs to another owner. torch exposes neither the allocator nor the deleter, so the
# StorageImpl's ``allocator_`` word is located at import by probes (two storages of torch's
# CPU allocator agree on it, a frombuffer storage has none there), and read only where found.
def _impl_words(storage: torch.UntypedStorage, n: int) -> list[int]:
    import ctypes

    return list((ctypes.c_uint64 * n).from_address(int(storage._cdata)))


_WORDS = 12


def _probe_allocator_word() -> tuple[int, int] | None:
    try:
        a = torch.empty(64, dtype=torch.uint8).untyped_storage()
        b = torch.empty(1 << 16, dtype=torch.uint8).untyped_storage()
        buf = bytearray(64)
        c = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
        wa, wb, wc = (_impl_words(s, _WORDS) for s in (a, b, c))
        data = {a.data_ptr(), b.data_ptr(), c.data_ptr()}
    except Exception:  # noqa: BLE001 - an unknown build: the word is simply not used
        return None
    found = [i for i in range(3, _WORDS)
             if wa[i] == wb[i] and wa[i] > 4096 and wc[i] == 0 and wa[i] not in data]
    return (found[0], wa[found[0]]) if len(found) == 1 else None


_ALLOCATOR_WORD = _probe_allocator_word()


def torch_allocated(storage: torch.UntypedStorage) -> bool | None:
    """The CPU ``storage``'s memory came from torch's own CPU allocator (so freeing the
    storage frees it, whatever its resizable flag says); ``None`` when unknown."""
    if _ALLOCATOR_WORD is None or storage.device.type != "cpu":
        return None
    index, value = _ALLOCATOR_WORD
    return _impl_words(storage, index + 1)[index] == value


# -- FSDP2's private state (every private FSDP2 name the integration reads) ------------------
# ``FSDPModule`` and ``fully_shard`` are public (``torch.distributed.fsdp``); a module's
# ``FSDPState``, its lazy init and its param groups are not. torch.distributed is imported only
# when a caller asks, so plain flatpool never pays for it.
def fsdp_state(module: object) -> Any:
    """The ``FSDPState`` of a ``fully_shard``-ed module (``FSDPModule._get_fsdp_state``)."""
    return getattr(module, "_get_fsdp_state")()


def fsdp_lazy_init(module: object) -> None:
    """Run FSDP2's lazy initialization of ``module``'s state now (``FSDPState._lazy_init``)."""
    fsdp_state(module)._lazy_init()


def fsdp_module_param_groups(module: object) -> list[Any]:
    """The ``FSDPParamGroup`` objects of one ``fully_shard``-ed module."""
    return fsdp_state_param_groups(fsdp_state(module))


__all__ += ["fsdp_lazy_init", "fsdp_module_param_groups", "fsdp_state"]


# -- TensorImpl fields of many tensors in one vectorized read (per-step validity checks) ------
# A validity check that reads ``data_ptr()`` and ``size()`` per tensor pays a Python-level call
# (and a ``torch.Size``) per field per tensor. These helpers read the same fields for a whole
# list of tensors in three numpy gathers: each object's type and TensorImpl pointer from the
# live Python object (``THPVariable``), then the impl's words. The word offsets are found at
# import by probes on real tensors, checked against the public readers on other tensors; any
# doubt switches the reads off (``RAW_LAYOUT`` is then ``None`` and callers use the per-field
# readers). What keeps them from reading freed memory: the caller's objects are held in an
# object array for the whole read; only objects whose type is a tensor type the caller named
# are followed to their impl; a null impl stops the read; and the reads run only while this
# thread is the interpreter's only thread (see :func:`impl_rows`).
@define(frozen=True)
class ImplLayout:
    """Word (8-byte) offsets found by the probes: in the Python object, in the TensorImpl."""

    py_impl: int
    """The ``THPVariable``'s TensorImpl pointer (its type pointer is word 1 of any object)."""
    vtable: int
    """The plain ``TensorImpl``'s vtable (word 0): an impl subclass (functional, batched,
    nested) has another one and never takes this path."""
    storage: int
    offset: int
    dim: int
    """Dimension count; the sizes follow inline, then the strides (``inline`` of each)."""
    inline: int
    flags: int
    """The word holding the dtype (with the device and layout flags: compared whole)."""


_WORD_SPAN = 21
"""Words of a TensorImpl the probes look at (every field used lies in them; the impl is
larger, so no probe reads past it)."""
_PY_SPAN = 4
"""Words of a tensor's Python object the probes look at (it has at least five)."""


def _words_at(address: int, n: int = _WORD_SPAN) -> list[int]:
    import ctypes

    return list((ctypes.c_int64 * n).from_address(address))


def _probe_tensors() -> list[torch.Tensor]:
    base = torch.zeros(4096)
    return [base[3:13], base.view(64, 64)[1:3, 2:7], base[100:220].view(2, 3, 4, 5),
            torch.zeros(7, 2, 3, 2, 5, dtype=torch.float16)[1:, :, 1:], torch.zeros(11,
            dtype=torch.int64), torch.empty(0, dtype=torch.int32),
            torch.nn.Parameter(torch.ones(5, 3)), torch.zeros(9, dtype=torch.uint8)[2:]]


def _probe_layout() -> ImplLayout | None:
    """Find the words on probe tensors; ``None`` unless each is found at exactly one place and
    the layout then reads other tensors exactly as the public readers do."""
    try:
        probes = _probe_tensors()
        py_words = [_words_at(id(t), _PY_SPAN) for t in probes]
        impl = [int(t._cdata) for t in probes]
        words = [_words_at(a) for a in impl]
        if any(w[1] != id(type(t)) for w, t in zip(py_words, probes)):
            return None

        def only(found: list[int]) -> int | None:
            return found[0] if len(found) == 1 else None

        py_impl = only([i for i in range(2, _PY_SPAN) if all(w[i] == a for w, a in zip(py_words,
                                                                               impl))])
        storage = only([i for i in range(1, _WORD_SPAN) if all(
            w[i] == storage_address(t) for w, t in zip(words, probes))])
        offset = only([i for i in range(1, _WORD_SPAN) if all(
            w[i] == t.storage_offset() for w, t in zip(words, probes))])
        inline = 5
        dim = only([i for i in range(1, _WORD_SPAN - 2 * inline) if all(
            w[i] == t.dim() and w[i + 1:i + 1 + t.dim()] == list(t.shape)
            and w[i + 1 + inline:i + 1 + inline + t.dim()] == list(t.stride())
            for w, t in zip(words, probes))])
        low = [[w[i] & 0xFFFF for w in words] for i in range(_WORD_SPAN)]
        dtypes = [t.dtype for t in probes]
        flags = only([i for i in range(1, _WORD_SPAN) if all(
            (low[i][a] == low[i][b]) == (dtypes[a] == dtypes[b])
            for a in range(len(probes)) for b in range(len(probes)))])
        vtables = {w[0] for w in words}
        if None in (py_impl, storage, offset, dim, flags) or len(vtables) != 1:
            return None
        assert py_impl is not None and storage is not None and offset is not None
        assert dim is not None and flags is not None
        layout = ImplLayout(py_impl, vtables.pop(), storage, offset, dim, inline, flags)
        return layout if _layout_reads_right(layout) else None
    except Exception:  # noqa: BLE001 - an unknown build: the vectorized reads stay off
        return None


def _layout_reads_right(layout: ImplLayout) -> bool:
    """The layout, on tensors the probes did not see, against the public readers."""
    if (max(layout.storage, layout.offset, layout.flags, layout.dim + 2 * layout.inline)
            >= _WORD_SPAN or layout.py_impl >= _PY_SPAN):
        return False
    base = torch.arange(600, dtype=torch.float64)
    checks = [base[17:29].view(3, 4), base.view(20, 30).t()[2:5, 1:4],
              torch.ones(3, 1, 2, dtype=torch.bfloat16), torch.zeros(0, 4)[:, 1:],
              base.view(torch.int64)[5:9], torch.nn.Parameter(torch.zeros(6))]
    for t in checks:
        w = _words_at(int(t._cdata))
        d = w[layout.dim]
        if (_words_at(id(t), _PY_SPAN)[layout.py_impl] != int(t._cdata) or w[0] != layout.vtable
                or w[layout.storage] != storage_address(t)
                or w[layout.offset] != t.storage_offset() or d != t.dim()
                or w[layout.dim + 1:layout.dim + 1 + d] != list(t.shape)
                or w[layout.dim + 1 + layout.inline:layout.dim + 1 + layout.inline + d]
                != list(t.stride())):
            return False
    same = [_words_at(int(t._cdata))[layout.flags] & 0xFFFF for t in checks]
    return len({same[0], same[4]}) == 2 and same[0] == same[1]


RAW_LAYOUT: ImplLayout | None = _probe_layout()
"""Where the vectorized reads find their words, or ``None`` (probe failed or ambiguous: every
caller then uses the per-field readers)."""


class _Span:
    """``__array_interface__`` over the address space from 8 on, read-only, never written."""

    def __init__(self, address: int, words: int) -> None:
        self.__array_interface__ = {"data": (address, True), "shape": (words,),
                                    "typestr": "<i8", "version": 3}


def _thread_states() -> Callable[[], bool] | None:
    try:
        import ctypes

        api = ctypes.pythonapi
        api.PyInterpreterState_Get.restype = ctypes.c_void_p
        head, nxt = api.PyInterpreterState_ThreadHead, api.PyThreadState_Next
        head.restype, head.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        nxt.restype, nxt.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        interp = api.PyInterpreterState_Get()
        return lambda: nxt(head(interp)) is None
    except Exception:  # noqa: BLE001 - no C API through ctypes: the reads stay off
        return None


_sole_thread = _thread_states()


def sole_thread() -> bool:
    """This thread is the interpreter's only thread state: no other thread can run Python
    (and so swap a tensor's impl away and free it) while a vectorized read runs."""
    return _sole_thread is not None and _sole_thread()


_ROWS: dict[int, Any] = {}
"""Per row width, a read-only view of the address space from 8 on whose row ``i`` is the
``width`` words from address ``8 * (i + 1)``: one index per object reads its words."""
_COLS: dict[tuple[Any, ...], Any] = {}


def _rows(width: int) -> Any:
    view = _ROWS.get(width)
    if view is None:
        import numpy as np
        from numpy.lib.stride_tricks import as_strided

        view = _ROWS[width] = as_strided(np.asarray(_Span(8, 1 << 53)), shape=(1 << 53, width),
                                         strides=(8, 8), writeable=False)
    return view


def _probe_count_words() -> int | None:
    """The TensorImpl word whose low 32 bits are its use count (:func:`tensor_impl_users`),
    found on one tensor whose count is raised step by step, if exactly one word tracks it and a
    Python object's word 0 is its reference count; else ``None`` (counts are not read)."""
    try:
        with outside_inference():
            t = torch.zeros(6)
            seen: list[list[int]] = []
            keep: list[torch.Tensor] = []
            for _ in range(4):
                py = _words_at(id(t), 1)[0]
                if py != sys.getrefcount(t) - 1:
                    return None
                seen.append([w & 0xFFFFFFFF for w in _words_at(int(t._cdata))])
                seen[-1].append(tensor_impl_users(t))
                keep.append(t.view(6))  # a view's autograd base link owns t's impl
            found = [i for i in range(1, _WORD_SPAN)
                     if all(row[i] == row[-1] for row in seen)]
            if len(found) != 1 or len({row[-1] for row in seen}) != len(seen):
                return None
            other = torch.ones(3)
            if _words_at(int(other._cdata))[found[0]] & 0xFFFFFFFF != tensor_impl_users(other):
                return None
            return found[0]
    except Exception:  # noqa: BLE001 - an unknown build: counts are not read
        return None


USE_COUNT_WORD: int | None = _probe_count_words() if RAW_LAYOUT is not None else None
"""Where :func:`impl_unchanged` reads a parameter's liveness (``ParamRef``'s rule) for all
parameters at once, or ``None`` (the caller calls the references)."""


def counts_readable() -> bool:
    """:func:`impl_unchanged` can read reference counts now (``held_once``): the probe found
    the words, and no Python 3.10 trace function keeps copies of locals in ``f_locals``."""
    return USE_COUNT_WORD is not None and not (_TRACERS_FILL_LOCALS and sys.gettrace() is not None)


def impl_rows(objects: Any, n: int, types: Any, dims: int, strides: bool,
              counted: tuple[int, int] = (0, 0)) -> Any:
    """Per object of the iterable ``objects`` (``n`` of them), its TensorImpl pointer and a
    row of int64 words: the impl's vtable, storage key, storage offset, dimension count, the
    first ``dims`` sizes (and strides), the dtype word. ``None`` when the reads are off,
    another thread exists, the count differs, an object's type is not the one ``types`` (an
    int64 array of ``id(type)``) names, or an impl pointer is null: the caller reads per field.

    Only sizes up to :attr:`ImplLayout.inline` dimensions are inline: a caller compares the
    dimension count before trusting them (a longer tensor keeps them elsewhere).

    For the objects at positions ``counted`` (``[a, b)``), a third and fourth array: their
    Python reference counts, read while the call holds them (its own reference included), and
    their impls' use counts (``None`` where :data:`USE_COUNT_WORD` is unknown).
    """
    layout = RAW_LAYOUT
    if layout is None or dims > layout.inline or not sole_thread():
        return None
    if counted[1] > counted[0] and USE_COUNT_WORD is None:
        return None
    import numpy as np

    try:
        held = np.fromiter(objects, dtype=object, count=n)  # strong references for the call
    except ValueError:  # fewer than n
        return None
    if len(held) != n or len(types) != n:
        return None
    cols = _COLS.get((dims, strides))
    if cols is None:
        words = [0, layout.storage, layout.offset, layout.dim]
        words += [layout.dim + 1 + i for i in range(dims)]
        if strides:
            words += [layout.dim + 1 + layout.inline + i for i in range(dims)]
        cols = _COLS[(dims, strides)] = np.array(words + [layout.flags])
    # Word 1 of any object is its type; only a tensor of the type named is read further (its
    # impl pointer lies inside the object; an object of another type may be shorter).
    word = _rows(1)
    ids = (np.asarray(_Span(held.__array_interface__["data"][0], n)) >> 3) - 1
    try:  # (an address past the view's 2**56 bytes raises before anything is read there)
        if not (word[ids + 1, 0] == types).all():
            return None
        impl = word[ids + layout.py_impl, 0]
        if not impl.all():
            return None
        rows = _rows(1)[:, 0].take(((impl >> 3) - 1)[:, None] + cols)  # (only the words used)
        a, b = counted
        if b > a:
            assert USE_COUNT_WORD is not None
            refs = word[ids[a:b], 0]  # (held: the array's reference is in the count)
            users = word[((impl[a:b] >> 3) - 1) + USE_COUNT_WORD, 0] & 0xFFFFFFFF
    except IndexError:
        return None
    del held
    if not sole_thread():  # a thread came up meanwhile: what was read is not trusted
        return None
    return (impl, rows, refs, users) if b > a else (impl, rows)


VECTORIZED_MIN = 128
"""Fewer tensors than this are read per field: the vectorized read's fixed cost (a dozen numpy
calls, ~25 us) is more than the per-field passes save below it (measured: 16 members 1.5-2.4 us
a member vectorized, 0.8-0.9 per field; equal at 64; 0.21 vs 0.53 at 1,000)."""

_GEOMETRY_TYPES = (torch.Tensor, torch.nn.Parameter)
"""Types whose impl sizes are the fields themselves (no Python sizes policy): a snapshot that
callers trust for geometry takes only these."""


@define(frozen=True, eq=False)
class ImplSnapshot:
    """What :func:`impl_rows` read of a list of tensors, to compare a later read with."""

    types: Any
    dims: int
    strides: bool
    impls: Any
    rows: Any


def impl_snapshot(tensors: Sequence[torch.Tensor], *, geometry: int | None = None,
                  strides: bool = False) -> ImplSnapshot | None:
    """A snapshot of ``tensors`` for :func:`impl_unchanged`, or ``None`` when vectorized reads
    cannot serve them (reads off, another thread, an impl subclass, more than the inline
    dimensions, or among the first ``geometry`` (all by default), whose geometry the caller
    relies on, a tensor type other than ``Tensor``/``Parameter``)."""
    layout = RAW_LAYOUT
    if layout is None or len(tensors) < VECTORIZED_MIN:
        return None
    kinds = list(map(type, tensors))
    if not all(k in _GEOMETRY_TYPES for k in kinds[:geometry]):
        return None
    import numpy as np

    dims = max(map(len, map(impl_size, tensors)))
    if dims > layout.inline:
        return None
    types = np.fromiter(map(id, kinds), dtype=np.int64, count=len(kinds))
    read = impl_rows(iter(tensors), len(tensors), types, dims, strides)
    if read is None or not (read[1][:, 0] == layout.vtable).all() or (read[1][:, 3] > dims).any():
        return None
    return ImplSnapshot(types, dims, strides, read[0], read[1])


def impl_unchanged(objects: Any, n: int, snap: ImplSnapshot,
                   held_once: tuple[int, int] = (0, 0)) -> bool | None:
    """The ``n`` objects of ``objects`` read word for word as ``snap``: the same types, impls,
    storages, storage offsets, dimension counts, sizes (strides) and dtypes. ``None`` when the
    vectorized read cannot run now, or an object is not of its remembered type (the caller
    then reads per field).

    ``held_once``: positions ``[a, b)`` of parameters the caller's ``ParamRef`` slots hold, one
    slot each (the snapshot's objects are distinct): ``False`` unless each also reads alive by
    ``ParamRef``'s rule, a Python reference beyond the slot's and the read's own (beyond
    torch's preserved one too while its impl has other owners). ``None`` where counts cannot
    be read (Python 3.10 under a trace function keeps stale copies in ``f_locals``)."""
    if held_once[1] > held_once[0] and not counts_readable():
        return None
    read = impl_rows(objects, n, snap.types, snap.dims, snap.strides, held_once)
    if read is None:
        return None
    if not ((read[0] == snap.impls).all() and (read[1] == snap.rows).all()):
        return False
    if len(read) == 4:  # the slot and the read's array, and torch's while C++ shares the impl
        return bool((read[2] > 2 + PRESERVED_TENSOR_REF * (read[3] > 1)).all())
    return True


def impl_snapshot_by_column(tensors: Sequence[torch.Tensor],
                            geometry: Sequence[torch.Tensor] = ()) -> ImplSnapshot | None:
    """:func:`impl_snapshot` of ``tensors`` in any order, with the rows kept column by column
    in memory (the layout :func:`impl_same` compares); ``None`` also when one of ``geometry``
    (those among them whose geometry the caller relies on) is not a ``Tensor``/``Parameter``."""
    if not all(type(t) in _GEOMETRY_TYPES for t in geometry):
        return None
    snap = impl_snapshot(tensors, geometry=0)
    if snap is None:
        return None
    import numpy as np

    return ImplSnapshot(snap.types, snap.dims, snap.strides, snap.impls,
                        np.ascontiguousarray(snap.rows.T).T)


def object_addresses(objects: Sequence[object]) -> Any:
    """The addresses of ``objects`` as an int64 array (for :func:`impl_same`)."""
    import numpy as np

    return np.fromiter(map(id, objects), dtype=np.int64, count=len(objects))


def impl_same(objects: Any, n: int, snap: ImplSnapshot, addresses: Any = None) -> bool | None:
    """:func:`impl_unchanged` (no reference counts) read a column at a time: each word is one
    gather over all ``n`` objects, compared with a snapshot from :func:`impl_snapshot_by_column`
    without a per-object inner loop (a row-wise index of a few words an object costs several
    times the gather). With ``addresses`` (an int64 array), ``False`` also unless the objects
    are those at these addresses; the caller must hold them strongly, so that equal addresses
    mean the same objects. ``None`` as :func:`impl_unchanged`: the caller reads per field."""
    layout = RAW_LAYOUT
    if layout is None or not sole_thread() or len(snap.types) != n:
        return None
    import numpy as np

    try:
        held = np.fromiter(objects, dtype=object, count=n)  # strong references for the call
    except ValueError:  # fewer than n
        return None
    if len(held) != n:
        return None
    cols = _COLS.get((snap.dims, snap.strides, "by column"))
    if cols is None:
        words = [0, layout.storage, layout.offset, layout.dim]
        words += [layout.dim + 1 + i for i in range(snap.dims)]
        if snap.strides:
            words += [layout.dim + 1 + layout.inline + i for i in range(snap.dims)]
        # minus one: word[i] is the word at 8 * (i + 1), so an impl's word w is at
        # index (impl >> 3) + w - 1
        cols = np.array(words + [layout.flags])[:, None] - 1
        _COLS[(snap.dims, snap.strides, "by column")] = cols
    word = _rows(1)[:, 0]  # word[i] is the word at address 8 * (i + 1)
    at = np.asarray(_Span(held.__array_interface__["data"][0], n))  # the objects' addresses
    if addresses is not None and not (at == addresses).all():
        return False
    at = at >> 3  # an object's word w is at index at + w - 1 (its type, word 1, at ``at``)
    try:  # (same order of reads, and same guards, as impl_rows)
        if not (word.take(at) == snap.types).all():
            return None
        impl = word.take(at + (layout.py_impl - 1))
        if not (impl == snap.impls).all():  # (the snapshot's impls are never null)
            return False if impl.all() else None
        impl >>= 3
        same = bool((word.take(cols + impl) == snap.rows.T).all())
    except IndexError:
        return None
    del held
    if not sole_thread():  # a thread came up meanwhile: what was read is not trusted
        return None
    return same


__all__ += ["impl_same", "impl_snapshot_by_column", "object_addresses"]
__all__ += ["ImplLayout", "ImplSnapshot", "RAW_LAYOUT", "VECTORIZED_MIN", "impl_rows", "impl_snapshot",
            "impl_unchanged", "sole_thread", "USE_COUNT_WORD", "counts_readable"]


# -- The same read, with some objects found through their holders' ``__slots__`` word ----------
# A per-step check that calls a holder (``ParamRef``) per parameter pays a Python-level call per
# parameter. A holder with a slot keeps a strong reference in a fixed word of itself: reading
# that word for every holder at once (holders kept alive by the snapshot) finds the objects
# without Python, and their reference counts are then exact (no array of ours holds them).
def slot_word(cls: type, name: str) -> int | None:
    """The word of a ``cls`` instance that holds its ``__slots__`` member ``name``, found on a
    probe instance given two values in turn; ``None`` when the reads are off or it is not
    exactly one word."""
    if RAW_LAYOUT is None:
        return None
    try:
        probe: object = object.__new__(cls)
        values = (object(), object())
        span = cls.__basicsize__ // 8
        seen: list[list[int]] = []
        for v in values:
            setattr(probe, name, v)
            seen.append(_words_at(id(probe), span))
        found = [i for i in range(2, span) if all(w[i] == id(v) for w, v in zip(seen, values))]
        return found[0] if len(found) == 1 else None
    except Exception:  # noqa: BLE001 - not a slotted class, or an unknown build
        return None


@define(frozen=True, eq=False)
class SlotSnapshot:
    """An :class:`ImplSnapshot` whose last ``len(holders)`` objects are read through the
    holders' slot word, with every gather index precomputed (the impls are compared first)."""

    snap: ImplSnapshot
    holders: list[object]
    """Kept alive here: their addresses are in ``slots``."""
    slots: Any
    at: Any
    """Flat word indices of the remembered impls' words, row by row (``snap.rows`` order)."""
    words: Any
    users: Any
    """Word indices of the slotted objects' impl use counts."""


def slot_snapshot(snap: ImplSnapshot, holders: Sequence[object], slot: int) -> SlotSnapshot | None:
    """For :func:`slot_unchanged`: ``snap``'s last ``len(holders)`` objects are what each
    holder's word ``slot`` (:func:`slot_word`) holds. ``None`` where counts are not read."""
    if USE_COUNT_WORD is None or RAW_LAYOUT is None:
        return None
    import numpy as np

    cols = _COLS[(snap.dims, snap.strides)]
    impls = (snap.impls >> 3) - 1
    slots = np.fromiter((id(h) // 8 - 1 + slot for h in holders), dtype=np.int64,
                        count=len(holders))
    return SlotSnapshot(snap, list(holders), slots, (impls[:, None] + cols).ravel(),
                        snap.rows.ravel().copy(), impls[len(impls) - len(holders):] + USE_COUNT_WORD)


def slot_unchanged(objects: Any, n: int, s: SlotSnapshot) -> bool | None:
    """Like :func:`impl_unchanged` with every slotted object in ``held_once`` (``ParamRef``'s
    rule, a Python reference beyond the slot's, read from the counts), for the ``n`` objects
    of ``objects`` followed by what the holders' slots hold now. ``None`` where it cannot run
    now or a type differs (a slot emptied holds ``None``)."""
    layout, snap = RAW_LAYOUT, s.snap
    if layout is None or not counts_readable() or not sole_thread():
        return None
    import numpy as np

    try:
        held = np.fromiter(objects, dtype=object, count=n)  # strong references for the call
    except ValueError:  # fewer than n
        return None
    word = _rows(1)[:, 0]  # (element i: the word at 8 * (i + 1); an object's word k: at i + k - 1)
    try:  # (as in impl_rows: each read only after what it follows was checked)
        at = np.concatenate((np.asarray(_Span(held.__array_interface__["data"][0], n)) >> 3,
                             word.take(s.slots) >> 3))
        if not (word.take(at) == snap.types).all():
            return None
        if not ((word.take(at + (layout.py_impl - 1)) == snap.impls).all()
                and (word.take(s.at) == s.words).all()):
            return False
        refs = word.take(at[n:] - 1)
        users = word.take(s.users) & 0xFFFFFFFF
    except IndexError:
        return None
    del held
    if not sole_thread():
        return None
    return bool((refs > 1 + PRESERVED_TENSOR_REF * (users > 1)).all())


__all__ += ["SlotSnapshot", "slot_snapshot", "slot_unchanged", "slot_word"]
