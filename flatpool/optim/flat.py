"""``FlatOptimizer``: one optimizer step per flat segment instead of one per parameter.

Set up once over a torch optimizer whose parameters were adopted into pools. Every parameter
group that can step flat gets pooled gradients (:mod:`.grads`) and pooled state (:mod:`.state`);
:meth:`FlatOptimizer.step` then runs torch's own functional kernel once per segment over one
flat tensor each. A group that cannot (see :func:`flatpool.optim.layout.plan`,
:func:`flatpool.optim.rules.group_refusal`, :func:`flatpool.optim.state.state_refusal`) is
stepped by the optimizer's own ``step``, per parameter, and a :class:`FlatStepWarning` says why.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .. import torch_compat as tc
from .._warn import logger, warn
from ..errors import FlatStepWarning, InvalidRequestError, InvalidTypeError
from ..pool import FlatPool
from .buffers import Mirrors, segment_view
from .errors import FlatStepError, LostPlaceError
from .grads import GradBuffers
from .layout import Member, gaps, plan
from .rules import group_refusal, rule_for
from .state import StateBuffers, state_refusal
from .wrap import is_dtensor, supported
from ..aliasing import local_tensor

FusedPolicy = Literal["foreach", "fused"]
Verify = Literal["step", "forward"]

_data_ptr = torch.Tensor.data_ptr
_local_of = operator.attrgetter("_local_tensor")


def _locals(params: list[torch.Tensor], wrapped: bool | None) -> list[torch.Tensor]:
    """The members' data tensors (a DTensor's local tensor); mapped in C when all members are
    alike (``wrapped`` True: all wrappers, False: all plain, None: mixed)."""
    if wrapped is False:
        return params
    if wrapped:
        return list(map(_local_of, params))
    return [getattr(p, "_local_tensor", p) for p in params]


def _norm_input(grad: torch.Tensor) -> torch.Tensor:
    """What torch's norm reads: a torch DTensor as it is (its reduction runs), the local tensor
    of any other wrapper (a HyperParallel-style DTensor's ops on lists cannot dispatch)."""
    return grad if is_dtensor(grad) else local_tensor(grad)


class FlatOptimizer:
    """Flat steps for ``optimizer`` over parameters adopted into ``pools``.

    Args:
        optimizer: a ``torch.optim.Adam``, ``AdamW`` or ``SGD`` (others raise
            :class:`UnsupportedOptimizerError`).
        pools: the pools holding the parameters, or a function returning them now (the HSDP
            layer's pools can appear later: :func:`flatpool.integrations.hsdp.optim.flat_optimizer`).
        module: when given, a forward pre-hook re-installs pooled gradients after
            ``optimizer.zero_grad()`` set them to ``None``, so backward accumulates into the
            pool and no per-parameter gradient storage is ever made.
        fused: for groups created with ``fused=True``: ``"foreach"`` (default) runs the foreach
            math, bit-identical to ``foreach=True``; ``"fused"`` runs torch's fused kernel over
            the flat tensors (not bit-identical to fused per parameter; see docs/optim.md).
        verify: where the per-member checks run (each member's place, and that its
            ``.grad`` is its pooled view; about a microsecond a member): ``"step"`` (default)
            at every step; ``"forward"`` in the module's forward pre-hook only, so the step
            itself checks only the pools and the optimizer's state dict (O(pools)) and trusts
            that nothing replaced a ``.grad`` between backward and step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pools: Sequence[FlatPool] | Callable[[], Sequence[FlatPool]],
        *,
        module: nn.Module | None = None,
        fused: FusedPolicy = "foreach",
        verify: Verify = "step",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidTypeError(f"FlatOptimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self._pool_source = pools if callable(pools) else tuple(pools)
        self.pools = self._current_pools()
        if fused not in ("foreach", "fused"):
            raise InvalidTypeError(f"fused must be 'foreach' or 'fused', got {fused!r}")
        if verify not in ("step", "forward"):
            raise InvalidTypeError(f"verify must be 'step' or 'forward', got {verify!r}")
        if verify == "forward" and module is None:
            raise InvalidRequestError("verify='forward' runs the checks in the module's "
                                      "forward pre-hook: pass module=")
        self.optimizer = optimizer
        self.rule = rule_for(optimizer)
        self.fused: FusedPolicy = fused
        self.verify = verify
        self._mirrors = Mirrors()
        self._inside = False
        self.replans = 0
        """How many times the state or layout was re-adopted after the first plan."""
        self._plan(first=True)
        self._handles = [optimizer.register_step_pre_hook(self._guard)]
        if module is not None:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward))

    # -- planning -------------------------------------------------------------------------
    def _current_pools(self) -> list[FlatPool]:
        src = self._pool_source
        pools = list(src() if callable(src) else src)
        for p in pools:
            if not isinstance(p, FlatPool):
                raise InvalidTypeError(f"pools must be FlatPools, got {type(p).__name__}")
        return pools

    def _plan(self, first: bool = False) -> None:
        opt = self.optimizer
        self._planned = False  # an exception in here (a Ctrl-C too) leaves the next step to re-plan
        self.pools = self._current_pools()
        segments, reasons = plan(opt.param_groups, self.pools)
        for g, group in enumerate(opt.param_groups):
            why = group_refusal(group)
            if why is None:
                why = next((f"{tuple(p.shape)}: {r}" for p in group["params"]
                            if (r := supported(p)) is not None), None)
            if why is not None and g not in reasons:
                reasons[g] = why
        by_group: dict[int, list[Member]] = {}
        for s in segments:
            if s.group not in reasons:
                by_group.setdefault(s.group, []).extend(s.members)
        for g, members in by_group.items():
            why = state_refusal(opt, self.rule, opt.param_groups[g], members)
            if why is not None:
                reasons[g] = why
        segments = [s for s in segments if s.group not in reasons]
        for g, why in sorted(reasons.items()):
            warn(f"param_groups[{g}] of {type(opt).__name__} is stepped per parameter, not flat: "
                 f"{why}", FlatStepWarning)
        if self.fused == "foreach" and any(
                opt.param_groups[s.group].get("fused") for s in segments):
            warn("fused=True asked: the flat step runs the foreach math (bit-identical to "
                 "foreach=True; fused per parameter differs from it by a few ulp, see "
                 "docs/optim.md); pass fused='fused' to run torch's fused kernel flat",
                 FlatStepWarning)
        self.segments = segments
        self.fallback = sorted(reasons)
        self.reasons = reasons
        members = [m for s in segments for m in s.members]
        self.grads = GradBuffers(members, self._mirrors)
        self.state = StateBuffers(opt, self.rule, segments, self._mirrors, steps_on_device=(
            self.fused == "fused" and any(opt.param_groups[s.group].get("fused") for s in segments)))
        with torch.no_grad():
            for s in segments:  # free bytes inside a segment: zero, so they stay inert
                for a, b in gaps(s):
                    s.pool.view_bytes(a, b - a).zero_()
        self._members = members
        self._index_members()
        self._state_dict = opt.state
        self._groups = len(opt.param_groups)
        self._keys = [p.storage_key for p in self.pools]
        self._used = {id(s.pool): s.pool.used_bytes for s in segments if gaps(s)}
        self._planned = True
        if not first:
            self.replans += 1
            logger.info("flatpool.optim: re-adopted gradients and state of %d segment(s)",
                        len(segments))

    def _index_members(self) -> None:
        self._expected: tuple[tuple[int | None, ...] | None, list[int | None]] = (None, [])
        """(the pools' storage keys, each member's expected data address) for the check."""
        self._params = [m.param for m in self._members]
        kinds = {hasattr(p, "_local_tensor") for p in self._params}
        self._wrapped = kinds.pop() if len(kinds) == 1 else (False if not kinds else None)

    def readopt(self) -> None:
        """Re-plan after the parameters, their pools or the optimizer's state changed (a
        ``load_state_dict``, DCP load, ``to_empty`` followed by re-adoption of the parameters):
        current gradients and state values are copied into the pooled places."""
        self._plan()

    def _check(self) -> None:
        opt = self.optimizer
        if callable(self._pool_source) and [id(p) for p in self._current_pools()] != [
                id(p) for p in self.pools]:
            self._plan()  # the framework made new pools (a group adopted late)
            return
        if (not self._planned or opt.state is not self._state_dict
                or len(opt.param_groups) != self._groups
                or [p.storage_key for p in self.pools] != self._keys
                or any(s.pool.used_bytes != self._used[id(s.pool)]
                       for s in self.segments if id(s.pool) in self._used)):
            self._lost_check()
            self._plan()
            return
        if self.verify == "step":
            self._lost_check()

    def _lost_check(self) -> None:
        """Every member still on its pool's storage at its offset.

        The healthy path is one C-level pass: each member's data address against its pool's base
        address plus its offset. Members hold elements, and the pool's live storage owns those
        bytes, so an equal address means the member reads and writes exactly the bytes the flat
        step updates (the precise storage-identity check below runs only on a mismatch, to name
        the member)."""
        pool_keys = tuple(p.storage_key for p in self.pools)
        if self._expected[0] != pool_keys:  # made once per set of pool storages
            bases = {id(p): p.base_address for p in self.pools}
            self._expected = (pool_keys, [None if bases.get(id(m.pool)) is None else
                                          int(bases[id(m.pool)] or 0) + m.offset
                                          for m in self._members])
        locals_ = _locals(self._params, self._wrapped)
        if list(map(_data_ptr, locals_)) == self._expected[1]:
            return
        keys = dict(zip(map(id, self.pools), pool_keys))
        for m, local in zip(self._members, locals_):
            key = keys.get(id(m.pool))
            if (key is None or tc.storage_address(local) != key
                    or local.storage_offset() * m.dtype.itemsize != m.offset):
                raise LostPlaceError(
                    f"a {tuple(m.param.shape)} parameter of param_groups[{m.group}] left its "
                    f"place (byte {m.offset} of pool {m.pool.name!r}): re-adopt it "
                    "(pool.readopt(), or the HSDP layer's revalidate(), which its forward hook "
                    "runs) before stepping; nothing was stepped")

    # -- hooks ----------------------------------------------------------------------------
    def _pre_forward(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            if self.verify == "forward":
                self._lost_check()
            self.grads.install()

    def _guard(self, *_: Any) -> None:
        if not self._inside and self.rule.has_step and self.segments:
            raise FlatStepError(
                f"{type(self.optimizer).__name__}.step() called on an optimizer whose state "
                "flatpool pooled (one step count shared by each flat segment): torch's "
                "per-parameter step would count it once per parameter. Call "
                "FlatOptimizer.step(), or FlatOptimizer.close() first")

    def close(self) -> None:
        """Remove the hooks and give each parameter a step count of its own again: the
        optimizer steps per parameter from now on (the state stays in the pools)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for g in {s.group for s in self.segments}:
            self.state.dissolve(g)
            self.reasons[g] = "closed"
        self.segments = []
        self.fallback = list(range(len(self.optimizer.param_groups)))

    # -- the step -------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step: flat per segment, per parameter for the fallback groups."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check()
        if self.verify == "step":
            missing = {m.group for m in self.grads.install(fill_missing=False)}
            for g in sorted(missing):
                self._dissolve(g, "a parameter has no gradient this step (torch skips it; a "
                                  "flat step cannot)")
        opt = self.optimizer
        with torch.no_grad():
            for i, seg in enumerate(self.state.segments):
                if seg.group in self.reasons:
                    continue  # dissolved since the plan
                group = opt.param_groups[seg.group]
                fused = bool(group.get("fused")) and self.fused == "fused"
                params = [segment_view(seg.pool, seg)]
                grads = [self.grads.flat(seg)]
                fresh = self.state.fresh[i]
                state: dict[str, list[torch.Tensor | None]] = {
                    k: [None] if fresh else [v] for k, v in self.state.flats(i).items()}
                slot = self.state.slots[i]
                self.rule.run(opt, group, params, grads, state,
                              [slot] if slot is not None else [], fused)
                if fresh:
                    self.state.settle_fresh(i, state)
        if self.fallback:
            self._step_groups(self.fallback)
        return loss

    def _dissolve(self, g: int, why: str) -> None:
        warn(f"param_groups[{g}] of {type(self.optimizer).__name__} is stepped per parameter "
             f"from now on: {why}", FlatStepWarning)
        self.state.dissolve(g)
        self.segments = [s for s in self.segments if s.group != g]
        self.fallback = sorted(set(self.fallback) | {g})
        self.reasons[g] = why
        self._members = [m for m in self._members if m.group != g]
        self._index_members()
        self.grads = GradBuffers(self._members, self._mirrors)

    def _step_groups(self, groups: Sequence[int]) -> None:
        opt = self.optimizer
        saved = opt.param_groups
        self._inside = True
        try:
            opt.param_groups = [saved[g] for g in groups]
            opt.step()
        finally:
            opt.param_groups = saved
            self._inside = False

    # -- gradient norm --------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False, exact: bool = True) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter of the optimizer, with the
        scaling done once per gradient buffer.

        ``exact`` (default): the norm is torch's own over the (pooled) gradients, so norm and
        result are bit-identical to clipping the parameters. ``exact=False``: the norm is taken
        over the flat buffers (one norm a segment), equal up to rounding (docs/optim.md gives
        the measured difference); single-process only (a sharded norm needs its reduction).
        """
        if self.verify == "step":
            self.grads.install(fill_missing=False)  # absorb foreign gradients; None stays None
        pooled = {id(m.param) for m in self._members}
        others = [p.grad for g in self.optimizer.param_groups for p in g["params"]
                  if p.grad is not None and id(p) not in pooled]
        flats = [self.grads.flat(s) for s in self.segments]
        if exact:
            grads = [_norm_input(p.grad) for g in self.optimizer.param_groups
                     for p in g["params"] if p.grad is not None]
        else:
            if self._wrapped is not False or any(local_tensor(g) is not g for g in others):
                raise InvalidRequestError(
                    "clip_grad_norm_(exact=False) takes the norm of this rank's flat buffers: "
                    "sharded (DTensor) parameters need the reduction of exact=True")
            grads = flats + others
        if not grads:
            return torch.tensor(0.0)
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach=True)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = coef.full_tensor() if hasattr(coef, "full_tensor") else coef
        with torch.no_grad():
            if flats:
                torch._foreach_mul_(flats, local.to(flats[0].device))
            if others:
                torch._foreach_mul_(others, coef)
        return total

    # -- what is where --------------------------------------------------------------------
    def buffers(self) -> dict[str, list[FlatPool]]:
        """The companion pools: ``{"grad": [...], "state": [...]}`` (state includes the step
        slots)."""
        return {"grad": self.grads.pools(), "state": self.state.pools()}


__all__ = ["FlatOptimizer", "FusedPolicy", "Verify"]
