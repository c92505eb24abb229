"""The plan of a flat optimizer, and whether it still describes the optimizer and its pools.

:func:`stale` compares what planning read with the present and says what changed; nothing here
changes the optimizer or a tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch
from attrs import define, field

from .._aliasing import local_tensor
from ..pool import FlatPool
from ._layout import Member, Places, Segment, multi_dim, plan_group, segments_of
from ._rules import Rule, group_refusal
from ._wrap import supported

_data_ptr = torch.Tensor.data_ptr
_contiguous = torch.Tensor.is_contiguous
_local_of = operator.attrgetter("_local_tensor")

PLACE_REASONS = ("in none of the given pools", "in pool ", "a meta tensor")
"""Reasons that change when a framework puts the tensor (back) into a pool: looked up again at
every step (torchtitan builds the optimizer before the first forward)."""


@define
class GroupPlan:
    """One param group as planned."""

    group: dict[str, Any]
    params: list[torch.Tensor]
    lo: int
    hi: int
    """The group's members are ``Plan.members[lo:hi]``."""
    others: dict[int, str]
    """Parameters (index in the group) without a flat place, and why."""
    refusal: str | None
    options: tuple[Any, ...]
    locals_of: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    members: list[torch.Tensor]
    """The members' parameters, in member order."""
    addrs: list[int]
    recheck: list[int] = field(factory=list)
    """Indices of ``others`` to look up again at every step (:data:`PLACE_REASONS`)."""


@define
class Plan:
    pools: list[FlatPool]
    places: Places
    pool_state: dict[int, tuple[int | None, int, int]]
    state: object
    groups: list[GroupPlan]
    members: list[Member]
    segments: list[Segment]
    by_pool: dict[int, tuple[list[int], list[Any]]]
    """Per pool: its members' slice ids and slices (checked when ``live_version`` moved)."""
    all_params: list[torch.Tensor] = field(factory=list)
    """Every group's params, one list (one identity pass checks them all)."""
    member_params: list[torch.Tensor] = field(factory=list)
    member_addrs: list[int] = field(factory=list)
    member_locals_of: Callable[[list[torch.Tensor]], list[torch.Tensor]] = field(default=list)
    rechecks: list[int] = field(factory=list)
    """Groups with parameters to look up again at every step."""
    member_multi: list[int] = field(factory=list)
    """Members of two or more dimensions: their contiguity is checked (``p.data = p.data.t()``
    keeps the address; a 1-D place re-viewed at its address needs a hand-made stride)."""


def options(group: dict[str, Any], rule: Rule) -> tuple[Any, ...]:
    """The group options that decide whether it steps flat and which state it keeps."""
    return (group.get("foreach"), group.get("fused"), group.get("capturable"),
            group.get("differentiable"), torch.is_tensor(group.get("lr")), rule.kinds(group))


def _locals_of(params: Sequence[torch.Tensor]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """The fastest correct way to map these params to their data tensors."""
    if all(local_tensor(p) is p for p in params):
        return lambda ps: ps
    if all(type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor") for p in params):
        return lambda ps: list(map(_local_of, ps))
    return lambda ps: list(map(local_tensor, ps))


def _pool_state(p: FlatPool) -> tuple[int | None, int, int]:
    return (p.storage_key, p.capacity, p.live_version)


def make_plan(opt: torch.optim.Optimizer, rule: Rule, pools: Sequence[FlatPool]) -> Plan:
    """Plan every group of ``opt`` over ``pools`` (linear in the number of parameters)."""
    places = Places(pools)
    taken: dict[tuple[int, int], Member] = {}
    members: list[Member] = []
    groups: list[GroupPlan] = []
    for g, group in enumerate(opt.param_groups):
        params = list(group["params"])
        refusal = group_refusal(group)
        if refusal is None:
            refusal = next((f"{tuple(p.shape)}: {why}" for p in params
                            if (why := supported(p)) is not None), None)
        found, others = ([], {i: refusal for i in range(len(params))}) if refusal else \
            plan_group(g, group, places, taken)
        lo = len(members)
        members.extend(found)
        mparams = [m.param for m in found]
        locals_of = _locals_of(mparams)
        groups.append(GroupPlan(
            group, params, lo, len(members), others, refusal, options(group, rule), locals_of,
            mparams, list(map(_data_ptr, locals_of(mparams))),
            [i for i, why in others.items() if why.startswith(PLACE_REASONS)]))
    by_pool: dict[int, tuple[list[int], list[Any]]] = {}
    for m in members:
        ids, slices = by_pool.setdefault(id(m.pool), ([], []))
        ids.append(m.slice.slice_id)
        slices.append(m.slice)
    mparams = [m.param for m in members]
    locals_of = _locals_of(mparams)
    return Plan(list(pools), places, {id(p): _pool_state(p) for p in pools}, opt.state, groups,
                members, segments_of(members), by_pool,
                [p for gp in groups for p in gp.params], mparams,
                list(map(_data_ptr, locals_of(mparams))), locals_of,
                [g for g, gp in enumerate(groups) if gp.recheck], multi_dim(members))


def stale(plan: Plan, opt: torch.optim.Optimizer, rule: Rule, pools: Sequence[FlatPool]) -> str | None:
    """What changed since ``plan`` was made (``None``: nothing that matters)."""
    if len(pools) != len(plan.pools) or not all(map(operator.is_, pools, plan.pools)):
        return "the pools changed"
    for p in pools:
        have = plan.pool_state[id(p)]
        now = _pool_state(p)
        if now[:2] != have[:2]:
            return f"pool {p.name!r} moved to another storage"
        if now[2] != have[2]:  # slices allocated or freed: are the members' still live?
            _, slices = plan.by_pool.get(id(p), ([], []))
            if not all(map(p.is_live, slices)):
                return f"a member's slice of pool {p.name!r} was freed"
            plan.pool_state[id(p)] = now
    if opt.state is not plan.state:
        return "the optimizer's state was replaced (load_state_dict)"
    groups = opt.param_groups
    lists = [g["params"] for g in groups]
    if (len(groups) != len(plan.groups)
            or not all(map(operator.is_, groups, [gp.group for gp in plan.groups]))
            or list(map(len, lists)) != [len(gp.params) for gp in plan.groups]
            or not all(map(operator.is_, chain.from_iterable(lists), plan.all_params))):
        return _which_group_changed(plan, groups)
    for g, (group, gp) in enumerate(zip(groups, plan.groups)):
        if options(group, rule) != gp.options:
            return f"param_groups[{g}]'s options changed"
    locals_ = plan.member_locals_of(plan.member_params)
    if list(map(_data_ptr, locals_)) != plan.member_addrs:
        moved = next(gp for gp in plan.groups
                     if list(map(_data_ptr, gp.locals_of(gp.members))) != gp.addrs)
        return f"a parameter of param_groups[{plan.groups.index(moved)}] left its pooled place"
    if not all(map(_contiguous, map(locals_.__getitem__, plan.member_multi))):  # (``.t()``)
        return "a parameter was re-viewed over its place (not contiguous there now)"
    for g in plan.rechecks:
        gp = plan.groups[g]
        for i in gp.recheck:
            if not isinstance(plan.places.of(gp.params[i]), str):
                return f"param_groups[{g}]['params'][{i}] is in a pool now"
    return None


def _which_group_changed(plan: Plan, groups: list[dict[str, Any]]) -> str:
    if len(groups) != len(plan.groups):
        return "param groups were added or removed"
    for g, (group, gp) in enumerate(zip(groups, plan.groups)):
        if group is not gp.group:
            return f"param_groups[{g}] was replaced"
        params = group["params"]
        if len(params) != len(gp.params) or not all(map(operator.is_, params, gp.params)):
            return f"param_groups[{g}]['params'] changed"
    return "param groups changed"
