"""Make ``optimizer.step()`` and ``zero_grad()`` the flat ones on the instance, and undo it exactly.

``step`` is torch's own hook wrapper around the flat step, so every caller (GradScaler, LR
schedulers, containers) runs it with hooks and profiler as torch does. What the user installed
stays theirs: a wrapper already on the instance (a step counter, accelerate's patch, an LR
scheduler's mark) stays installed and keeps being called; the closure cell through which it
calls torch's method is pointed at the flat one, and put back by :meth:`DropIn.remove`.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidRequestError
from ._torch import raw_step, with_step_hooks
from ._journal import Journal

StepBody = Callable[[torch.optim.Optimizer, Any], Any]
ZeroBody = Callable[[torch.optim.Optimizer, bool], None]
_NAMES = ("step", "zero_grad")

_active: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[DropIn]] = \
    weakref.WeakKeyDictionary()
"""The installed drop-in of each optimizer (its ``step`` may be a user's wrapper); weak both
ways: a drop-in refers to its optimizer, which must die with its last user reference."""
_flat_functions: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
"""Every drop-in's flat ``step``/``zero_grad`` function (by identity: ``functools.wraps`` copies
a marking attribute onto the user's wrappers)."""


class DropIn:
    """``step`` and ``zero_grad`` installed on ``opt`` (see module doc)."""

    def __init__(self, opt: torch.optim.Optimizer, step: StepBody, zero_grad: ZeroBody) -> None:
        self.opt = opt
        self.active = False
        active = self

        def flat_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
            if not active.active:
                return raw_step(optimizer)(optimizer, closure)
            return step(optimizer, closure)

        def flat_zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            if not active.active:
                type(optimizer).zero_grad(optimizer, set_to_none)
                return
            zero_grad(optimizer, set_to_none)

        hooked = with_step_hooks(flat_step)
        flat_zero_grad.__doc__ = type(opt).zero_grad.__doc__
        self._functions: dict[str, Callable[..., Any]] = {"step": hooked, "zero_grad": flat_zero_grad}
        _flat_functions.update(self._functions.values())
        self.step = types.MethodType(hooked, opt)
        self.zero_grad = types.MethodType(flat_zero_grad, opt)
        self._cells: list[tuple[types.CellType, Any, Any]] = []
        """The user's wrappers' cells to point at the flat methods: cell, its value, the flat one."""
        for name in _NAMES:
            wrapper = opt.__dict__.get(name)
            if wrapper is None:
                continue
            cells = _cells_reaching(wrapper, opt, name)
            if not cells:
                raise InvalidRequestError(
                    f"optimizer.{name} of this {type(opt).__name__} is {wrapper!r}, set on the "
                    f"instance, and it holds no closure over torch's {name} that flatpool could "
                    f"point at the flat {name} (so it would bypass it): set it after "
                    f"FlatOptimizer(...), where it wraps the flat {name}, or remove it")
            flat = {True: getattr(self, name), False: self._functions[name]}
            self._cells += [(c, c.cell_contents, flat[isinstance(c.cell_contents, types.MethodType)])
                            for c in cells]

    @staticmethod
    def of(opt: torch.optim.Optimizer) -> DropIn | None:
        """The drop-in installed on ``opt``, if any."""
        ref = _active.get(opt)
        return None if ref is None else ref()

    def install(self, journal: Journal) -> None:
        d = self.opt.__dict__
        for name in _NAMES:
            if name not in d:
                journal.set_item(d, name, getattr(self, name))
        for cell, _, flat in self._cells:
            journal.set_attr(cell, "cell_contents", flat)
        journal.set_item(_active, self.opt, weakref.ref(self))
        journal.set_attr(self, "active", True)

    def remove(self) -> None:
        """Give the optimizer its own ``step``/``zero_grad`` back (what was there at install)."""
        self.active = False
        if DropIn.of(self.opt) is self:
            del _active[self.opt]
        d: dict[str, Any] = self.opt.__dict__
        for name in _NAMES:
            if d.get(name) is getattr(self, name):
                del d[name]
        for cell, old, flat in self._cells:
            if cell.cell_contents is flat:
                cell.cell_contents = old


def _torchs(value: object, opt: torch.optim.Optimizer, name: str) -> bool:
    """``value`` is how a wrapper calls ``opt``'s own ``name``: torch's function (unbound, as an
    LR scheduler holds it) or bound to ``opt``, or that of a closed drop-in."""
    fn = value
    if isinstance(value, types.MethodType):
        if value.__self__ is not opt:
            return False
        fn = value.__func__
    return fn is getattr(type(opt), name) or (isinstance(fn, types.FunctionType)
                                              and fn in _flat_functions)


def _cells_reaching(wrapper: object, opt: torch.optim.Optimizer, name: str) -> list[types.CellType]:
    """The closure cells, through nested wrapper functions, holding ``opt``'s own ``name``."""
    found: list[types.CellType] = []
    todo, seen = [wrapper], set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet filled
                continue
            if _torchs(value, opt, name):
                found.append(cell)
            elif isinstance(value, types.FunctionType):
                todo.append(value)
    return found
