"""``FlatOptimizer``: torch's optimizer, stepped flat where that is exactly torch's step."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from typing import Any, Literal

import torch
from torch import nn

from attrs import define

from .. import _torch_compat as tc
from .._warn import logger, warn
from .._gcpause import gc_paused
from .._interrupts import guarded_call
from .._aliasing import local_tensor
from ..errors import FlatStepWarning, InvalidRequestError, InvalidTypeError
from ..pool import FlatPool
from ._torch import after_backward, is_dtensor
from . import _clip
from ._collective import Layouts
from ._companions import Companions
from ._dropin import DropIn
from ._grads import Grads, unpoolable
from ._journal import Journal, committed
from ._layout import Segment
from ._plan import Plan, make_plan, stale
from ._rules import rule_for
from ._state import State, plain_assign
from ._stepper import Stepper

FusedPolicy = Literal["exact", "foreach", "fused"]
Verify = Literal["step", "forward"]
Pools = Sequence[FlatPool] | Callable[[], Sequence[FlatPool]]


_grad_of = operator.attrgetter("grad")


def _output_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _output_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _output_tensors(o)]
    return []


class _ModuleHook:
    """A module hook calling ``fn``. A deep copy of the module (``copy.deepcopy``,
    ``AveragedModel``) gets an inert stand-in instead of a copy of the optimizer and its pools:
    the copy is a plain module, as torch's copy of an unhooked one."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Inert:
        return _Inert()


class _Inert:
    """What a deep copy holds where the original has a flatpool hook: removes itself from the
    copy's hooks at its first call and does nothing."""

    def __call__(self, module: nn.Module, *_: Any) -> None:
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for k in [k for k, v in hooks.items() if v is self]:
                del hooks[k]


@define(frozen=True)
class _Current:
    """What one plan made; replaced whole when the optimizer is planned again."""

    plan: Plan
    grads: Grads
    state: State
    stepper: Stepper
    layouts: Layouts
    """The collective-output checks made under this plan (:meth:`FlatOptimizer.collective_output`)."""


class FlatOptimizer:
    """Flat steps for ``optimizer`` over parameters adopted into ``pools``.

    After setup ``optimizer.step()`` runs the flat step (so LR schedulers, ``GradScaler``,
    ``step(closure)`` and the optimizer's step hooks work as with torch alone) and
    ``optimizer.zero_grad()`` releases the gradient pools; :meth:`close` gives the optimizer
    back its own. Setup is all-or-nothing, an interrupt included.

    Args:
        optimizer: a ``torch.optim.Adam``, ``AdamW`` or ``SGD`` (others raise
            :class:`UnsupportedOptimizerError`).
        pools: the pools holding the parameters, or a function returning them now (the HSDP
            layer's pools can appear later: :func:`flatpool.integrations.hsdp.flat_optimizer`).
        module: when given, a hook on its outputs installs zeroed pooled gradients when a
            backward reaches them, so it writes into the pool; a forward pre-hook checks the plan.
        fused: for groups created with ``fused=True``: ``"exact"`` (default) keeps the user's
            kernel: torch's fused kernel runs flat where that was shown bit-identical to it per
            parameter (:data:`~flatpool.optim._rules.FUSED_EXACT`), torch's own fused step runs
            the rest over the pooled state; ``"foreach"`` runs the foreach math flat
            (bit-identical to ``foreach=True``, not to fused); ``"fused"`` runs the fused kernel
            flat everywhere (a few ulp from fused per parameter). See docs/optim.md.
        verify: accepted for compatibility; every step checks everything it relies on.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pools: Pools,
        *,
        module: nn.Module | None = None,
        fused: FusedPolicy = "exact",
        verify: Verify = "step",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidTypeError(f"FlatOptimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self._pool_source = pools if callable(pools) else tuple(pools)
        first_pools = self._current_pools()
        if fused not in ("exact", "foreach", "fused"):
            raise InvalidTypeError(f"fused must be 'exact', 'foreach' or 'fused', got {fused!r}")
        if verify not in ("step", "forward"):
            raise InvalidTypeError(f"verify must be 'step' or 'forward', got {verify!r}")
        if module is not None and not isinstance(module, nn.Module):
            raise InvalidTypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if verify == "forward" and module is None:
            raise InvalidRequestError("verify='forward' runs checks in the module's forward "
                                      "pre-hook: pass module=")
        if DropIn.of(optimizer) is not None:
            raise InvalidRequestError(
                f"this {type(optimizer).__name__} is already stepped by a FlatOptimizer: "
                "close() that one first")
        self.optimizer = optimizer
        self.rule = rule_for(optimizer)
        self.fused: FusedPolicy = fused
        self.verify = verify
        self.module = module
        self.replans = 0
        """How many times the plan was made again after setup."""
        self.reasons: dict[int, str] = {}
        """Why (part of) a param group is stepped by torch's own step, per group."""
        self._said: set[tuple[int, str]] = set()
        self._closed = False
        self._backward_queued = False
        self._handles: list[Any] = []
        self._serving: list[Callable[[], Iterable[torch.Tensor]]] = []
        """Where the parameters whose ``.grad`` another component makes are (:meth:`_serve`)."""
        self._served_key: tuple[Grads | None, int] = (None, 0)
        self._ddps: set[int] = set()
        self._dropin = DropIn(optimizer, self._step_body, self._zero_grad_body)
        guarded_call(lambda: self._setup(first_pools), gc_paused())

    def _setup(self, pools: list[FlatPool]) -> None:
        """Plan, pool what the members hold, install, in one journaled commit (:mod:`._journal`)."""
        self._adopt_plan(make_plan(self.optimizer, self.rule, pools))
        with committed() as journal:
            self._absorb_existing(journal.set_attr, journal.set_item)
            self._dropin.install(journal)
            if self.module is not None:
                self._install_hooks(self.module, journal)

    # -- planning ---------------------------------------------------------------------------
    @property
    def _plan(self) -> Plan:
        return self._now.plan

    @property
    def grads(self) -> Grads:
        """The pooled gradients (:mod:`._grads`)."""
        return self._now.grads

    @property
    def state(self) -> State:
        """The pooled optimizer state (:mod:`._state`)."""
        return self._now.state

    @property
    def pools(self) -> list[FlatPool]:
        """The parameter pools of the current plan."""
        return self._now.plan.pools

    def _current_pools(self) -> list[FlatPool]:
        src = self._pool_source
        pools = list(src() if callable(src) else src)
        for p in pools:
            if not isinstance(p, FlatPool):
                raise InvalidTypeError(f"pools must be FlatPools, got {type(p).__name__}")
        return pools

    def _adopt_plan(self, plan: Plan) -> None:
        """Make ``plan`` current, with new companions and gradients; note what is not flat."""
        companions = Companions()
        sparse = self._sparse_params()
        grads = Grads(plan.members)
        grads.sparse = {i for i, m in enumerate(plan.members) if id(m.param) in sparse}
        state = State(self.optimizer, self.rule, plan.members,
                      [plan.groups[m.group].group for m in plan.members], companions)
        stepper = Stepper(self.optimizer, self.rule, plan, grads, state, companions, self.fused,
                          self._say)
        layouts = Layouts(grads)
        self._now = _Current(plan, grads, state, stepper, layouts)  # one store: never half a plan
        self.reasons = dict(stepper.why)  # said by the step that runs torch's step for them

    def _sparse_params(self) -> set[int]:
        """Parameters of the module's sparse embeddings, and those seen with a sparse gradient."""
        now: _Current | None = getattr(self, "_now", None)
        found = {id(now.grads.params[i]) for i in now.grads.sparse} if now is not None else set()
        if self.module is not None:
            for m in self.module.modules():
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                    found.add(id(m.weight))
        return found

    def _say(self, g: int, why: str) -> None:
        """Warn once per group and reason, from the step that runs torch's step for the group."""
        self.reasons[g] = why
        if (g, why) not in self._said:
            self._said.add((g, why))
            warn(f"param_groups[{g}] of {type(self.optimizer).__name__}: stepped per parameter "
                 f"by torch's own step, not flat: {why}", FlatStepWarning, past_torch=True)

    def _absorb_existing(self, set_attr: Callable[[Any, str, Any], None] = setattr,
                         set_item: Callable[[dict[Any, Any], str, Any], None] = plain_assign,
                         ours: frozenset[int] = frozenset()) -> None:
        """Pool the members' existing state entries, and move the gradient views an earlier plan
        installed (``ours``: their parameters' ids) to this plan's places. Every other ``.grad``
        is its owner's: the step copies it in, and it stays theirs."""
        plan, grads, state = self._plan, self.grads, self.state
        grads.reinstall([i for i, m in enumerate(plan.members) if id(m.param) in ours
                         and (g := m.param.grad) is not None and unpoolable(g, m) is None],
                        set_attr)
        adopt = []
        for gp in plan.groups:
            adopt += state.existing(range(gp.lo, gp.hi), gp.group)
        state.adopt(adopt, set_item)

    def _ensure_plan(self) -> None:
        pools = self._current_pools()
        why = stale(self._plan, self.optimizer, self.rule, pools)
        if why is None:
            return
        self.grads.settle()
        guarded_call(lambda: self._replan(pools), gc_paused())
        self.replans += 1
        logger.info("flatpool.optim: planned again (%s): %d segment(s)", why,
                    len(self._plan.segments))

    def _replan(self, pools: list[FlatPool]) -> None:
        old = self.grads
        ours = frozenset(map(id, compress(old.params, old.pooled(0, len(old.params)))))
        self._adopt_plan(make_plan(self.optimizer, self.rule, pools))
        self._absorb_existing(ours=ours)

    def readopt(self) -> None:
        """Plan again now (the step does this by itself when something it relies on changed)."""
        self.grads.settle()
        guarded_call(lambda: self._replan(self._current_pools()), gc_paused())
        self.replans += 1

    # -- what is where ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: the optimizer steps as torch's own again (read-only)."""
        return self._closed

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups (what ``GradScaler.unscale_``/``step`` read)."""
        return self.optimizer.param_groups

    @property
    def segments(self) -> list[Segment]:
        """The segments (:mod:`._layout` glossary) of the current plan."""
        return [] if self._closed else list(self._plan.segments)

    @property
    def fallback(self) -> list[int]:
        """Param groups with no member: torch's own step steps them whole."""
        if self._closed:
            return list(range(len(self.optimizer.param_groups)))
        return [g for g, gp in enumerate(self._plan.groups) if gp.lo == gp.hi]

    def buffers(self) -> dict[str, list[FlatPool]]:
        """The companion pools: ``{"grad": [...], "state": [...]}`` (state includes the steps)."""
        return {"grad": self.grads.pools(), "state": self.state.pools()}

    # -- a gradient pool as a collective's output ---------------------------------------------
    def check_collective_output(self, pool: FlatPool, params: Sequence[torch.Tensor],
                                offsets: Sequence[int]) -> str | None:
        """Why the gradient pool of parameter pool ``pool`` cannot be a collective's output for
        ``params`` (in the collective's order) at byte ``offsets``, or ``None`` when it can:
        they are exactly this plan's flat members of ``pool``, at those offsets.

        Checked once per plan, storage of ``pool`` and ``params``/``offsets`` objects (compared
        by identity: pass the same unchanged sequences, tuples, to reuse the check at every
        backward)."""
        if self._closed:
            return "the flat optimizer is closed"
        found = self._now.layouts.get(pool, params, offsets)
        return found if isinstance(found, str) else None

    def collective_output(self, pool: FlatPool, params: Sequence[torch.Tensor],
                          offsets: Sequence[int], numel: int,
                          dtype: torch.dtype) -> torch.Tensor | None:
        """The gradient pool of parameter pool ``pool`` as one flat ``numel``-element ``dtype``
        tensor at storage offset 0, for a collective (FSDP2's reduce-scatter) to write whole and
        view each member's ``.grad`` out of (absolute storage offsets), which the step then
        recognizes as the pooled gradients: no zeroing, no copy.

        ``None`` (the collective uses a buffer of its own; the step copies) when
        :meth:`check_collective_output` gives a reason, when closed, or while a member has a
        ``.grad`` (the collective then adds into it, exact as without flatpool). The pool is not
        zeroed: the collective must write all ``numel`` elements."""
        if self._closed:
            return None
        found = self._now.layouts.get(pool, params, offsets)
        if isinstance(found, str):
            return None
        return self.grads.hand_out(pool, found, numel, dtype)

    # -- hooks ------------------------------------------------------------------------------
    def _serve(self, params: Callable[[], Iterable[torch.Tensor]]) -> None:
        """Pre-install no gradient for the parameters ``params()`` returns (read again at each
        plan): another component makes their ``.grad`` (DDP's Reducer its bucket views, FSDP2's
        reduce-scatter straight into the pool)."""
        self._serving.append(params)

    def _serve_ddp(self, ddp: nn.Module) -> None:
        """Once per DDP: its Reducer makes its parameters' ``.grad`` (bucket views)."""
        if id(ddp) not in self._ddps:
            self._ddps.add(id(ddp))
            self._serve(ddp.parameters)

    def _skipped_by_hook(self) -> bool:
        """Bring :attr:`Grads.served` up to date; whether every member is served (then the
        backward hook has nothing to do)."""
        grads = self.grads
        key = (grads, len(self._serving))
        if key[0] is not self._served_key[0] or key[1] != self._served_key[1]:
            served = {id(p) for f in self._serving for p in f()}
            grads.served = {i for i, p in enumerate(grads.params) if id(p) in served}
            self._served_key = key
        return len(grads.served) == len(grads.params)

    def _install_hooks(self, module: nn.Module, journal: Journal) -> None:
        for ddp in tc.ddp_modules(module):
            self._serve_ddp(ddp)
        pre, post = _ModuleHook(self._pre_forward), _ModuleHook(self._post_forward)
        journal.add_hook(module._forward_pre_hooks, pre,
                         lambda: self._handles.append(module.register_forward_pre_hook(pre)))
        journal.add_hook(module._forward_hooks, post,
                         lambda: self._handles.append(module.register_forward_hook(post)))

    def _pre_forward(self, *_: Any) -> None:
        # Inside torch.func transforms tensors have no storage: plain torch does nothing there.
        if torch.is_grad_enabled() and not self._closed and not tc.in_functorch_transform():
            self._ensure_plan()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not self._closed and not tc.in_functorch_transform():
            ddp = tc.active_ddp()  # a DDP wrapping the hooked module: its Reducer's gradients
            if ddp is not None:
                self._serve_ddp(ddp)
            if self._skipped_by_hook():
                return
            for t in _output_tensors(output):
                t.register_hook(self._backward_started)  # type: ignore[no-untyped-call]

    def _backward_started(self, grad: torch.Tensor) -> None:
        """Install the pooled views before any gradient is made; settle them when it ends."""
        if not self._backward_queued and not self._closed:
            self._backward_queued = True
            self._skipped_by_hook()
            self.grads.install_missing()
            after_backward(lambda: after_backward(self._backward_ended))  # after FSDP2's

    def _backward_ended(self) -> None:
        self._backward_queued = False
        self.grads.settle()

    # -- the step ---------------------------------------------------------------------------
    def _step_body(self, opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # gc paused: the checks' per-member passes make short-lived tuples (shapes), and a
        # collection they set off would scan the whole heap
        with torch.no_grad(), gc_paused():
            self.grads.settle()
            self._ensure_plan()
            stepper = self._now.stepper
            stepper.run(stepper.prepare())
        return loss

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)`` (the flat step, hooks included)."""
        return self.optimizer.step(closure)

    def _zero_grad_body(self, opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        self.grads.settle()
        type(opt).zero_grad(opt, set_to_none)
        if set_to_none:
            self.grads.release()

    def close(self) -> None:
        """Give the optimizer its own ``step`` and ``zero_grad`` back and remove the hooks."""
        if self._closed:
            return
        self.grads.settle()
        self._dropin.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._closed = True

    # -- gradient norm ----------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False, exact: bool = True) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(params, ..., foreach=True)``, bit for bit.

        ``exact=False`` takes one norm a flat run (equal up to rounding; plain tensors only).
        """
        with torch.no_grad():
            self.grads.settle()
            if not self._closed:
                self._ensure_plan()
            runs, others = self._grad_runs()
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            grads = [g for g in map(_grad_of, params) if g is not None]
            if not grads:
                total = torch.tensor(0.0)
            elif exact:
                total = _clip.total_norm(grads, norm_type, error_if_nonfinite)
            else:
                if any(is_dtensor(g) or local_tensor(g) is not g for g in grads):
                    raise InvalidRequestError(
                        "clip_grad_norm_(exact=False) takes the norm of this rank's flat "
                        "buffers: sharded (DTensor) parameters need the reduction of exact=True")
                total = torch.nn.utils.get_total_norm(runs + others, norm_type,
                                                      error_if_nonfinite, foreach=True)
            if grads:
                _clip.scale(runs + others, _clip.coefficient(max_norm, total))
        return total

    def _grad_runs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gradients to scale: pooled ones as flat ranges, every other one as it is."""
        if self._closed:
            return [], [g for p in self.optimizer.param_groups for g in map(_grad_of, p["params"])
                        if g is not None]
        grads = self.grads
        pooled = grads.pooled(0, len(grads.members))  # others are their owners': scaled as they are
        runs: list[torch.Tensor] = []
        covered = [False] * len(pooled)
        for segs in self._now.stepper.segments.values():
            for seg, idx in segs:
                if seg.flat:
                    runs += self._ranges(seg, idx, pooled, covered)
        others = [g for i in compress(range(len(covered)), map(operator.not_, covered))
                  if (g := grads.params[i].grad) is not None]
        others += [g for gp in self._plan.groups for i in gp.others
                   if (g := gp.params[i].grad) is not None]
        return runs, others

    def _ranges(self, seg: Segment, idx: list[int], pooled: list[bool], covered: list[bool]
                ) -> list[torch.Tensor]:
        """A segment's gradient ranges over its runs of members with pooled gradients."""
        grads, ms = self.grads, seg.members
        itemsize = seg.dtype.itemsize
        flags = list(map(pooled.__getitem__, idx))
        if all(flags):  # the whole segment
            for i in idx:
                covered[i] = True
            return [grads.range(seg, seg.start, seg.numel)]
        out = []
        a = None
        for k in range(len(ms) + 1):
            ok = k < len(ms) and flags[k]
            if ok and a is None:
                a = k
            elif not ok and a is not None:
                start, end = ms[a].offset, ms[k - 1].end
                out.append(grads.range(seg, start, (end - start) // itemsize))
                for i in idx[a:k]:
                    covered[i] = True
                a = None
        return out
