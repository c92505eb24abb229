"""The private torch APIs the flat optimizer reads, each behind one named function.

The flat optimizer follows torch's own decisions (kernel choice, ``step`` dtype) rather than
re-deriving them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.optim.optimizer import Optimizer

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without distributed
    DTensor = None  # type: ignore[assignment,misc]

StepFn = Callable[..., Any]


def raw_step(opt: torch.optim.Optimizer) -> StepFn:
    """``type(opt).step`` without torch's hook wrapper, for a step whose hooks already ran."""
    step = type(opt).step
    if getattr(step, "hooked", False):
        return cast(StepFn, getattr(step, "__wrapped__", step))
    return cast(StepFn, step)


def with_step_hooks(body: StepFn) -> StepFn:
    """``body`` wrapped as torch wraps every optimizer's ``step`` (hooks, profiler record)."""
    return Optimizer.profile_hook_step(body)


def foreach_choice(params: list[torch.Tensor], group: dict[str, Any]) -> bool:
    """Whether torch's kernel runs its foreach form for ``group`` (torch's own resolution)."""
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    if group.get("fused"):
        return False
    from torch.optim.optimizer import _default_to_fused_or_foreach

    _, foreach = _default_to_fused_or_foreach(params, bool(group.get("differentiable")),
                                              use_fused=False)
    return bool(foreach) and not torch.is_tensor(group.get("lr"))


def step_dtype(fused: bool) -> torch.dtype:
    """The dtype torch gives a new ``step`` tensor."""
    from torch.optim.optimizer import _get_scalar_dtype

    return cast(torch.dtype, _get_scalar_dtype(is_fused=fused or None))  # type: ignore[no-untyped-call]


def after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` after the running backward's final callbacks queued so far (FSDP2's)."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(callback)


def is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def dtensor_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor over ``local`` with ``param``'s spec (mesh, placements, global shape)."""
    out: torch.Tensor = DTensor(local, param._spec, requires_grad=False)  # type: ignore[attr-defined,no-untyped-call]
    return out


mesh_of: Callable[[torch.Tensor], Any] = operator.attrgetter("_spec.mesh")
"""A DTensor's mesh, read from its spec (C-level; the ``device_mesh`` property is Python)."""
placements_of: Callable[[torch.Tensor], Any] = operator.attrgetter("_spec.placements")
local_of: Callable[[torch.Tensor], torch.Tensor] = operator.attrgetter("_local_tensor")
"""A wrapper's local tensor (torch DTensor, HyperParallel-style DTensor)."""
