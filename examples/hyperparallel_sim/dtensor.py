"""A hostile double of HyperParallel's torch DTensor, rebuilt from its public behaviour.

HyperParallel (``hyper_parallel/platform/torch/dtensor.py`` ``DTensorBase`` under
``hyper_parallel/core/dtensor/dtensor.py`` ``DTensor``) builds its DTensor with
``Tensor._make_subclass``: the wrapper has a TensorImpl of its own that *shares the local shard's
storage*, while Python-level overrides answer from ``_local_tensor`` or with the *global* shape.
Its ``__torch_function__`` sends every op through a layout dispatcher that runs whitelisted ops
on the local tensors, runs ops with a layout rule and re-wraps their outputs, and raises
``RuntimeError("Operator <name> dose not contain parallel layout infer func.")`` for the rest
(``Tensor.data_ptr(w)``, ``Tensor.untyped_storage(w)``, ``TensorBase.size(w)``, ``w.is_meta``
is routed to the local tensor through the whitelisted ``__get__``).

Two generations are modelled (see HP-NOTES.md for the sources):

* ``setter="routed"`` (every version before the fix): ``w.data = x`` enters
  ``__torch_function__`` as the whitelisted ``__set__`` and so runs ``w._local_tensor.data = x``;
  the wrapper keeps its old storage. This is the seed bug.
* ``setter="rebind"`` (newest): the ``data`` property rebinds the wrapper *and* the local tensor
  with ``__torch_function__`` off (``DisableTorchFunctionSubclass``); a storage-less
  (``_make_wrapper_subclass``) "fake wrapper" only swaps ``_local_tensor``. The newest class also has ``__tensor_flatten__``
  (so ``is_traceable_wrapper_subclass`` is True for it) and a pass-through
  ``__torch_dispatch__``.

Everything here is this project's own code; no HyperParallel source is copied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import Any, Literal

import torch
from attrs import define

from flatpool import _torch_compat as tc

Setter = Literal["routed", "rebind"]
DataPtr = Literal["local", "dispatch"]

_SKIP_DISPATCH: ContextVar[bool] = ContextVar("hp_faithful_skip_dispatch", default=False)


class LayoutInferError(RuntimeError):
    """Raised for an op the dispatcher has no rule for (HyperParallel raises RuntimeError)."""


@contextmanager
def skip_dtensor_dispatch() -> Iterator[None]:
    """HyperParallel's ``SkipDTensorDispatch()``: every op runs on the local tensors, unwrapped.

    HyperParallel's own fully_shard tests train inside it. Note that it makes
    ``Tensor.untyped_storage(w)`` and ``Tensor.data_ptr(w)`` answer for the *local* tensor.
    """
    token = _SKIP_DISPATCH.set(True)
    try:
        yield
    finally:
        _SKIP_DISPATCH.reset(token)


# Ops run on the local tensors with the outputs returned as they are (HyperParallel's
# ``OpDispatcher.whitelist``, torch names; the MindSpore-only names are left out).
WHITELIST = frozenset({
    "requires_grad_", "item", "__get__", "__set__", "register_hook", "is_complex", "chunk",
    "__bool__", "__len__", "__format__", "dim", "_has_compatible_shallow_copy_type",
    "is_floating_point", "is_contiguous",
})

# Element-wise ops with a layout rule in HyperParallel's torch yaml
# (torch_element_wise.yaml, torch_element_wise_with_shape.yaml): same layout in and out.
HP_ELEMENTWISE = frozenset({
    "add", "add_", "sub", "sub_", "mul", "div", "relu", "clamp", "clamp_max", "clamp_min",
    "clone", "gelu", "abs", "float", "rsqrt", "sigmoid", "silu", "cos", "sin", "log", "neg",
    "exp", "contiguous", "square", "zeros_like", "empty_like", "pow", "masked_fill",
    "masked_fill_", "ge", "gt", "le", "lt", "__eq__", "__rsub__",
})

# Element-wise ops the double adds so torch's single-tensor SGD/Adam/AdamW run with dispatch
# *on* (HyperParallel's tests train under SkipDTensorDispatch instead).
DOUBLE_ELEMENTWISE = frozenset({
    "mul_", "div_", "addcdiv_", "addcmul_", "lerp_", "sqrt", "conj", "copy_", "zero_",
    "fill_", "__mul__", "__add__", "__sub__", "__truediv__", "__neg__", "__iadd__",
    "__isub__", "__imul__", "__itruediv__", "maximum", "ones_like", "full_like",
})

# View ops: run on the local tensor; the result is re-wrapped as sharded on dim 0.
VIEW_OPS = frozenset({"view", "reshape", "flatten", "narrow", "view_as", "detach"})

RULE_OPS = HP_ELEMENTWISE | DOUBLE_ELEMENTWISE | VIEW_OPS


def op_name(func: Any) -> str:
    """The name the dispatcher keys on (``Tensor.data.__set__`` -> ``"__set__"``)."""
    return str(getattr(func, "__name__", repr(func)))


@define(frozen=True)
class ShardLayout:
    """Where a DTensor's local tensor sits in the global one: dim ``shard_dim`` over ``world``.

    ``global_shape`` is the logical full shape (HyperParallel's layout keeps it through
    ``set_tensor_meta``; uneven dim-0 sharding pads only trailing ranks).
    """

    world: int
    shard_dim: int
    global_shape: tuple[int, ...]

    def derived(self, local_shape: Sequence[int]) -> ShardLayout:
        """The layout of a view of a dim-0 shard: dim 0 still split over ``world``."""
        shape = list(local_shape)
        if shape:
            shape[0] *= self.world
        return ShardLayout(self.world, 0, tuple(shape))


def _to_local(x: Any) -> Any:
    return x._local_tensor if isinstance(x, HPDTensorBase) else x


def _first_dtensor(args: Sequence[Any], kwargs: dict[str, Any]) -> HPDTensorBase | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, HPDTensorBase):
            return a
    return None


class HPDTensorBase(torch.Tensor):
    """The behaviour every generation shares; use :func:`dtensor_class` to get a concrete one."""

    _local_tensor: torch.Tensor
    _layout: ShardLayout
    _is_fake_wrapper: bool = False
    DATA_PTR: DataPtr = "local"

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: ShardLayout) -> HPDTensorBase:  # noqa: D102
        if isinstance(local, HPDTensorBase):
            raise TypeError("wrap a plain local tensor, not a DTensor")
        t = torch.Tensor._make_subclass(cls, local, local.requires_grad)  # shares the storage
        t._local_tensor = local
        t._layout = layout
        return t

    @classmethod
    def from_local(cls, local: torch.Tensor, layout: ShardLayout) -> HPDTensorBase:
        return cls(local, layout)

    # ---- the layout dispatcher -------------------------------------------------------------
    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        name = op_name(func)
        if _SKIP_DISPATCH.get() or name in WHITELIST:
            return func(*[_to_local(a) for a in args], **kwargs)
        if name not in RULE_OPS:
            raise LayoutInferError(f"Operator {name} dose not contain parallel layout infer func.")
        like = _first_dtensor(args, kwargs)
        out = func(*[_to_local(a) for a in args], **{k: _to_local(v) for k, v in kwargs.items()})
        if like is None:
            return out
        if name.endswith("_") and not name.startswith("__") and args and args[0] is like:
            return like  # in place: the local tensor was updated, hand back the wrapper
        if name.startswith("__i") and args and args[0] is like:
            return like
        return _wrap(out, like, view=name in VIEW_OPS)

    # ---- Python-level overrides (answer from the local tensor, or globally) ----------------
    @property
    def grad(self) -> torch.Tensor | None:
        return self._local_tensor.grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        self._local_tensor.grad = value

    @property
    def requires_grad(self) -> bool:
        return self._local_tensor.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self._local_tensor.requires_grad_(value)
        super().requires_grad_(value)  # dispatched: lands on the local tensor again

    def requires_grad_(self, requires_grad: bool = True) -> HPDTensorBase:
        self._local_tensor.requires_grad_(requires_grad)
        super().requires_grad_(requires_grad)
        return self

    @property
    def grad_fn(self) -> Any:  # type: ignore[override]
        return self._local_tensor.grad_fn

    @property
    def is_leaf(self) -> bool:  # type: ignore[override]
        return self._local_tensor.is_leaf

    def detach(self) -> HPDTensorBase:
        return type(self)(self._local_tensor.detach(), self._layout)

    def backward(self, *args: Any, **kwargs: Any) -> None:
        self._local_tensor.backward(*args, **kwargs)  # type: ignore[no-untyped-call]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._local_tensor.device

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self._local_tensor.dtype

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return self._local_tensor.ndim

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        """The *global* shape (the TensorImpl holds the local one)."""
        return torch.Size(self._layout.global_shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_shape(self) -> torch.Size:
        return self._local_tensor.shape

    def to_local(self) -> torch.Tensor:
        return self._local_tensor

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> HPDTensorBase:
        self._local_tensor.copy_(_to_local(src), non_blocking=non_blocking)
        return self

    def zero_(self) -> HPDTensorBase:
        self._local_tensor.zero_()
        return self

    def fill_(self, value: Any) -> HPDTensorBase:
        self._local_tensor.fill_(value)
        return self

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"HPDTensor(local={tuple(self._local_tensor.shape)}, global={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.device})")



def _wrap(out: Any, like: HPDTensorBase, *, view: bool) -> Any:
    if isinstance(out, (tuple, list)):
        return type(out)(_wrap(o, like, view=view) for o in out)
    if not isinstance(out, torch.Tensor) or isinstance(out, HPDTensorBase):
        return out
    layout = like._layout.derived(out.shape) if view else like._layout
    return type(like)(out, layout)


class _DataPtrLocal:
    def data_ptr(self) -> int:
        """HyperParallel's DTensorBase answers with the *local* tensor's address."""
        return int(self._local_tensor.data_ptr())  # type: ignore[attr-defined]


class _RebindData:
    """The newest ``data`` property: rebind wrapper and local under DisableTorchFunctionSubclass."""

    @property
    def data(self) -> torch.Tensor:
        if getattr(self, "_is_fake_wrapper", False):
            return self._local_tensor.data  # type: ignore[no-any-return]
        return torch.Tensor.data.__get__(self, type(self))  # type: ignore[attr-defined, no-any-return]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        local_value = _to_local(value)
        if getattr(self, "_is_fake_wrapper", False):  # storage-less wrapper: swap the local only
            if self.dtype != local_value.dtype:  # type: ignore[attr-defined]
                raise ValueError(f"fake-wrapper data must keep dtype {self.dtype}, "  # type: ignore[attr-defined]
                                 f"got {local_value.dtype}")
            self._local_tensor = local_value
            return
        with tc.no_torch_function():  # HyperParallel: DisableTorchFunctionSubclass()
            torch.Tensor.data.__set__(self, local_value)  # type: ignore[attr-defined]
            torch.Tensor.data.__set__(self._local_tensor, local_value)  # type: ignore[attr-defined]


class _Flatten:
    """``__tensor_flatten__`` (newest): makes ``is_traceable_wrapper_subclass`` answer True."""

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_local_tensor"], self._layout  # type: ignore[attr-defined]

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, torch.Tensor], ctx: Any, size: Any,
                             stride: Any) -> Any:
        return cls(inner["_local_tensor"], ctx)  # type: ignore[call-arg]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        """Aten ops reaching a storage-sharing wrapper run natively on its own storage."""
        kwargs = kwargs or {}
        if any(getattr(a, "_is_fake_wrapper", False) for a in args):
            if not _SKIP_DISPATCH.get():
                raise LayoutInferError(f"Operator {func} dose not contain parallel layout infer func.")
            return func(*[_to_local(a) for a in args], **kwargs)
        with tc.no_torch_function(), tc.no_torch_dispatch():
            result = func(*args, **kwargs)
            return result  # not `return f()`: see flatpool._interrupts

    @classmethod
    def storage_less(cls, local: torch.Tensor, layout: ShardLayout) -> Any:
        """A ``_make_wrapper_subclass`` wrapper on meta, like HyperParallel's FakeTensor wrapper."""
        make: Any = torch.Tensor._make_wrapper_subclass
        t = make(
            cls, local.size(), strides=local.stride(), storage_offset=local.storage_offset(),
            dtype=local.dtype, device=torch.device("meta"), requires_grad=local.requires_grad)
        t._local_tensor = local
        t._layout = layout
        t._is_fake_wrapper = True
        return t


@lru_cache(maxsize=None)
def dtensor_class(setter: Setter = "routed", data_ptr: DataPtr = "local") -> type[HPDTensorBase]:
    """The DTensor class of one HyperParallel generation.

    ``setter="routed"``: the pre-fix generation (data setter routed to the local tensor).
    ``setter="rebind"``: the newest (rebinding setter, ``__tensor_flatten__``, pass-through
    ``__torch_dispatch__``, storage-less fake wrappers). ``data_ptr="local"`` keeps
    HyperParallel's ``data_ptr()`` override (the *local* tensor's address, a lie about the
    wrapper); ``"dispatch"`` drops it, so ``w.data_ptr()`` raises like any op without a rule.
    """
    bases: list[type] = []
    if data_ptr == "local":
        bases.append(_DataPtrLocal)
    if setter == "rebind":
        bases += [_RebindData, _Flatten]
    name = f"HPDTensor_{setter}_{data_ptr}"
    cls = type(name, (*bases, HPDTensorBase),
               {"DATA_PTR": data_ptr, "__module__": __name__, "__qualname__": name})
    globals()[name] = cls  # picklable by name
    return cls


# Named generations, importable by spawned workers (pickling needs module-level names).
HPDTensorRouted: type[HPDTensorBase] = dtensor_class("routed", "local")
HPDTensorRebind: type[HPDTensorBase] = dtensor_class("rebind", "local")


def wrapper_storage_key(t: torch.Tensor) -> int | None:
    """The key of the wrapper's *own* storage (its TensorImpl), or None when it has none."""
    with tc.no_torch_function():
        if tc.impl_is_meta(t):
            return None
        result = tc.storage_address(t)
        return result  # not `return f()`: see flatpool._interrupts


def wrapper_own_values(t: torch.Tensor) -> torch.Tensor:
    """What the wrapper's own TensorImpl reads (a plain copy), bypassing every override."""
    with tc.no_torch_function(), tc.no_torch_dispatch():
        result = torch.Tensor.clone(t).as_subclass(torch.Tensor)
        return result  # not `return f()`: see flatpool._interrupts


def wrapper_local_geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(size, stride, storage_offset) of the wrapper's own TensorImpl."""
    with tc.no_torch_function():
        return (tuple(tc.impl_size(t)), tuple(tc.impl_stride(t)), int(tc.impl_storage_offset(t)))


__all__ = [
    "DOUBLE_ELEMENTWISE", "HPDTensorBase", "HPDTensorRebind", "HPDTensorRouted", "HP_ELEMENTWISE",
    "LayoutInferError", "ShardLayout", "VIEW_OPS", "WHITELIST", "dtensor_class", "op_name",
    "skip_dtensor_dispatch", "wrapper_local_geometry", "wrapper_own_values", "wrapper_storage_key",
]
