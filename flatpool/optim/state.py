"""Pooled optimizer state: each member's state entries are views of its companion pools.

``optimizer.state`` stays what torch reads and writes: keyed per parameter, one dict per
parameter, each entry a tensor of its own (a view of the member's place in
``<pool>/<kind>``, a DTensor for a DTensor parameter; ``step`` a 0-d view of the member's
element of ``<pool>/step``). So ``state_dict()``, ``load_state_dict``, ``deepcopy``,
``torch.save`` and DCP see per-parameter state, and torch's own step (for the parameters the
flat step leaves to it) updates the pooled views in place.

Before every flat step :meth:`State.classify` compares each entry with the view it expects
(identity; C-level passes while all match). An entry torch or the user replaced (a
``load_state_dict``, ``opt.state[p]["exp_avg"] = t``, state torch made on its own step) is
*adopted*: its values are copied into the member's place and the entry rebound to the pooled
view, values first (an interrupt in between leaves the user's tensor, adopted again next
time). A parameter without state gets it as torch would make it at this step
(:meth:`State.make_fresh`). Anything else (a missing key, a tensor of another shape or
dtype) is torch's to handle: the group is stepped by torch's own step.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..aliasing import local_tensor, same_storage
from ._torch import is_dtensor, step_dtype
from .companions import Companions, StepSlots, view
from .layout import Member
from .rules import Rule
from .wrap import wrap_like

Assign = Callable[[dict[Any, Any], str, Any], None]
"""How an entry is rebound (``d[key] = value``; setup journals it)."""


def plain_assign(d: dict[Any, Any], key: str, value: Any) -> None:
    d[key] = value


POOLED, FRESH = "pooled", "fresh"


class State:
    """The pooled state of ``members`` (every member of every group, in plan order)."""

    def __init__(self, opt: torch.optim.Optimizer, rule: Rule, members: Sequence[Member],
                 companions: Companions) -> None:
        self.opt, self.rule = opt, rule
        self.members = list(members)
        self.params = [m.param for m in self.members]
        self.companions = companions
        n = len(self.members)
        self._kinds: dict[str, tuple[list[torch.Tensor | None], list[torch.Tensor | None]]] = {}
        """kind -> (each member's entry, its local tensor); None: not made yet."""
        self.dicts: list[dict[str, Any] | None] = [None] * n
        """Per member: the state dict object last seen with every entry pooled."""
        self.slots: dict[tuple[int, torch.dtype, torch.device], StepSlots] = {}
        self._slot_of: list[tuple[StepSlots, int] | None] = [None] * n

    # -- where --------------------------------------------------------------------------
    def _kind(self, kind: str) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        pair = self._kinds.get(kind)
        if pair is None:  # one store: an interrupt never leaves half of it
            pair = self._kinds[kind] = ([None] * len(self.members), [None] * len(self.members))
        return pair

    def step_slot(self, i: int, group: dict[str, Any]) -> tuple[StepSlots, int]:
        """Member ``i``'s element of its pool's step companion, of the dtype and device torch
        gives this group's step tensors."""
        have = self._slot_of[i]
        m = self.members[i]
        fused = bool(group.get("fused"))
        dtype = step_dtype(fused)
        device = m.pool.device if fused else torch.device("cpu")
        if have is not None and have[0].dtype == dtype and have[0].device == device:
            return have
        if "step" in self._kinds:  # a group that switched fused: new step tensors
            views, locals_ = self._kinds["step"]
            views[i] = locals_[i] = None
        key = (id(m.pool), dtype, device)
        slots = self.slots.get(key)
        if slots is None:
            same = sorted((x for x in self.members if x.pool is m.pool), key=lambda x: x.offset)
            slots = self.slots[key] = StepSlots(m.pool, same, dtype, device)
        got = (slots, slots.index[id(m)])
        self._slot_of[i] = got
        return got

    def view_of(self, i: int, kind: str, group: dict[str, Any]) -> torch.Tensor:
        """Member ``i``'s pooled ``kind`` entry (made on first use)."""
        if kind == "step":
            slots, k = self.step_slot(i, group)
            views, locals_ = self._kind("step")
            v = views[i]
            if v is None:
                views[i] = locals_[i] = v = slots.view(k)
            return v
        views, locals_ = self._kind(kind)
        v = views[i]
        if v is None:
            m = self.members[i]
            local = view(self.companions.get(m.pool, kind), m.offset, m.shape, m.dtype)
            locals_[i] = local
            views[i] = v = wrap_like(m.param, local)
        return v

    def local_of(self, i: int, kind: str, group: dict[str, Any]) -> torch.Tensor:
        view = self.view_of(i, kind, group)
        local = self._kinds[kind][1][i]
        return view if local is None else local

    def keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The entries torch keeps for a parameter of ``group``, in its order."""
        return (("step",) if self.rule.has_step else ()) + self.rule.kinds(group)

    # -- checking ---------------------------------------------------------------------------
    def all_pooled(self, lo: int, hi: int, group: dict[str, Any]) -> bool:
        """Every member of ``[lo, hi)`` has exactly its pooled entries (C-level passes)."""
        keys = self.keys(group)
        if not keys:
            return True
        sts = list(map(self.opt.state.get, self.params[lo:hi]))
        if not all(map(operator.is_, sts, self.dicts[lo:hi])):
            return False
        for k in keys:
            pair = self._kinds.get(k)
            if pair is None:
                return False
            views = pair[0]
            try:
                got = list(map(operator.itemgetter(k), sts))  # type: ignore[arg-type]
            except (KeyError, TypeError):
                return False
            if not all(map(operator.is_, got, views[lo:hi])):
                return False
        return True

    def classify(self, i: int, group: dict[str, Any], adopt: list[tuple[int, str, torch.Tensor]]
                 ) -> str:
        """Member ``i`` (which has a gradient this step): :data:`POOLED` (entries adopted into
        ``adopt`` as needed), :data:`FRESH` (torch makes its state now), or why torch's own step
        must handle it."""
        st = self.opt.state.get(self.params[i])
        if self.rule.fresh(st, group):
            return FRESH
        keys = self.keys(group)
        if not keys:
            return POOLED
        assert st is not None
        found = []
        for k in keys:
            v = st.get(k)
            if v is None:
                return f"its optimizer state has no {k!r} (torch's own step decides what that means)"
            if v is self.view_of(i, k, group):
                continue
            why = self._foreign(i, k, v, group)
            if why is not None:
                return why
            found.append((i, k, v))
        adopt.extend(found)
        if not found:
            self.dicts[i] = st
        return POOLED

    def _foreign(self, i: int, kind: str, v: Any, group: dict[str, Any]) -> str | None:
        """Why entry ``v`` cannot be adopted into member ``i``'s place, or ``None``."""
        m = self.members[i]
        if not isinstance(v, torch.Tensor):
            return f"state {kind!r} is a {type(v).__name__}, not a tensor"
        if kind == "step":
            slots, _ = self.step_slot(i, group)
            if (local_tensor(v) is not v or v.dim() != 0 or v.dtype != slots.dtype
                    or v.device != slots.device or v.requires_grad):
                return (f"state 'step' is a {tuple(v.shape)} {v.dtype} tensor on {v.device}, "
                        f"not torch's 0-d {slots.dtype} on {slots.device}")
            return None
        if is_dtensor(m.param) != is_dtensor(v) or (local_tensor(m.param) is m.param) != (
                local_tensor(v) is v):
            return f"state {kind!r} is a {type(v).__name__}, the parameter a {type(m.param).__name__}"
        local = local_tensor(v)
        if (local.layout != torch.strided or local.shape != m.shape or local.dtype != m.dtype
                or local.device != m.pool.device or v.requires_grad):
            return (f"state {kind!r} ({tuple(local.shape)}, {local.dtype}, {local.device}) is not "
                    f"shaped like its parameter ({tuple(m.shape)}, {m.dtype})")
        return None

    # -- changing ---------------------------------------------------------------------------
    def adopt(self, items: Sequence[tuple[int, str, torch.Tensor]], group_of: Callable[[int], dict[str, Any]],
              assign: Assign = plain_assign) -> None:
        """Copy each foreign entry into its member's place, then rebind the entry."""
        if not items:
            return
        dst = [self.local_of(i, k, group_of(i)) for i, k, _ in items]
        src = [local_tensor(v) for _, _, v in items]
        with torch.no_grad():  # a view of the same companion at another place: copied first
            torch._foreach_copy_(dst, [s.clone() if same_storage(s, d) else s
                                       for d, s in zip(dst, src)])
        del dst, src
        done: set[int] = set()
        for i, k, _ in items:
            st = self.opt.state[self.params[i]]
            assign(st, k, self.view_of(i, k, group_of(i)))
            done.add(i)
        for i in done:
            self.dicts[i] = self.opt.state[self.params[i]]

    def make_fresh(self, indices: Sequence[int], group: dict[str, Any]) -> None:
        """Adam's state as torch makes it at a parameter's first step (step 0, zeros), in the
        members' places; each member's entries appear at once (one ``dict.update``)."""
        keys = self.keys(group)
        with torch.no_grad():
            for k in keys:
                locals_ = [self.local_of(i, k, group) for i in indices]
                torch._foreach_zero_(locals_)
        state = self.opt.state
        for i in indices:
            entries = {k: self.view_of(i, k, group) for k in keys}
            st = state[self.params[i]]  # torch: ``state = self.state[p]``
            st.update(entries)
            self.dicts[i] = st

    def install_made(self, indices: Sequence[int], kind: str, group: dict[str, Any]) -> None:
        """After a kernel made ``kind`` (its values already copied into the places)."""
        state = self.opt.state
        for i in indices:
            st = state[self.params[i]]
            st[kind] = self.view_of(i, kind, group)
            self.dicts[i] = st

    def pools(self) -> list[Any]:
        return self.companions.pools() + [s.pool for s in self.slots.values()]


__all__ = ["FRESH", "POOLED", "State", "plain_assign"]
