"""Every private torch API flatpool uses, each behind a named function that says why.

torch moves these between releases, so the supported range is this file's business; nothing
else touches ``torch._C``, ``_cdata``, ``_unsafe_*`` or reference counts. Geometry readers are
``torch._C.TensorBase``'s own methods: a subclass may lie in ``shape`` (HyperParallel's DTensor)
or raise in ``__torch_function__``; callers read under :func:`no_torch_function`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from itertools import chain, compress, repeat
from operator import attrgetter, is_, itemgetter
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
from torch.torch_version import TorchVersion

from ._warn import warn
from .errors import FlatPoolError, UntestedTorchWarning

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, ReduceOp, Work

SUPPORTED_TORCH = (2, 7)
"""Oldest torch release the test suite passes on; older ones are refused at import."""
NEWEST_TESTED = (2, 15)
"""Newest torch release the test suite passed on; a newer one warns at import."""
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
    """The object ``a.b.c`` denotes, importing modules on the way."""
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
    """Refuse a torch below the floor or lacking a needed private API; warn for an untested one."""
    version = TorchVersion(torch.__version__)
    lo = ".".join(map(str, SUPPORTED_TORCH))
    tested = ".".join(map(str, NEWEST_TESTED))
    if version < lo:  # TorchVersion compares as versions: '2.10' > '2.7', '2.7.0rc1' < '2.7'
        raise UnsupportedTorchError(
            f"flatpool supports torch >= {lo}; this is torch {torch.__version__}. "
            f"Install a supported release (pip install 'torch>={lo}').")
    missing = missing_apis()
    if missing:
        raise UnsupportedTorchError(
            f"torch {torch.__version__} lacks {', '.join(missing)}, which flatpool needs (tested "
            f"on torch {lo} to {tested}). Install a tested release (pip install "
            f"'torch>={lo},<{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}') or a newer flatpool.")
    # X.Y.dev0 sorts before every X.Y release and pre-release: a 2.16 nightly is untested too
    first_untested = f"{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}.dev0"
    if version >= first_untested and os.environ.get(SILENCE_ENV) != "1":
        warn(
            f"flatpool was tested on torch {lo} to {tested}; this is torch {torch.__version__}. "
            f"Every private API it needs is present, so it goes ahead; please report a failure. "
            f"Set {SILENCE_ENV}=1 to silence this warning.",
            UntestedTorchWarning)


check_supported()  # before the probes below: an old torch lacks some of what they read

from torch.utils._python_dispatch import (  # noqa: E402
    is_traceable_wrapper_subclass as _is_traceable,
)


# -- collectives ---------------------------------------------------------------------------
# torch 2.13+ renamed the single-tensor collectives and warns on the old names on every call;
# a release without the new names gets the old ones.
def _collective(new: str, old: str) -> Callable[..., Work | None]:
    import torch.distributed as dist

    return cast(Callable[..., "Work | None"], getattr(dist, new, None) or getattr(dist, old))


def all_gather_single(output: torch.Tensor, input: torch.Tensor, *,
                      group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Every rank's ``input`` concatenated into ``output``."""
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
    """Leave ``torch.inference_mode()`` for the block if in it: flatpool's own tensors must
    never be inference tensors (``inference_mode(False)`` also enables grad: only when needed)."""
    if torch.is_inference_mode_enabled():
        return cast(AbstractContextManager[Any], torch.inference_mode(False))
    return nullcontext()


def no_torch_dispatch() -> AbstractContextManager[Any]:
    """Stop ``__torch_dispatch__``: aten ops run natively on a subclass's own TensorImpl."""
    return cast(AbstractContextManager[Any], torch._C._DisableTorchDispatch())


no_torch_function: Callable[[], AbstractContextManager[Any]] = (
    torch._C.DisableTorchFunctionSubclass)
"""Stop subclasses' ``__torch_function__`` for the block (it may raise or lie)."""


impl_size: Callable[[torch.Tensor], torch.Size] = _Base.size
impl_stride: Callable[[torch.Tensor], tuple[int, ...]] = _Base.stride
impl_storage_offset: Callable[[torch.Tensor], int] = cast(Callable[[torch.Tensor], int],
                                                      _Base.storage_offset)
impl_numel: Callable[[torch.Tensor], int] = _Base.numel
impl_element_size: Callable[[torch.Tensor], int] = _Base.element_size
impl_is_contiguous: Callable[[torch.Tensor], bool] = _Base.is_contiguous
impl_untyped_storage: Callable[[torch.Tensor], torch.UntypedStorage] = _Base.untyped_storage
impl_is_inference: Callable[[torch.Tensor], bool] = _Base.is_inference
impl_detach: Callable[[torch.Tensor], torch.Tensor] = _Base.detach
storage_nbytes: Callable[[torch.UntypedStorage], int] = torch._C.StorageBase.nbytes  # type: ignore[attr-defined]
"""The storage's own size, past any subclass: how many bytes it still holds."""
impl_set_: Callable[..., torch.Tensor] = _Base.set_
impl_dtype_of: Callable[[torch.Tensor], torch.dtype] = _Base.__dict__["dtype"].__get__
"""C callable form of :func:`impl_dtype`, for ``map``."""

def _getter(name: str) -> Callable[[torch.Tensor], Any]:
    """The getset descriptor's own C ``__get__``: no Python frame per read."""
    get: Callable[[torch.Tensor], Any] = _Base.__dict__[name].__get__
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


tensor_impl_users = cast(Callable[[torch.Tensor], int], getattr(torch.Tensor, "_use_count"))
"""Owners of ``t``'s TensorImpl: its Python object plus every C++ holder (view base link, saved
tensor, DLPack capsule holding raw pointers: an unexplained owner must stop a move)."""


# -- storages ------------------------------------------------------------------------------
def storage_key(storage: torch.UntypedStorage) -> int:
    """An identity for a live storage: its StorageImpl address (unique while it lives)."""
    return int(storage._cdata)


storage_address: Callable[[torch.Tensor], int] = getattr(torch._C, "_storage_address")
"""The key of ``t``'s storage without making a Python storage object (cheap, no gc)."""


def storage_users(storage: torch.UntypedStorage) -> int:
    """Owners of a StorageImpl: every TensorImpl on it and every Python storage object."""
    return int(torch._C._storage_Use_Count(storage._cdata))


def storage_has_data(storage: torch.UntypedStorage) -> bool:
    """False for placeholder storages (functional, wrapper: ``data_ptr()`` raises; fake: meta,
    checked first since its ``data_ptr()`` warns). Callers compare ``nbytes()`` themselves."""
    if storage.device.type == "meta":
        return False
    return storage_pointer_valid(storage)


UNREADABLE_STORAGE = (RuntimeError, NotImplementedError, TypeError)
"""What reading a placeholder storage's pointer raises."""


def storage_pointer_valid(storage: torch.UntypedStorage) -> bool:
    """:func:`storage_has_data` without the meta check, for tensors known not meta or fake."""
    try:
        ptr = storage.data_ptr()
    except UNREADABLE_STORAGE:
        return False
    return ptr != 0 or storage.nbytes() == 0


is_functional: Callable[[torch.Tensor], bool] = getattr(torch, "_is_functional_tensor")
"""A C++ functional tensor (its type may be ``torch.Tensor``): its storage is a placeholder."""


def _refcount_in_a_call(obj: object) -> int:
    return sys.getrefcount(obj)


_CALL_REFS = _refcount_in_a_call(object())
"""What a count taken inside a called function adds to the caller's references (2, or 3 on
Python 3.10), measured with a function of :func:`python_refs`' shape."""


_TRACERS_FILL_LOCALS = sys.version_info < (3, 11)
"""Python 3.10 copies frame locals into ``f_locals`` for a ``sys.settrace`` function (pdb, the
interrupt tests): those copies hold references."""


def python_refs(obj: object) -> int:
    """``obj``'s Python references as the caller sees them (torch may hold one more: see
    :data:`PRESERVED_STORAGE_REF`)."""
    if _TRACERS_FILL_LOCALS and sys.gettrace() is not None:
        return _refs_beside_locals_copies(obj)
    return sys.getrefcount(obj) - _CALL_REFS


def _refs_beside_locals_copies(obj: object) -> int:
    # Refresh every frame's f_locals copy (reading does), count, take away the copies'
    # references. C-level iteration only: as many traced lines whatever the stack depth.
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
    """PyObject preservation for (storages, tensors): 1 on torch 2.10+, 0 before."""
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
"""References torch holds on a storage's / tensor's Python object while its impl has other C++
owners (measured at import): pin counts subtract them."""


def in_backward() -> bool:
    """True while autograd runs a backward pass (in a backward hook, say)."""
    return int(torch._C._current_graph_task_id()) != -1


# Raw storage weak references: ``StorageWeakRef`` objects by the thousand load the gc.
weak_storage = cast(Callable[[torch.UntypedStorage], int], torch.UntypedStorage._weak_ref)
"""A weak reference to ``storage`` (an int: free it with :func:`weak_free`)."""
weak_expired = cast(Callable[[int], bool], torch.UntypedStorage._expired)
weak_free = cast(Callable[[int], None], torch.UntypedStorage._free_weak_ref)
_from_weak = cast(Callable[[int], torch.UntypedStorage], torch.UntypedStorage._new_with_weak_ptr)


def weak_upgrade(ref: int) -> torch.UntypedStorage | None:
    """The storage again, if it still lives."""
    if weak_expired(ref):
        return None
    return _from_weak(ref)


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
    """Undo ``set_``/``copy_``'s version bumps: a pending backward must not see a modification."""
    if not tensors:
        return
    if _TUPLE_FORM:
        _set_version_counter(tuple(tensors), tuple(versions))
        return
    for t, v in zip(tensors, versions):
        _set_version_counter(t, v)


# -- bulk ops ------------------------------------------------------------------------------
def foreach_copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` in one call; a dtype with no copy kernel (``float4_e2m1fn_x2``)
    is copied as same-size integers."""
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
    """The param groups of an FSDP2 ``FSDPState``: a list on torch 2.12+, one optional group
    before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if "_fsdp_param_group" in dir(state):
        group = getattr(state, "_fsdp_param_group")
        return [] if group is None else [group]
    raise UnsupportedTorchError(
        f"this torch {torch.__version__} keeps FSDP2's param groups where flatpool does not "
        "look (neither FSDPState._fsdp_param_groups nor _fsdp_param_group)")


def swap_tensors(a: torch.Tensor, b: torch.Tensor) -> None:
    cast(Callable[[torch.Tensor, torch.Tensor], None], torch.utils.swap_tensors)(a, b)


__all__ = [
    "NEWEST_TESTED", "PRESERVED_STORAGE_REF", "PRESERVED_TENSOR_REF", "SILENCE_ENV",
    "SUPPORTED_TORCH", "UnsupportedTorchError", "all_gather_single", "check_supported", "clone",
    "copy_tensor_flags", "foreach_copy", "fsdp_state_param_groups", "impl_address", "impl_base",
    "impl_detach", "impl_device", "impl_dtype", "impl_dtype_of", "impl_element_size",
    "impl_is_contiguous", "impl_is_inference", "impl_is_leaf", "impl_is_meta", "impl_is_nested",
    "impl_is_quantized", "impl_layout", "impl_numel", "impl_requires_grad", "impl_set_",
    "impl_size", "impl_storage_offset", "impl_stride", "impl_untyped_storage", "impl_version",
    "in_backward", "is_functional", "is_wrapper_subclass", "missing_apis", "new_storage",
    "no_torch_dispatch", "no_torch_function", "outside_inference", "python_refs",
    "reduce_scatter_single", "set_versions", "storage_address", "storage_has_data", "storage_key",
    "storage_nbytes", "storage_pointer_valid", "storage_users", "subclass_alias", "swap_impl",
    "swap_tensors", "tensor_impl_users", "weak_expired", "weak_free", "weak_storage",
    "weak_upgrade",
]


def subclass_alias(cls: type[torch.Tensor], t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A ``cls`` object on ``t``'s storage, made like a storage-sharing wrapper: its impl carries
    ``cls``'s dispatch keys, so an impl swap onto a wrapper keeps how it dispatches."""
    make = cast(Callable[..., torch.Tensor], torch.Tensor._make_subclass)
    return make(cls, t, requires_grad)


def impl_address(t: torch.Tensor) -> int:
    """The address of ``t``'s TensorImpl: tells whether an impl swap happened."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return int(t._cdata)
    with torch._C.DisableTorchFunctionSubclass():
        result = int(t._cdata)
        return result  # not `return f()`: see flatpool._interrupts


def swap_impl(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the TensorImpls behind two Python objects (identity, class, ``__dict__`` stay):
    for views (``set_`` would leave the base pinning the original) and meta tensors."""
    torch._C._swap_tensor_impl(a, b)


# -- view links ------------------------------------------------------------------------------
def _links_of(make: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> int:
    base = torch.zeros(2, dtype=dtype)
    before = tensor_impl_users(base)
    view = make(base)
    links = tensor_impl_users(base) - before
    del view
    return links


_MATH_VIEW_LINKS = _links_of(lambda b: b.conj(), torch.complex64)
"""Owners of its base's TensorImpl one conj view adds, measured (a narrow view adds 1)."""
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


_grad_slot = _Base.__dict__["grad"]
_hook_slots = tuple(_Base.__dict__[n] for n in ("_backward_hooks", "_post_accumulate_grad_hooks")
                    if n in _Base.__dict__)


def carry_leaf_state(obj: torch.Tensor, old: torch.Tensor) -> None:
    """After :func:`swap_impl`: give ``obj``'s new impl the ``.grad`` and hooks its old one had
    (they live on the impl; assigning the object's hook dicts again registers them)."""
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


def counter_alias(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor sharing ``t``'s storage *and version counter* (``detach()``)."""
    return impl_detach(t)


_UNREAL_MODES = frozenset({"FakeTensorMode", "FunctionalTensorMode", "ProxyTorchDispatchMode"})
"""Dispatch modes whose tensors are not real (a pass-through mode is no obstacle)."""


def unreal_dispatch_mode() -> object | None:
    """An active dispatch mode whose tensors have no real storage, or ``None``."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if any(k.__name__ in _UNREAL_MODES for k in type(mode).__mro__):
            found: object = mode
            return found
    return None


def in_functorch_transform() -> bool:
    """Inside ``torch.func`` transforms tensors are storage-less ``TensorWrapper``s."""
    return torch._C._functorch.peek_interpreter_stack() is not None


# -- FSDP2's private state (every private FSDP2 name the integration reads) ------------------
# torch.distributed is imported only when a caller asks: plain flatpool never pays for it.
def fsdp_state(module: object) -> Any:
    """The ``FSDPState`` of a ``fully_shard``-ed module (``FSDPModule._get_fsdp_state``)."""
    return getattr(module, "_get_fsdp_state")()


def fsdp_lazy_init(module: object) -> None:
    """Run FSDP2's lazy initialization of ``module``'s state now (``FSDPState._lazy_init``)."""
    fsdp_state(module)._lazy_init()


def fsdp_module_param_groups(module: object) -> list[Any]:
    """The ``FSDPParamGroup`` objects of one ``fully_shard``-ed module."""
    return fsdp_state_param_groups(fsdp_state(module))


__all__ += ["fsdp_lazy_init", "fsdp_module_param_groups"]


# -- DistributedDataParallel (whose Reducer makes the ``.grad`` of the parameters it serves) --
def ddp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Every ``DistributedDataParallel`` in ``module``'s tree."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return [m for m in module.modules() if isinstance(m, DDP)]


def active_ddp() -> torch.nn.Module | None:
    """The ``DistributedDataParallel`` whose forward is running (it wraps the module whose
    forward hook asks), or ``None`` (``DistributedDataParallel._active_ddp_module``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    active: torch.nn.Module | None = getattr(DDP, "_active_ddp_module", None)
    return active


__all__ += ["active_ddp", "ddp_modules"]


# -- FSDP2's reduce-scatter extension point (``FSDPModule.set_custom_reduce_scatter``) --------
REDUCE_SCATTER_API_SINCE = "2.9"
"""The torch release that added ``FSDPModule.set_custom_reduce_scatter`` (pytorch#155189)."""


def fsdp_reduce_scatter_api() -> tuple[type, type] | None:
    """FSDP2's ``ReduceScatter`` interface and its ``DefaultReduceScatter``, or ``None`` on a torch
    without ``FSDPModule.set_custom_reduce_scatter``."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:
        return None
    if not callable(getattr(FSDPModule, "set_custom_reduce_scatter", None)):
        return None
    return ReduceScatter, DefaultReduceScatter


def fsdp_group_reduce_scatter_comm(group: object) -> object:
    """The ``ReduceScatter`` an ``FSDPParamGroup`` runs (``_reduce_scatter_comm``)."""
    return getattr(group, "_reduce_scatter_comm", None)


def fsdp_group_is_hsdp(group: object) -> bool:
    """The group reduces over a replicate dimension too (HSDP: ``_is_hsdp``)."""
    return bool(getattr(group, "_is_hsdp", False))


__all__ += ["REDUCE_SCATTER_API_SINCE", "fsdp_group_is_hsdp", "fsdp_group_reduce_scatter_comm",
            "fsdp_reduce_scatter_api"]
