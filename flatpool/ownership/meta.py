"""Materialize meta tensors and parameters directly into pool slices.

Swapping a meta tensor for a pool-backed one (``torch.utils.swap_tensors``) keeps the Python
object, so the module, the optimizer built later and any wrapper keep their references, and a
following ``reset_parameters()`` initializes in place: no storage besides the pool is ever
allocated. DTensor parameters get a new DTensor around a pool-backed local tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Union, cast

import torch

from ..errors import AdoptionError, InvalidRequestError, InvalidTypeError
from ..slices import Slice
from .faults import checkpoint
from .registry import Binding, Geometry
from .spec import Holder
from .transaction import Transaction

if TYPE_CHECKING:
    from ..pool import FlatPool

MetaTargets = Union[torch.Tensor, Sequence[torch.Tensor]]

_swap = cast(Callable[[torch.Tensor, torch.Tensor], None], torch.utils.swap_tensors)


def _is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(getattr(t, "_local_tensor", None), torch.Tensor) and hasattr(t, "_spec")


def _meta_local(t: torch.Tensor) -> torch.Tensor:
    local = t._local_tensor if _is_dtensor(t) else t  # type: ignore[attr-defined]
    if not isinstance(local, torch.Tensor) or not local.is_meta:
        raise InvalidRequestError(
            f"materialize_into() takes meta tensors; got one on {local.device}: use adopt()"
        )
    return local


def _replacement(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The pool-backed object to swap in for ``t`` (same type, spec, requires_grad)."""
    if _is_dtensor(t):
        from torch.distributed.tensor import DTensor

        make = cast(Callable[..., torch.Tensor], DTensor)
        new = make(local, getattr(t, "_spec"), requires_grad=t.requires_grad)
    else:
        new = local.requires_grad_(t.requires_grad) if t.is_leaf else local
    if isinstance(t, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def materialize_into(
    pool: FlatPool,
    targets: MetaTargets,
    slices: Sequence[Slice] | None = None,
) -> tuple[Slice, ...]:
    """Give meta tensors/parameters (or DTensor params with meta local tensors) pool storage.

    Each target keeps its Python identity; its contents are uninitialized afterwards (like
    ``to_empty``). ``slices`` may name pre-planned slices (one per target, matching shape and
    dtype); otherwise they are allocated. All-or-nothing.
    """
    items = [targets] if isinstance(targets, torch.Tensor) else list(targets)
    for t in items:
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"materialize_into() takes tensors, got {type(t).__name__}")
    if slices is not None and len(slices) != len(items):
        raise InvalidRequestError(f"{len(items)} targets but {len(slices)} slices")
    if len({id(t) for t in items}) != len(items):
        raise InvalidRequestError("a target was given twice")
    locals_ = [_meta_local(t) for t in items]
    with pool.lock:
        txn = Transaction(pool)
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            planned: list[Slice] = []
            for i, local in enumerate(locals_):
                if slices is not None:
                    slc = slices[i]
                    pool.check_live(slc)
                    if slc.shape != tuple(local.shape) or slc.dtype != local.dtype:
                        raise InvalidRequestError(
                            f"target #{i} is {tuple(local.shape)} {local.dtype} but slice "
                            f"{slc.slice_id} is {slc.shape} {slc.dtype}"
                        )
                    if pool.registry.holds(slc):
                        raise InvalidRequestError(f"slice {slc.slice_id} already backs tensors")
                else:
                    checkpoint("allocate")
                    slc = pool.allocate(tuple(local.shape), local.dtype)
                planned.append(slc)
            pool.materialize()
            for t, local, slc in zip(items, locals_, planned):
                checkpoint("rebind")
                view = pool.view_at(slc.offset, slc.shape, slc.dtype, tuple(local.stride()))
                new = _replacement(t, view)
                try:
                    _swap(t, new)
                except RuntimeError as exc:
                    raise AdoptionError(
                        f"cannot swap {type(t).__name__}{tuple(t.shape)} in place: {exc}"
                    ) from exc
                swapped.append((t, new))
            # Bind only once every swap succeeded: a binding's weakref would make the swap
            # back in a rollback fail ("Cannot swap t1 because it has weakref").
            for t, local, slc in zip(items, locals_, planned):
                g = Geometry(0, slc.shape, tuple(local.stride()), slc.dtype)
                if _is_dtensor(t):
                    inner = t._local_tensor  # type: ignore[attr-defined]
                    binding = Binding.make(inner, g, Holder(t, "_local_tensor"), True)
                else:
                    binding = Binding.make(t, g, None, True)
                pool.registry.bind(slc, [binding])
            return tuple(planned)
        except BaseException:
            for t, new in reversed(swapped):
                _swap(t, new)
            txn.rollback()
            raise
