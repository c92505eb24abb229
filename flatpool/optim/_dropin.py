"""Make ``optimizer.step()`` and ``zero_grad()`` the flat ones on the instance, and undo it exactly.

``step`` is torch's own hook wrapper around the flat step, so every caller (GradScaler, LR
schedulers, containers) runs it with hooks and profiler as torch does; it keeps the scheduler's
marks (``_wrapped_by_lr_sched``, ``_opt_called``) so its order check holds.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from ._torch import raw_step, with_step_hooks
from ._journal import Journal

StepBody = Callable[[torch.optim.Optimizer, Any], Any]
ZeroBody = Callable[[torch.optim.Optimizer, bool], None]


class DropIn:
    """``step`` and ``zero_grad`` installed on ``opt`` (see module doc)."""

    def __init__(self, opt: torch.optim.Optimizer, step: StepBody, zero_grad: ZeroBody) -> None:
        self.opt = opt
        self.active = False
        self._previous: dict[str, Any] = {name: opt.__dict__[name] for name in ("step", "zero_grad")
                          if name in opt.__dict__}
        scheduled = bool(getattr(opt.step, "_wrapped_by_lr_sched", False))
        active = self

        def flat_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
            if scheduled:
                optimizer._opt_called = True  # type: ignore[attr-defined]
            if not active.active:
                return raw_step(optimizer)(optimizer, closure)
            return step(optimizer, closure)

        def flat_zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            if not active.active:
                type(optimizer).zero_grad(optimizer, set_to_none)
                return
            zero_grad(optimizer, set_to_none)

        hooked = with_step_hooks(flat_step)
        if scheduled:
            hooked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        flat_zero_grad.__doc__ = type(opt).zero_grad.__doc__
        self.step = types.MethodType(hooked, opt)
        self.zero_grad = types.MethodType(flat_zero_grad, opt)

    def install(self, journal: Journal) -> None:
        journal.set_item(self.opt.__dict__, "step", self.step)
        journal.set_item(self.opt.__dict__, "zero_grad", self.zero_grad)
        journal.set_attr(self, "active", True)

    def remove(self) -> None:
        """Give the optimizer its own ``step``/``zero_grad`` back (what was there at install)."""
        self.active = False
        d: dict[str, Any] = self.opt.__dict__
        for name, ours in (("step", self.step), ("zero_grad", self.zero_grad)):
            if d.get(name) is ours:
                del d[name]
                prev = self._previous.get(name)
                if prev is not None:
                    d[name] = prev
