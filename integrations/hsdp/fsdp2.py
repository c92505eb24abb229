"""Apply the fusion layer to every param group of a ``fully_shard``-ed module and keep it valid.

FSDP2 installs new storages in ``nn.Module._apply`` and a ``load_state_dict`` post-hook, so the
layer re-validates after ``load_state_dict`` (a post-hook after FSDP2's) and before every
forward (a pre-hook prepended before FSDP2's, which runs its lazy init first), under the
fail-safe policy of :mod:`flatpool.integrations.hsdp.failsafe`. FSDP2's private state is read
through :mod:`flatpool._torch_compat`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from flatpool import FlatPool, FlatPoolError, OnPinned
from flatpool import _torch_compat as tc
from flatpool import InvalidTypeError
from flatpool._warn import logger
from flatpool.optim import FlatOptimizer
from flatpool._gcpause import gc_paused
from flatpool._interrupts import guarded_call
from flatpool.ownership import check_policy

from .failsafe import keep_all_fused, keep_fused
from .group import GroupBuffers, GroupRequest, adopt_group, adopt_groups
from ._kept import KeptAlive, KeptOriginal
from .members import data_of
from ._meta import materialize_group
from ._reduce_scatter import reduce_into_pools
from .validity import is_valid

FSDPParamGroup = Any
"""FSDP2's ``FSDPParamGroup`` (private to torch: read as the shape flatpool needs)."""


def fsdp_param_groups(module: nn.Module) -> Iterator[FSDPParamGroup]:
    """Every FSDP2 param group under ``module`` (each ``fully_shard`` call makes at most one)."""
    seen: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            for g in tc.fsdp_module_param_groups(sub):
                if id(g) not in seen:
                    seen.add(id(g))
                    yield g


def lazy_init(module: nn.Module) -> None:
    """Run FSDP2's lazy initialization now, where it pads and re-saves every member."""
    if not isinstance(module, FSDPModule):
        raise InvalidTypeError(
            f"{type(module).__name__} is not a fully_shard-ed module: call "
            "torch.distributed.fsdp.fully_shard(module) first")
    tc.fsdp_lazy_init(module)


def _user_class(module: nn.Module) -> type:
    """The class the user wrote (``fully_shard`` swaps in a subclass it makes)."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _world_size(group: FSDPParamGroup) -> int:
    return int(getattr(group.mesh_info, "shard_mesh_size", 1))


class FusedModule:
    """The layer applied to one ``fully_shard``-ed module: ``buffers[i]`` for ``groups[i]``.

    Build it with :func:`fuse_fully_sharded`; ``on_pinned`` is the hooks' policy.
    """

    def __init__(self, module: nn.Module, alignment: int = 1, on_pinned: OnPinned = "warn") -> None:
        self.module = module
        self.alignment = alignment
        self.on_pinned: OnPinned = check_policy(on_pinned)
        self.groups: list[FSDPParamGroup] = list(fsdp_param_groups(module))
        self.buffers: list[GroupBuffers] = [GroupBuffers(skipped="not adopted yet")
                                            for _ in self.groups]
        self.readoptions: int = 0
        """How many times a moved member was brought back (for tests and logs)."""
        self._handles: list[RemovableHandle] = []
        self.deferred = 0
        """Re-adoptions put off from ``load_state_dict`` to the next forward (pinned then)."""

    def _build(self, i: int, materialize: bool = False) -> Any:
        g = self.groups[i]

        def build(on_pinned: OnPinned, kept: KeptAlive) -> GroupBuffers:
            if materialize and self._all_meta(i):
                return materialize_group(
                    g.fsdp_params, device=g.device, alignment=self.alignment, name=f"fsdp{i}")
            return adopt_group(g.fsdp_params, device=g.device, world_size=_world_size(g),
                               alignment=self.alignment, name=f"fsdp{i}", on_pinned=on_pinned,
                               kept=kept)

        return build

    def _all_meta(self, i: int) -> bool:
        """Group ``i`` has members and every one is on meta (materialized, not adopted)."""
        params = self.groups[i].fsdp_params
        with tc.no_torch_function():
            result = bool(params) and all(tc.impl_is_meta(data_of(p, j))
                                          for j, p in enumerate(params))
            return result  # not `return f()`: see flatpool._interrupts

    def _adopt(self, i: int, materialize: bool = False, on_pinned: OnPinned | None = None) -> None:
        policy = self.on_pinned if on_pinned is None else on_pinned
        self.buffers[i], _ = keep_fused(
            GroupBuffers(skipped="not adopted yet", kept=self.buffers[i].kept),
            self.groups[i].fsdp_params, self._build(i, materialize), on_pinned=policy,
            where=f"fsdp{i}")

    def _adopt_all(self, materialize: bool) -> None:
        """Fuse every group in one transaction; only where that fails, group by group."""
        todo = [i for i in range(len(self.groups)) if not (materialize and self._all_meta(i))]
        for i in sorted(set(range(len(self.groups))) - set(todo)):
            self._adopt(i, materialize=True)
        fresh = [self.buffers[i] for i in todo]  # (as __init__ made them: never adopted)
        requests = [GroupRequest(self.groups[i].fsdp_params, self.groups[i].device,
                                 _world_size(self.groups[i]), f"fsdp{i}", f.kept)
                    for i, f in zip(todo, fresh)]

        def build(on_pinned: OnPinned) -> list[GroupBuffers]:
            return adopt_groups(requests, alignment=self.alignment, on_pinned=on_pinned)

        built = keep_all_fused(fresh, build, on_pinned=self.on_pinned,
                               where=[f"fsdp{i}" for i in todo])
        if built is None:
            for i in todo:
                self._adopt(i)
            return
        for i, b in zip(todo, built):
            self.buffers[i] = b

    def revalidate(self, on_pinned: OnPinned | None = None) -> None:
        """Bring every group back into its pools (adopt late groups, re-adopt moved members,
        plan anew on a dtype or device change); a healthy rank pays :func:`is_valid` only.
        A group skipped for its structure is not tried again, and inside autograd's backward
        nothing is (see :func:`keep_fused`)."""
        policy = self.on_pinned if on_pinned is None else on_pinned
        for i, g in enumerate(self.groups):
            self.buffers[i], moved = keep_fused(
                self.buffers[i], g.fsdp_params, self._build(i), on_pinned=policy,
                where=f"fsdp{i}")
            self.readoptions += moved

    def is_valid(self) -> bool:
        """Every adoptable group adopted, and every member in place."""
        return all(
            b.adopted and is_valid(b, g.fsdp_params) for g, b in zip(self.groups, self.buffers))

    @property
    def kept_alive(self) -> list[KeptOriginal]:
        """The original shard storages a held reference keeps alive now."""
        for b in self.buffers:
            b.kept.refresh()
        return [k for b in self.buffers for k in b.kept.originals]

    @property
    def kept_alive_count(self) -> int:
        return len(self.kept_alive)

    def __repr__(self) -> str:
        adopted = sum(b.adopted for b in self.buffers)
        pools = sum(len(b.buckets) for b in self.buffers)
        kept = sum(len(b.kept) for b in self.buffers)
        hooks = "hooks installed" if self._handles else "no hooks"
        name = _user_class(self.module).__name__
        return (f"FusedModule({name}: {adopted}/{len(self.groups)} groups "
                f"fused in {pools} pool(s), valid={self.is_valid()}, {kept} original(s) kept "
                f"alive, {self.readoptions} re-adoption(s), on_pinned={self.on_pinned!r}, "
                f"{hooks})")

    def install_hooks(self) -> None:
        def pre_forward(*_: Any) -> None:
            if tc.in_backward():  # activation checkpointing's recompute: nothing may move
                return
            # FSDP2's lazy init can move shards (torch 2.7 re-pads uneven ones into fresh
            # memory): run it first, so the check sees where the all-gather will read.
            lazy_init(self.module)
            with torch.no_grad():
                self.revalidate()

        def post_load(*_: Any) -> None:
            # With ``assign=True`` the caller's state dict pins the new tensors until
            # ``load_state_dict`` returns: the pre-forward hook re-adopts them then.
            with torch.no_grad():
                try:
                    self.revalidate(on_pinned="raise")
                except FlatPoolError as e:
                    self.deferred += 1
                    logger.info("re-adoption after load_state_dict put off to the next "
                                "forward: %s", type(e).__name__)

        self._handles.append(self.module.register_forward_pre_hook(pre_forward, prepend=True))
        self._handles.append(self.module.register_load_state_dict_post_hook(post_load))  # type: ignore[no-untyped-call]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def fuse_fully_sharded(
    module: nn.Module,
    *,
    alignment: int = 1,
    keep_valid: bool = True,
    materialize: bool = True,
    on_pinned: OnPinned = "warn",
) -> FusedModule:
    """Adopt the shards of every param group of ``module`` (after ``fully_shard``).

    Groups all on meta are materialized zero-copy into their pools (initialize them with
    ``reset_parameters()`` or ``load_state_dict``, *not* ``to_empty``) unless ``materialize`` is
    false. ``keep_valid`` installs the hooks. ``on_pinned="warn"`` (default) fuses past a held
    reference to an original, keeping it alive; ``"raise"`` raises ``PinnedStorageError``.
    """
    def fuse() -> FusedModule:
        fused = FusedModule(module, alignment, on_pinned)
        with torch.no_grad():
            fused._adopt_all(materialize)
        return fused

    # One gc pause over the whole fusion, its per-group records included: an automatic pass
    # set off by them would scan the model's whole heap (see docs/performance.md, "Fusion").
    # Taken and let go with signals deferred, as adopt_groups' own.
    fused = guarded_call(fuse, gc_paused())
    if keep_valid:
        fused.install_hooks()
    return fused


def fused_pools(fused: FusedModule) -> list[FlatPool]:
    """Every pool of every adopted group of ``fused``, in group and bucket order."""
    return [b.pool for buf in fused.buffers if buf.adopted for b in buf.buckets]


def flat_optimizer(fused: FusedModule, optimizer: torch.optim.Optimizer, **kwargs: Any) -> FlatOptimizer:
    """A :class:`FlatOptimizer` over ``fused``'s pools, hooked on the root module. Each group's
    reduce-scatter writes into its gradient pool and FSDP2's own ``.grad`` views are the pooled
    gradients (:mod:`._reduce_scatter`); groups where that cannot be exact (warned) keep the
    pre-installed pooled ``.grad`` that FSDP2 adds its reduce-scatter results into."""
    fo = FlatOptimizer(optimizer, lambda: fused_pools(fused), module=fused.module, **kwargs)
    reduce_into_pools(fused, fo)
    return fo


__all__ = ["FusedModule", "flat_optimizer", "fsdp_param_groups", "fuse_fully_sharded",
           "fused_pools", "lazy_init"]
