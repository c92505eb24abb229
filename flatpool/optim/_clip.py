"""``clip_grad_norm_`` as torch computes it, with pooled gradients scaled once per run.

For DTensor gradients on one mesh the norm is one DTensor operation over stacked local norms:
DTensor's sharding propagation of a list op grows with the square of its length.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Any, cast

import torch

from .._aliasing import local_tensor
from ._torch import is_dtensor, local_of, mesh_of, placements_of


_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")


def _locals(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors' local tensors (one C-level pass when all are wrappers)."""
    try:
        return list(map(local_of, tensors))
    except AttributeError:
        return [local_tensor(t) for t in tensors]


def _grouped(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` by (device, dtype), in order of first appearance, as torch groups them."""
    dtypes, devices = set(map(_dtype_of, tensors)), set(map(_device_of, tensors))
    if len(dtypes) == 1 and len(devices) == 1:
        return [tensors] if tensors else []
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _one_spec(grads: Sequence[torch.Tensor]) -> bool:
    """Every gradient a torch DTensor of one mesh object with equal placements."""
    if not grads or not is_dtensor(grads[0]):
        return False
    first: Any = grads[0]
    if not all(map(operator.is_, map(type, grads), repeat(type(first)))):
        return False
    if not all(map(operator.is_, map(mesh_of, grads), repeat(mesh_of(first)))):
        return False
    return all(map(operator.eq, map(placements_of, grads), repeat(placements_of(first))))


def total_norm(grads: Sequence[torch.Tensor], norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm(grads, ..., foreach=True)``, bit for bit."""
    if not _one_spec(grads):
        return torch.nn.utils.get_total_norm(
            [g if is_dtensor(g) else local_tensor(g) for g in grads], norm_type,
            error_if_nonfinite, foreach=True)
    from torch.distributed.tensor import DTensor

    first: Any = grads[0]
    norms: list[torch.Tensor] = []
    for group in _grouped(_locals(grads)):
        norms.extend(torch._foreach_norm(group, norm_type))
    placements = torch._foreach_norm([first], norm_type)[0].placements  # type: ignore[attr-defined]
    stacked = DTensor.from_local(torch.stack(norms), first.device_mesh, placements, run_check=False)
    total: torch.Tensor = torch.linalg.vector_norm(stacked, norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


def coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """torch's clipping coefficient, as a plain tensor (a DTensor's value is replicated)."""
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    full = getattr(coef, "full_tensor", None)
    return cast(torch.Tensor, full() if callable(full) else coef)


def scale(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply each (local) tensor by ``coef``, one foreach call per device and dtype."""
    for group in _grouped(_locals(tensors)):
        torch._foreach_mul_(group, coef.to(group[0].device))
