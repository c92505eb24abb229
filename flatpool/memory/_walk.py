"""Name the tensors and pools reachable from a program's live roots.

Any object is walked through its instance attributes (``__dict__``, ``__slots__``), up to
``max_depth`` deep and each object once: that is how framework objects (an FSDP2 param group)
are seen without knowing them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from attrs import define

from .. import FlatPool

ROLES = ("parameter", "grad", "buffer", "optimizer state", "tensor")
LEGIT_OWN_STORAGE = ("grad", "optimizer state")
"""Roles whose tensors have storages of their own by design: never a stale copy of a slice."""


@define(frozen=True)
class Found:
    """A tensor reachable from the roots, by path."""

    name: str
    role: str
    tensor: torch.Tensor


@define(frozen=True)
class Walked:
    tensors: tuple[Found, ...]
    pools: tuple[FlatPool, ...]


_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device,
            torch.Size)


class _Walker:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.found: list[Found] = []
        self.pools: dict[int, FlatPool] = {}
        self.param_names: dict[int, str] = {}
        self.seen: set[int] = set()
        self.optimizers: list[tuple[torch.optim.Optimizer, str]] = []

    def add(self, name: str, role: str, t: torch.Tensor) -> None:
        self.found.append(Found(name, role, t))
        if role == "parameter":
            self.param_names.setdefault(id(t), name)

    def visit(self, obj: Any, prefix: str, depth: int) -> None:
        if isinstance(obj, _SCALARS) or id(obj) in self.seen:
            return
        if isinstance(obj, torch.Tensor):
            self.add(prefix.rstrip(".") or "tensor", "tensor", obj)
            return
        self.seen.add(id(obj))
        if isinstance(obj, FlatPool):
            self.pools.setdefault(id(obj), obj)
        elif isinstance(obj, torch.nn.Module):
            self.module(obj, prefix)
        elif isinstance(obj, torch.optim.Optimizer):
            self.optimizers.append((obj, prefix))  # after modules: names its params by path
        elif isinstance(obj, Mapping):
            for i, (k, v) in enumerate(list(obj.items())):
                self.visit(v, f"{prefix}{_key(k, i)}.", depth)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(list(obj)):
                self.visit(v, f"{prefix}{i}.", depth)
        elif depth < self.max_depth:
            for k, v in _attributes(obj):
                self.visit(v, f"{prefix}{k}.", depth + 1)

    def module(self, m: torch.nn.Module, prefix: str) -> None:
        for n, p in m.named_parameters(remove_duplicate=False):
            self.add(prefix + n, "parameter", p)
            if p.grad is not None:
                self.add(f"{prefix}{n}.grad", "grad", p.grad)
        for n, b in m.named_buffers(remove_duplicate=False):
            self.add(prefix + n, "buffer", b)

    def optimizer(self, opt: torch.optim.Optimizer, prefix: str) -> None:
        names: dict[int, str] = {}
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                known = self.param_names.get(id(p))
                if known is None:
                    known = f"{prefix}param_groups[{g}]['params'][{i}]"
                    self.add(known, "parameter", p)
                names[id(p)] = known
        for key, state in list(opt.state.items()):
            pname = names.get(id(key), "?")
            for k, v in list(state.items()):
                if isinstance(v, torch.Tensor):
                    self.add(f"{prefix}state[{pname}][{k!r}]", "optimizer state", v)


def _key(k: object, index: int) -> str:
    """A mapping key as a path part; objects by type and position, never their repr."""
    if isinstance(k, str):
        return k
    if isinstance(k, (int, float, bool, type(None), torch.dtype, torch.device)):
        return repr(k)
    return f"<{type(k).__name__} #{index}>"


def _attributes(obj: object) -> Iterator[tuple[str, Any]]:
    """Instance attributes only (``__dict__`` and ``__slots__``): no property is evaluated."""
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        yield from list(d.items())
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                yield name, object.__getattribute__(obj, name)
            except AttributeError:
                continue


def walk_roots(roots: object, *, max_depth: int = 6) -> Walked:
    """Every tensor (with its path and role) and every pool reachable from ``roots``."""
    w = _Walker(max_depth)
    items: list[tuple[Any, str]]
    if isinstance(roots, Mapping):
        items = [(v, f"{_key(k, i)}.") for i, (k, v) in enumerate(roots.items())]
    elif isinstance(roots, (list, tuple)):
        modules = sum(isinstance(r, torch.nn.Module) for r in roots)
        optimizers = sum(isinstance(r, torch.optim.Optimizer) for r in roots)
        items = []
        for i, r in enumerate(roots):
            if isinstance(r, torch.nn.Module):
                items.append((r, "" if modules == 1 else f"module{i}."))
            elif isinstance(r, torch.optim.Optimizer):
                items.append((r, "optimizer." if optimizers == 1 else f"optimizer{i}."))
            elif isinstance(r, FlatPool):
                items.append((r, ""))
            else:
                items.append((r, f"root{i}."))
    elif roots is None:
        items = []
    else:
        items = [(roots, "optimizer." if isinstance(roots, torch.optim.Optimizer) else "")]
    # Modules first, so that optimizer state is named by parameter path whatever the order.
    items.sort(key=lambda item: not isinstance(item[0], torch.nn.Module))
    for obj, prefix in items:
        w.visit(obj, prefix, 0)
    for opt, prefix in w.optimizers:
        w.optimizer(opt, prefix)
    return Walked(tuple(w.found), tuple(w.pools.values()))
