"""Reading a group member from its TensorImpls, past every Python override.

HyperParallel's DTensor answers ``shape`` with the global shape and raises for ops without a
layout rule unless ``__torch_function__`` is off, so every read goes through here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from flatpool import InvalidRequestError, InvalidTypeError, own_storage
from flatpool import _torch_compat as tc

from ._protocol import ShardedParam


def data_of(p: ShardedParam, index: int) -> torch.Tensor:
    """The member's ``_sharded_param_data``, checked to be a tensor."""
    data = getattr(p, "_sharded_param_data", None)
    if not isinstance(data, torch.Tensor):
        raise InvalidTypeError(
            f"member {index} ({type(p).__name__}) has no _sharded_param_data tensor (found "
            f"{type(data).__name__}): pass the group's sharded parameters (FSDPParam, "
            "TorchHSDPParamV2)")
    return data


def data_all(params: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """:func:`data_of` of every member."""
    return [data_of(p, i) for i, p in enumerate(params)]


PLAIN = frozenset({torch.Tensor, nn.Parameter})
"""Parameter types that are their own local tensor (no ``_local_tensor`` to look up)."""


def local_of(wrapper: torch.Tensor) -> torch.Tensor:
    """The DTensor's ``_local_tensor``, or the parameter itself when it is a plain tensor."""
    if type(wrapper) in PLAIN:
        return wrapper
    local = getattr(wrapper, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else wrapper


_T = TypeVar("_T")


def _read(read: Callable[[torch.Tensor], _T], t: torch.Tensor) -> _T:
    with tc.no_torch_function():
        result = read(t)
        return result  # not `return f()`: see flatpool._interrupts


def is_meta(t: torch.Tensor) -> bool:
    return _read(tc.impl_is_meta, t)


def impl_size(t: torch.Tensor) -> torch.Size:
    """The TensorImpl's (local) size, not a subclass's global ``shape``."""
    return _read(tc.impl_size, t)


def impl_dtype(t: torch.Tensor) -> torch.dtype:
    return _read(tc.impl_dtype, t)


def impl_device(t: torch.Tensor) -> torch.device:
    return _read(tc.impl_device, t)


def impl_requires_grad(t: torch.Tensor) -> bool:
    return _read(tc.impl_requires_grad, t)


def padded_size(p: ShardedParam, index: int) -> torch.Size:
    """``padded_sharded_param_size``, or ``sharded_size`` where its data shows even sharding."""
    padded = getattr(p, "padded_sharded_param_size", None)
    if padded is not None:  # a Size is immutable: the member's own is shared, not copied
        return padded if type(padded) is torch.Size else torch.Size(padded)
    sharded = torch.Size(p.sharded_size)
    numel = math.prod(impl_size(data_of(p, index)))
    if numel != math.prod(sharded):
        raise InvalidRequestError(
            f"member {index} ({type(p).__name__}) has no padded_sharded_param_size and its "
            f"_sharded_param_data holds {numel} elements, not the {math.prod(sharded)} of its "
            f"sharded_size {tuple(sharded)}: the shard is padded (uneven sharding), so the "
            "member must say its padded shape; set padded_sharded_param_size on it")
    return sharded


def member_name(p: ShardedParam, index: int) -> str:
    """How messages name member ``index`` (FSDP2's ``_param_fqn`` where kept)."""
    fqn = getattr(p, "_param_fqn", None)
    return f"{fqn} (member {index})" if isinstance(fqn, str) and fqn else f"member {index}"


def shard_dim(p: ShardedParam) -> int:
    """The dimension the parameter is sharded on (``Shard(dim)``; 0 when not said)."""
    placement: Any = getattr(p, "fsdp_placement", None) or getattr(p, "hsdp_placement", None)
    return int(getattr(placement, "dim", 0))


def has_memory(wrapper: torch.Tensor) -> bool:
    """Does a parameter wrapper need memory of its own, which must then be its slice?

    HyperParallel's DTensor shares its local's storage (or is a meta wrapper adoption places);
    torch's DTensor has only a placeholder storage, so only its local tensor matters.
    """
    if is_meta(wrapper):
        return True
    return own_storage(wrapper) is not None


__all__ = [
    "PLAIN", "data_all", "data_of", "has_memory", "impl_device", "impl_dtype", "impl_requires_grad", "impl_size",
    "is_meta", "local_of", "member_name", "padded_size", "shard_dim",
]
