"""One optimizer step, decided by torch's own state, group by group.

Each group is stepped flat in runs of adjacent pooled members, and by torch's own step for the
rest; a whole group goes to torch when its options, a gradient or its state are torch's to
handle, so torch raises or handles it exactly as without flatpool. Nothing is stepped until
every group is prepared.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from itertools import compress
from typing import Any

import torch
from attrs import define
from torch.autograd.graph import increment_version

from .._aliasing import local_tensor
from .._interrupts import signals_guarded
from ._torch import foreach_choice, raw_step
from ._companions import Companions, StepSlots
from ._grads import Grads
from ._layout import Segment
from ._plan import GroupPlan, Plan
from ._rules import Rule, fused_exact
from ._state import FRESH, POOLED, State

Say = Callable[[int, str], None]


@define
class Run:
    """A run of adjacent members of one segment, stepped with one kernel call."""

    seg: Segment
    members: list[int]
    start: int
    end: int
    fresh: bool
    step: float
    slots: StepSlots | None
    slot: int


@define
class GroupWork:
    g: int
    torch_group: dict[str, Any] | None
    """What torch's own step runs first: the group itself, a sub-group, or nothing."""
    runs: list[Run]
    why: str = ""
    """Why torch's own step runs ``torch_group`` (said once, when it steps a gradient)."""


class Stepper:
    """The step over one plan (made again with every plan)."""

    def __init__(self, opt: torch.optim.Optimizer, rule: Rule, plan: Plan, grads: Grads,
                 state: State, companions: Companions, fused_policy: str, say: Say) -> None:
        self.opt, self.rule, self.plan = opt, rule, plan
        self.grads, self.state, self.companions = grads, state, companions
        self.fused_policy, self.say = fused_policy, say
        index = {id(m): i for i, m in enumerate(plan.members)}
        self.segments: dict[int, list[tuple[Segment, list[int]]]] = {}
        for seg in plan.segments:
            self.segments.setdefault(seg.group, []).append((seg, [index[id(m)] for m in seg.members]))
        self._choice: dict[int, bool] = {}
        self._flat: dict[tuple[int, str], torch.Tensor] = {}
        """A segment's range of a state companion."""
        self._param_bufs: dict[int, torch.Tensor] = {}
        """The parameter pools' byte buffers, during one step."""
        self._written_of: dict[tuple[tuple[int, int, int], ...],
                               tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        """:meth:`_written`'s parameters and wrappers, per run pattern."""
        self.why = {g: why for g, gp in enumerate(plan.groups) if (why := self._why(g, gp))}
        """Why (part of) each group is planned for torch's own step."""

    def _why(self, g: int, gp: GroupPlan) -> str | None:
        if gp.refusal is not None:
            return gp.refusal
        if gp.others:
            i, why = next(iter(gp.others.items()))
            return (f"{len(gp.others)} of its parameters, e.g. params[{i}] "
                    f"{tuple(gp.params[i].shape)}: {why}")
        seg = next((seg for seg, _ in self.segments.get(g, []) if not self.flat(seg, gp.group)),
                   None)
        if seg is None:
            return None
        if gp.group.get("fused") and self.fused_policy == "exact":
            return (f"fused=True over its {seg.dtype} members: a flat fused {seg.dtype} step on "
                    f"{seg.pool.device.type} is not shown bit-identical to torch's fused step per "
                    "parameter (docs/optim.md), so torch's own fused step runs them over their "
                    "pooled state")
        return (f"its {seg.dtype} members: a flat {seg.dtype} step is not bit-identical to the "
                "per-parameter one (torch's vectorized and scalar paths round differently), so "
                "torch's own step runs them over their pooled state")

    def flat(self, seg: Segment, group: dict[str, Any]) -> bool:
        """One kernel call may step ``seg`` whole and equal torch's step of its members."""
        if group.get("fused") and self.fused_policy == "exact":
            return fused_exact(self.rule, group, seg.dtype, seg.pool.device.type)
        return seg.flat

    def foreach(self, g: int, gp: GroupPlan) -> bool:
        if g not in self._choice:
            self._choice[g] = foreach_choice(gp.params, gp.group)
        return self._choice[g]

    # -- deciding ---------------------------------------------------------------------------
    def prepare(self) -> list[GroupWork]:
        opt = self.opt
        scaled = getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None
        self.state.begin()
        groups = self.plan.groups
        pooled, read = self.grads.read(0, len(self.plan.members))  # one pass for all groups
        self._copy_in: list[int] = []
        self._copy_src: list[torch.Tensor] = []
        self._back: dict[int, torch.Tensor] = {}
        """Copied-in gradients the kernel writes into: given the result back after it."""
        states = self.state.pooled_groups([(gp.lo, gp.hi, gp.group) for gp in groups])
        works = []
        try:
            for g, gp in enumerate(groups):
                group = gp.group
                work: GroupWork | str | None = gp.refusal
                if work is None and scaled and not self._fused(group):
                    work = ("a GradScaler's grad_scale/found_inf for a fused optimizer: torch's "
                            "fused step reads them")
                if work is None:
                    work = self._group(g, gp, pooled[gp.lo:gp.hi], read, states[g])
                if isinstance(work, str):
                    work = GroupWork(g, group, [], work)
                works.append(work)
            self.grads.absorb(self._copy_in, self._copy_src)  # the foreign gradients: one copy
        except BaseException:
            self._back = {}  # nothing will be stepped: hold none of the user's gradients
            raise
        finally:
            self._copy_src = []  # the user's gradients: never held past the step
            del read
        return works

    def _fused(self, group: dict[str, Any]) -> bool:
        return bool(group.get("fused")) and self.fused_policy != "foreach"

    def _group(self, g: int, gp: GroupPlan, on: list[bool], read: list[torch.Tensor | None],
               state_pooled: bool) -> GroupWork | str:
        """``on``: per member, its gradient is pooled; ``read``: every member's ``.grad`` (plan
        order); ``state_pooled``: all state is."""
        group, lo, hi = gp.group, gp.lo, gp.hi
        members = self.plan.members
        everyone = all(on)
        absorb: list[int] = []
        src: list[torch.Tensor] = []
        if not everyone:
            if any(on):
                at = list(compress(range(lo, hi), map(operator.not_, on)))
                got = self.grads.foreign(lo, at, list(map(read.__getitem__, at)))
            else:  # (every gradient foreign, or none)
                got = self.grads.foreign(lo, list(range(lo, hi)), read[lo:hi])
            if isinstance(got, str):
                return got
            absorb, src = got
            if len(absorb) == len(on):
                on[:] = [True] * len(on)
            else:
                for i in absorb:
                    on[i - lo] = True
        for i in gp.others:
            grad = gp.params[i].grad
            if grad is not None and grad.layout != torch.strided:
                return f"a {grad.layout} gradient"
        self._copy_in += absorb
        self._copy_src += src
        if absorb and self.rule.writes_grads(group, foreach=self.foreach(g, gp),
                                             fused=self._fused(group)):
            self._back.update(zip(absorb, src))
        fresh: set[int] = set()
        if (everyone or any(on)) and not state_pooled:
            adopt: list[tuple[int, str, torch.Tensor]] = []
            for i in compress(range(lo, hi), on):
                status = self.state.classify(i, group, adopt)
                if status == FRESH:
                    fresh.add(i)
                elif status != POOLED:
                    return status
            why = self.state.shared(adopt, (p.storage_key for p in self.grads.pools()))
            if why is not None:
                return why
            self.state.adopt(adopt)
        torch_params = [gp.params[i] for i in gp.others]
        runs: list[Run] = []
        everyone = all(on)
        for seg, idx in self.segments.get(g, []):
            if self.flat(seg, group):
                runs += self._runs(seg, idx, on, lo, fresh, everyone)
            else:
                torch_params += [members[i].param for i in idx if on[i - lo]]
        return GroupWork(g, dict(group, params=torch_params) if torch_params else None, runs,
                         self.why.get(g, ""))

    def _runs(self, seg: Segment, idx: list[int], on: list[bool], lo: int, fresh: set[int],
              everyone: bool) -> list[Run]:
        """Split a segment into runs of active members with one state status and one step."""
        slots: StepSlots | None = None
        first = 0
        steps = [0.0] * len(idx)
        if self.rule.has_step:
            slots, first = self.state.step_slot(idx[0])
            span = slots.span(first, first + len(idx))
            if everyone and not fresh and len(idx) > 256:  # the steady step: no list a member
                if torch.equal(span[1:], span[:-1]):  # (one comparison kernel, no fill)
                    return [self._run(seg, idx, 0, len(idx), False, span[0].item(), slots,
                                      first)]
            steps = span.tolist()
        elif everyone and not fresh:
            return [self._run(seg, idx, 0, len(idx), False, 0.0, slots, first)]
        flags = [on[i - lo] for i in idx]
        out: list[Run] = []
        a = None
        key: tuple[bool, float] | None = None
        for k, i in enumerate(idx + [-1]):
            this = None if k == len(idx) or not flags[k] else (
                (True, 0.0) if i in fresh else (False, steps[k]))
            if a is not None and this != key:
                assert key is not None
                out.append(self._run(seg, idx, a, k, key[0], key[1], slots, first))
                a = None
            if this is not None and a is None:
                a, key = k, this
        return out

    @staticmethod
    def _run(seg: Segment, idx: list[int], a: int, b: int, fresh: bool, step: float,
             slots: StepSlots | None, first: int) -> Run:
        return Run(seg, idx[a:b], seg.members[a].offset, seg.members[b - 1].end, fresh, step,
                   slots, first + a)

    # -- stepping ---------------------------------------------------------------------------
    def run(self, works: list[GroupWork]) -> None:
        """Step every group in order, torch's part first; equal kernel arguments share a call."""
        batches: dict[tuple[Any, ...], list[tuple[dict[str, Any], Run]]] = {}
        known = len(self.opt.state)
        try:
            for w in works:
                if w.torch_group is not None:
                    self._flush(batches)
                    if any(p.grad is not None for p in w.torch_group["params"]):
                        self.say(w.g, w.why)  # what this step does, when it does it
                    self.torch_step(w.torch_group)
                if w.runs:
                    gp = self.plan.groups[w.g]
                    key = (self.foreach(w.g, gp), self._fused(gp.group),
                           self.rule.arguments(gp.group))
                    for r in w.runs:
                        batches.setdefault(key + (r.fresh,), []).append((gp.group, r))
            self._flush(batches)
            if len(self.opt.state) > known:
                self._torch_order(known)
        finally:
            self._param_bufs.clear()
            self._back = {}  # the user's gradients: never held past the step

    def _torch_order(self, known: int) -> None:
        """Put the state entries this step made in torch's order (its groups' parameters in
        order): torch's part of a group ran before its flat runs, so they may have come first."""
        state = self.opt.state
        new = list(state)[known:]
        if len(new) < 2:
            return
        order: dict[int, int] = {}
        for p in self.plan.all_params:
            order.setdefault(id(p), len(order))
        ranked = sorted(new, key=lambda p: order.get(id(p), len(order)))
        if not all(map(operator.is_, ranked, new)):
            for p in ranked:
                state[p] = state.pop(p)

    def _flush(self, batches: dict[tuple[Any, ...], list[tuple[dict[str, Any], Run]]]) -> None:
        for key, jobs in batches.items():
            self._kernel(jobs, foreach=key[0], fused=key[1], fresh=key[-1])
        batches.clear()

    def torch_step(self, group: dict[str, Any]) -> None:
        """torch's own step (no hooks: they ran around the flat step) over one group."""
        opt = self.opt
        saved = opt.param_groups
        with signals_guarded() as guard:  # the groups are put back whatever lands
            guard.open()
            try:
                opt.param_groups = [group]
                raw_step(opt)(opt, None)
            finally:
                guard.finishing()
                opt.param_groups = saved

    def _range(self, r: Run, kind: str) -> torch.Tensor:
        """The run's range of a companion, or of the parameter pool (held for this step only: a
        view kept past it would pin the storage a relocation must prove dead)."""
        seg = r.seg
        if kind == "param":
            buf = self._param_bufs.get(id(seg.pool))
            if buf is None:
                buf = self._param_bufs[id(seg.pool)] = seg.pool.byte_buffer()
            return buf[r.start:r.end].view(seg.dtype)
        key = (id(seg), kind)
        flat = self._flat.get(key)
        if flat is None:
            pool = self.companions.get(seg.pool, kind)
            flat = self._flat[key] = pool.view_at(seg.start, (seg.numel,), seg.dtype)
        a = (r.start - seg.start) // seg.dtype.itemsize
        n = (r.end - r.start) // seg.dtype.itemsize
        return flat if n == seg.numel else flat[a:a + n]

    def _written(self, runs: list[Run]) -> list[torch.Tensor]:
        """What torch's step would have written in place: their version counters are bumped, so
        a graph that saved one refuses backward as with torch instead of using new values.

        The runs' parameters are listed once per plan and run pattern; a wrapper's local tensor
        is read again at each step (C-level), as a framework may give it a new one."""
        key = tuple((id(r.seg), r.start, r.end) for r in runs)
        got = self._written_of.get(key)
        if got is None:
            members, wrapped = self.plan.members, self.grads.wrapped
            idx = [i for r in runs for i in r.members]
            got = ([members[i].param for i in idx], [members[i].param for i in idx if wrapped[i]])
            if len(self._written_of) > 64:  # run patterns seen once (fresh members, skips)
                self._written_of.clear()
            self._written_of[key] = got
        params, wrappers = got
        return params + list(map(local_tensor, wrappers)) if wrappers else params

    def _kernel(self, jobs: list[tuple[dict[str, Any], Run]], *, foreach: bool, fused: bool,
                fresh: bool) -> None:
        """One call of torch's kernel over the runs of ``jobs`` (groups with equal arguments)."""
        rule, state = self.rule, self.state
        group = jobs[0][0]
        kinds = rule.kinds(group)
        runs = [r for _, r in jobs]
        made_now = fresh and rule.made_by_kernel
        if fresh and not rule.made_by_kernel:
            for g, r in jobs:
                state.make_fresh(r.members, g)
        lists: dict[str, list[torch.Tensor | None]] = {
            k: [None] * len(runs) if made_now else [self._range(r, k) for r in runs] for k in kinds}
        steps: list[torch.Tensor] = []
        if rule.has_step:  # each run's first member's own step: torch's kernel counts it
            steps = [state.view_of(r.members[0], "step") for _, r in jobs]
        rule.run(group, [self._range(r, "param") for r in runs],
                 [self.grads.range(r.seg, r.start, (r.end - r.start) // r.seg.dtype.itemsize)
                  for r in runs],
                 lists, steps, foreach=foreach, fused=fused,
                 grad_scale=getattr(self.opt, "grad_scale", None) if fused else None,
                 found_inf=getattr(self.opt, "found_inf", None) if fused else None)
        increment_version(self._written(runs))
        back = self._back
        if back:  # what torch's in-place kernel leaves in a .grad the step read by copy
            idx = [i for r in runs for i in r.members if i in back]
            if idx:
                torch._foreach_copy_([back[i] for i in idx],
                                     [self.grads.locals[i] for i in idx])  # type: ignore[misc]
        for r in runs:
            if r.slots is not None and len(r.members) > 1:  # the others' steps, as torch counts
                r.slots.span(r.slot + 1, r.slot + len(r.members)).add_(1.0)
        if made_now:
            for k in kinds:
                for (g, r), made in zip(jobs, lists[k]):
                    assert made is not None
                    self._range(r, k).copy_(made)
                    state.install_made(r.members, k)
