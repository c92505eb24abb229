"""Give a pooled local view the parameter's own tensor type (a DTensor for a DTensor).

Gradients and optimizer state of a DTensor parameter are DTensors with its mesh and placements;
DCP, ``get_optimizer_state_dict`` and FSDP2's gradient accumulation (it adds into
``grad._local_tensor``) rely on it, so the pooled views are wrapped the same way.
"""

from __future__ import annotations

import torch

from ..aliasing import local_tensor
from .errors import NotPooledError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without distributed
    DTensor = None  # type: ignore[assignment,misc]


def wrap_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``param``'s kind of tensor: itself for a plain tensor, a DTensor with
    ``param``'s mesh, placements, global shape and stride for a DTensor."""
    if DTensor is not None and isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.size(), stride=param.stride())
    if local_tensor(param) is not param:
        raise NotPooledError(
            f"{type(param).__name__}: a wrapper flatpool.optim cannot rebuild around a pooled "
            "view (plain tensors and torch DTensors are supported)")
    return local


def supported(param: torch.Tensor) -> str | None:
    """Why ``param``'s type cannot get pooled gradients and state, or ``None``."""
    if DTensor is not None and isinstance(param, DTensor):
        return None
    if local_tensor(param) is not param:
        return f"{type(param).__name__} wrapper: only plain tensors and torch DTensors"
    return None


__all__ = ["supported", "wrap_like"]
