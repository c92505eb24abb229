"""The flat rule of each supported optimizer: its state kinds and one call of torch's own
functional kernel over lists of tensors (one flat tensor each for a flat step).

Only elementwise optimizers have a rule: their step over a concatenation equals the
concatenation of their steps, so torch's foreach kernel over one flat tensor computes, element
for element, what it computes over the parameters one by one (measured bit-identical; the
tests hold it to ``torch.equal``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim.adam import adam as _adam
from torch.optim.adamw import adamw as _adamw
from torch.optim.sgd import sgd as _sgd

from .errors import UnsupportedOptimizerError


class Rule(Protocol):
    """What a flat step needs to know about one optimizer class."""

    has_step: bool
    """The state has a per-parameter ``step`` count (shared by a segment once pooled)."""

    def kinds(self, group: dict[str, Any]) -> tuple[str, ...]:
        """State tensors shaped like the parameter, for this param group."""
        ...

    def lazy(self, group: dict[str, Any]) -> bool:
        """True when the state is made by the first step from the gradient (SGD momentum)
        rather than zeros: the flat step then lets torch make it and copies it in."""
        ...

    def run(self, opt: torch.optim.Optimizer, group: dict[str, Any], params: list[Tensor],
            grads: list[Tensor], state: dict[str, list[Tensor | None]], steps: list[Tensor],
            fused: bool) -> None:
        """One step of ``group``'s math over these lists (torch's functional kernels)."""
        ...


_ADAM_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(_adam).parameters


class AdamRule:
    has_step = True

    def kinds(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else (
            "exp_avg", "exp_avg_sq")

    def lazy(self, group: dict[str, Any]) -> bool:
        return False

    def run(self, opt: torch.optim.Optimizer, group: dict[str, Any], params: list[Tensor],
            grads: list[Tensor], state: dict[str, list[Tensor | None]], steps: list[Tensor],
            fused: bool) -> None:
        beta1, beta2 = group["betas"]
        kw: dict[str, Any] = dict(
            foreach=not fused, fused=fused, capturable=False, differentiable=False,
            grad_scale=getattr(opt, "grad_scale", None), found_inf=getattr(opt, "found_inf", None),
            has_complex=False, amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"])
        fn: Callable[..., None] = _adam
        if "decoupled_weight_decay" in group and _ADAM_HAS_DECOUPLED:
            kw["decoupled_weight_decay"] = group["decoupled_weight_decay"]
        elif isinstance(opt, torch.optim.AdamW):  # torch releases with a separate AdamW kernel
            fn = _adamw
        fn(params, grads, _full(state["exp_avg"]), _full(state["exp_avg_sq"]),
           _full(state.get("max_exp_avg_sq", [])), steps, **kw)


class SGDRule:
    has_step = False

    def kinds(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def lazy(self, group: dict[str, Any]) -> bool:
        return True

    def run(self, opt: torch.optim.Optimizer, group: dict[str, Any], params: list[Tensor],
            grads: list[Tensor], state: dict[str, list[Tensor | None]], steps: list[Tensor],
            fused: bool) -> None:
        bufs = state.get("momentum_buffer", [None] * len(params))
        _sgd(
            params, grads, bufs, has_sparse_grad=False, foreach=not fused, fused=fused,
            grad_scale=getattr(opt, "grad_scale", None), found_inf=getattr(opt, "found_inf", None),
            weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
        if "momentum_buffer" in state:
            state["momentum_buffer"] = bufs  # torch made the buffers of a first step here


def _full(xs: Sequence[Tensor | None]) -> list[Tensor]:
    out = [x for x in xs if x is not None]
    if len(out) != len(xs):
        raise AssertionError("state list with holes")
    return out


_RULES: dict[type[torch.optim.Optimizer], Rule] = {
    torch.optim.Adam: AdamRule(), torch.optim.AdamW: AdamRule(), torch.optim.SGD: SGDRule(),
}


def rule_for(opt: torch.optim.Optimizer) -> Rule:
    """The rule of ``opt``'s exact class; a subclass may change the math, so it is refused."""
    rule = _RULES.get(type(opt))
    if rule is None:
        raise UnsupportedOptimizerError(
            f"{type(opt).__name__}: no flat rule (flatpool steps torch.optim.Adam, AdamW and SGD "
            "flat, whose math is elementwise and matches torch's foreach kernel bit for bit). "
            "Step this optimizer per parameter with optimizer.step()")
    return rule


def group_refusal(group: dict[str, Any]) -> str | None:
    """Why a param group's options make a flat step other than its step, or ``None``."""
    for key in ("capturable", "differentiable"):
        if group.get(key):
            return f"{key}=True: the flat step runs the non-capturable, non-differentiable kernel"
    if torch.is_tensor(group.get("lr")):
        return "a tensor lr: the foreach kernel takes it only when capturable"
    return None


__all__ = ["AdamRule", "Rule", "SGDRule", "group_refusal", "rule_for"]
