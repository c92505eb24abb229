"""The flat rule of each supported optimizer: its state, and one call of torch's functional kernel.

Only elementwise optimizers have one: their step over a concatenation is the concatenation of
their steps (the tests hold it to ``torch.equal``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

from ._errors import UnsupportedOptimizerError

try:  # torch releases before AdamW became Adam(decoupled_weight_decay=True)
    from torch.optim.adamw import adamw as _adamw
except ImportError:  # pragma: no cover
    _adamw = None  # type: ignore[assignment]

State = dict[str, list[Tensor | None]]


class Rule(Protocol):
    """What a flat step needs to know about one optimizer class."""

    name: str
    """The kernel family (``"adam"`` for Adam and AdamW, ``"sgd"``): :data:`FUSED_EXACT`'s key."""

    has_step: bool
    """The state has a per-parameter ``step`` count."""

    made_by_kernel: bool
    """New state is made by the kernel (SGD's momentum), not as zeros before it (Adam)."""

    def kinds(self, group: dict[str, Any]) -> tuple[str, ...]:
        """State tensors shaped like the parameter, for this param group, in torch's order."""
        ...

    def fresh(self, state: dict[str, Any] | None, group: dict[str, Any]) -> bool:
        """torch makes this parameter's state at its next step."""
        ...

    def arguments(self, group: dict[str, Any]) -> tuple[Any, ...]:
        """The group options :meth:`run` passes to the kernel (equal ones share a call)."""
        ...

    def run(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
            state: State, steps: list[Tensor], *, foreach: bool, fused: bool,
            grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """One step of torch's functional kernel; a ``None`` state entry is made by it."""
        ...

    def writes_grads(self, group: dict[str, Any], *, foreach: bool, fused: bool) -> bool:
        """torch's kernel writes into the gradients it is given (so a ``.grad`` copied into the
        pool for the step must get the result back, as torch's own step would leave it)."""
        ...


_ADAM_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(_adam).parameters


class AdamRule:
    name = "adam"
    has_step = True
    made_by_kernel = False

    def __init__(self, adamw: bool) -> None:
        self.adamw = adamw

    def kinds(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else (
            "exp_avg", "exp_avg_sq")

    def fresh(self, state: dict[str, Any] | None, group: dict[str, Any]) -> bool:
        return not state  # torch: ``if len(state) == 0`` makes step, exp_avg, exp_avg_sq

    def arguments(self, group: dict[str, Any]) -> tuple[Any, ...]:
        return (tuple(group["betas"]), group["lr"], group["weight_decay"], group["eps"],
                group["amsgrad"], group["maximize"], group.get("decoupled_weight_decay"))

    def run(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
            state: State, steps: list[Tensor], *, foreach: bool, fused: bool,
            grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        kw: dict[str, Any] = dict(
            foreach=foreach and not fused, fused=fused, capturable=False, differentiable=False,
            grad_scale=grad_scale, found_inf=found_inf, has_complex=False,
            amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        fn: Callable[..., None] = _adam
        if "decoupled_weight_decay" in group and _ADAM_HAS_DECOUPLED:
            kw["decoupled_weight_decay"] = group["decoupled_weight_decay"]
        elif self.adamw and _adamw is not None:
            fn = _adamw
        fn(params, grads, _full(state["exp_avg"]), _full(state["exp_avg_sq"]),
           _full(state.get("max_exp_avg_sq", [])), steps, **kw)

    def writes_grads(self, group: dict[str, Any], *, foreach: bool, fused: bool) -> bool:
        return False  # torch's Adam writes only into copies of the gradients it is given


class SGDRule:
    name = "sgd"
    has_step = False
    made_by_kernel = True

    def kinds(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def fresh(self, state: dict[str, Any] | None, group: dict[str, Any]) -> bool:
        return group["momentum"] != 0 and (not state or state.get("momentum_buffer") is None)

    def arguments(self, group: dict[str, Any]) -> tuple[Any, ...]:
        return (group["lr"], group["momentum"], group["dampening"], group["weight_decay"],
                group["nesterov"], group["maximize"])

    def run(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
            state: State, steps: list[Tensor], *, foreach: bool, fused: bool,
            grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        bufs = state.get("momentum_buffer", [])
        _sgd(params, grads, bufs, has_sparse_grad=False, foreach=foreach and not fused,
             fused=fused, grad_scale=grad_scale, found_inf=found_inf,
             weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
             dampening=group["dampening"], nesterov=group["nesterov"],
             maximize=group["maximize"])
        if "momentum_buffer" in state:
            state["momentum_buffer"] = bufs  # the buffers torch made for a first step

    def writes_grads(self, group: dict[str, Any], *, foreach: bool, fused: bool) -> bool:
        # torch's foreach SGD adds the momentum into the gradients themselves for nesterov,
        # unless maximize or weight decay made it work on copies first
        return (foreach and not fused and group["momentum"] != 0 and bool(group["nesterov"])
                and not group["maximize"] and group["weight_decay"] == 0)


def _full(xs: Sequence[Tensor | None]) -> list[Tensor]:
    out = [x for x in xs if x is not None]
    if len(out) != len(xs):
        raise AssertionError("state list with holes")
    return out


_RULES: dict[type[torch.optim.Optimizer], Rule] = {
    torch.optim.Adam: AdamRule(adamw=False), torch.optim.AdamW: AdamRule(adamw=True),
    torch.optim.SGD: SGDRule(),
}


def rule_for(opt: torch.optim.Optimizer) -> Rule:
    """The rule of ``opt``'s exact class; a subclass may change the math, so it is refused."""
    rule = _RULES.get(type(opt))
    if rule is None:
        raise UnsupportedOptimizerError(
            f"{type(opt).__name__}: no flat rule (flatpool steps torch.optim.Adam, AdamW and SGD "
            "flat, whose math is elementwise and matches torch's kernel bit for bit). "
            "Step this optimizer per parameter with optimizer.step()")
    return rule


FUSED_EXACT: dict[tuple[str, str], tuple[torch.dtype, ...]] = {
    ("cpu", "adam"): (torch.bfloat16, torch.float16),
    ("cpu", "sgd"): (torch.float32, torch.float64),
}
"""``(device type, kernel family)``: the dtypes whose fused step over one flat tensor was measured
``torch.equal`` to torch's fused step per parameter (torch 2.13; SGD without momentum only). The
fused CPU kernel rounds differently in its vectorized body and its scalar tail, so elsewhere an
element's result depends on where its tensor starts (docs/optim.md; CUDA: scripts/device_steps.py)."""


def fused_exact(rule: Rule, group: dict[str, Any], dtype: torch.dtype, device: str) -> bool:
    """A flat fused step of ``group``'s ``dtype`` members is bit-identical to torch's own."""
    if dtype not in FUSED_EXACT.get((device, rule.name), ()):
        return False
    return rule.name != "sgd" or group["momentum"] == 0


def group_refusal(group: dict[str, Any]) -> str | None:
    """Why a param group's options make a flat step differ from torch's, or ``None``."""
    for key in ("capturable", "differentiable"):
        if group.get(key):
            return f"{key}=True: the flat step runs the non-capturable, non-differentiable kernel"
    for key in ("lr", "betas", "momentum", "weight_decay"):
        value = group.get(key)
        if torch.is_tensor(value) or (isinstance(value, tuple) and any(map(torch.is_tensor, value))):
            return f"a tensor {key}: torch's kernels take it only in their capturable form"
    return None
