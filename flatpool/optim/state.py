"""Pooled optimizer state: each state kind of a member is a view of one mirror per parameter
pool, and each segment's ``step`` count is one shared scalar slot.

The optimizer's own ``state`` dict stays keyed per parameter, holding those views (DTensors for
DTensor parameters), so ``state_dict()``, ``load_state_dict``, DCP and
``get_optimizer_state_dict`` see what they always see. Adopting state copies whatever the dict
holds now (torch's lazily made tensors, or what ``load_state_dict`` installed) into the pooled
places and rebinds the dict entries; the old tensors die with their last reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..aliasing import local_tensor
from ..pool import FlatPool
from .buffers import Mirrors, member_view, segment_view
from .layout import Member, Segment
from .rules import Rule
from .wrap import wrap_like


def state_refusal(opt: torch.optim.Optimizer, rule: Rule, group: dict[str, Any],
                  members: Sequence[Member]) -> str | None:
    """Why a group's current state cannot be pooled (mixed initialized / not, differing step
    counts, foreign shapes), or ``None``."""
    kinds = rule.kinds(group)
    if not kinds and not rule.has_step:
        return None
    st = [opt.state.get(m.param, {}) for m in members]
    full = [all(k in s for k in kinds) and (not rule.has_step or "step" in s) for s in st]
    if any(full) and not all(full):
        return (f"{sum(full)} of {len(full)} parameters have optimizer state: a flat step needs "
                "all or none initialized")
    if not any(full):
        return None
    for m in members:
        for k in kinds:
            t = opt.state[m.param][k]
            if not isinstance(t, torch.Tensor) or local_tensor(t).shape != m.shape:
                return f"state {k!r} of a {tuple(m.shape)} parameter is not a tensor of its shape"
    if rule.has_step:
        steps = {float(opt.state[m.param]["step"]) for m in members}
        if len(steps) > 1:
            return f"parameters are at different step counts {sorted(steps)[:4]}"
    return None


class StateBuffers:
    """Pooled state of the flat groups' members; made by adopting the current state."""

    def __init__(self, opt: torch.optim.Optimizer, rule: Rule, segments: Sequence[Segment],
                 mirrors: Mirrors) -> None:
        self.opt, self.rule = opt, rule
        self.segments = list(segments)
        self._bufs: dict[tuple[int, str], FlatPool] = {}
        self._steps: dict[int, FlatPool] = {}
        self.slots: list[torch.Tensor | None] = []
        self.fresh: list[bool] = []
        """Per segment: its lazy state (SGD momentum) does not exist yet."""
        self._flat: list[dict[str, torch.Tensor]] = []
        step_slots = self._plan_steps()
        with torch.no_grad():
            for i, seg in enumerate(self.segments):
                group = opt.param_groups[seg.group]
                kinds = rule.kinds(group)
                for k in kinds:
                    key = (id(seg.pool), k)
                    if key not in self._bufs:
                        self._bufs[key] = mirrors.get(seg.pool, k)[0]
                self._flat.append({k: segment_view(self._bufs[(id(seg.pool), k)], seg) for k in kinds})
                self.fresh.append(self._adopt(seg, kinds, step_slots[i]))
                self.slots.append(step_slots[i])

    def _plan_steps(self) -> list[torch.Tensor | None]:
        if not self.rule.has_step:
            return [None] * len(self.segments)
        per_pool: dict[int, list[int]] = {}
        for i, seg in enumerate(self.segments):
            per_pool.setdefault(id(seg.pool), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(self.segments)
        for indices in per_pool.values():
            pool = self.segments[indices[0]].pool
            steps = FlatPool("cpu", alignment=4, name=f"{pool.name}/step")
            slots = steps.allocate_many([((1,), torch.float32)] * len(indices))
            steps.materialize()
            self._steps[id(pool)] = steps
            for i, s in zip(indices, slots):
                out[i] = steps.view_at(s.offset, (), torch.float32)
        return out

    def _adopt(self, seg: Segment, kinds: tuple[str, ...], slot: torch.Tensor | None) -> bool:
        """Copy the members' current state into the pooled places and rebind the dict entries;
        returns True when the (lazy) state does not exist yet."""
        if not kinds and slot is None:
            return False
        states = [self.opt.state[m.param] for m in seg.members]
        have = all(k in st for st in states for k in kinds) and (
            not self.rule.has_step or all("step" in st for st in states))
        fresh = not have
        for k in kinds:
            views = [member_view(self._bufs[(id(seg.pool), k)], m) for m in seg.members]
            if have:
                torch._foreach_copy_(views, [local_tensor(st[k]) for st in states])
            elif not self.rule.lazy(self.opt.param_groups[seg.group]):
                torch._foreach_zero_(views)
            if have or not self.rule.lazy(self.opt.param_groups[seg.group]):
                for m, st, v in zip(seg.members, states, views):
                    st[k] = wrap_like(m.param, v)
        if slot is not None:
            slot.fill_(float(states[0]["step"]) if have else 0.0)
            base = slot.untyped_storage()
            off = slot.storage_offset()
            for st in states:
                st["step"] = torch.empty(0, dtype=torch.float32).set_(base, off, (), ())
        return fresh and self.rule.lazy(self.opt.param_groups[seg.group])

    def flats(self, i: int) -> dict[str, torch.Tensor]:
        return self._flat[i]

    def settle_fresh(self, i: int, made: dict[str, list[torch.Tensor | None]]) -> None:
        """After the first step of a lazy segment: copy what torch made into the pool."""
        seg = self.segments[i]
        with torch.no_grad():
            for k, flat in self._flat[i].items():
                src = made[k][0]
                assert src is not None
                flat.copy_(src)
                buf = self._bufs[(id(seg.pool), k)]
                for m in seg.members:
                    self.opt.state[m.param][k] = wrap_like(m.param, member_view(buf, m))
        self.fresh[i] = False

    def pools(self) -> list[FlatPool]:
        return list(self._bufs.values()) + list(self._steps.values())

    def dissolve(self, group: int) -> None:
        """Give each member of ``group`` a step count of its own (before torch steps it per
        parameter: a shared slot would be counted once per parameter)."""
        for i, seg in enumerate(self.segments):
            if seg.group == group and self.slots[i] is not None:
                for m in seg.members:
                    st = self.opt.state[m.param]
                    if "step" in st:
                        st["step"] = st["step"].clone()


__all__ = ["StateBuffers", "state_refusal"]
