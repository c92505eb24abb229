"""Give a pooled local view the parameter's own tensor type (a DTensor for a DTensor).

DCP, ``get_optimizer_state_dict`` and FSDP2's gradient accumulation rely on gradients and state
being DTensors like their parameter.
"""

from __future__ import annotations

import torch

from .._aliasing import local_tensor
from ._torch import dtensor_like, is_dtensor
from ._errors import NotPooledError


def wrap_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``param``'s kind of tensor (a DTensor with its spec for a DTensor)."""
    if is_dtensor(param):
        return dtensor_like(param, local)
    if local_tensor(param) is not param:
        if _layout_wrapper(param):
            out: torch.Tensor = type(param).from_local(local, param._layout)  # type: ignore[attr-defined]
            return out
        raise NotPooledError(
            f"{type(param).__name__}: a wrapper flatpool.optim cannot rebuild around a pooled "
            "view (plain tensors, torch DTensors and from_local(local, layout) wrappers are "
            "supported)")
    return local


def _layout_wrapper(param: torch.Tensor) -> bool:
    """A HyperParallel-style DTensor: ``type(p).from_local(local, p._layout)`` rebuilds it."""
    return callable(getattr(type(param), "from_local", None)) and hasattr(param, "_layout")


def supported(param: torch.Tensor) -> str | None:
    """Why ``param``'s type cannot get pooled gradients and state, or ``None``."""
    if is_dtensor(param):
        return None
    if local_tensor(param) is not param and not _layout_wrapper(param):
        return (f"{type(param).__name__} wrapper: only plain tensors, torch DTensors and "
                "from_local(local, layout) wrappers")
    return None
