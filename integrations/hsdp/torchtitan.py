"""torchtitan's two hook points, wired to flatpool without a trainer edit (torchtitan not imported).

torchtitan builds each model part on meta, calls ``parallelize_fn(model, parallel_dims,
job_config)`` (``fully_shard`` happens there; pipelining calls it once per stage), then
``to_empty`` and ``init_weights``, builds an ``OptimizersContainer`` (one optimizer per model
part; itself an ``Optimizer`` whose ``step()`` loops over them) and calls
``post_optimizer_build_fn(optimizers, model_parts, parallel_dims)``. The recipe fuses in the
first hook, unmaterialized (``to_empty`` comes next and would move materialized shards out
again), and in the second adopts the now initialized shards and hands each *inner* optimizer to
:func:`flat_optimizer`, after the spec's own ``post_optimizer_build_fn``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from flatpool import InvalidRequestError, InvalidTypeError, OnPinned
from flatpool._warn import logger
from flatpool.optim import FlatOptimizer
from flatpool.ownership import check_policy

from .fsdp2 import FusedModule, flat_optimizer, fuse_fully_sharded, lazy_init

S = TypeVar("S")
ParallelizeFn = Callable[..., nn.Module]
PostOptimizerBuildFn = Callable[..., None]


class TorchtitanRecipe:
    """flatpool for one torchtitan job: :meth:`apply` returns the model (or train) spec with its
    ``parallelize_fn`` and ``post_optimizer_build_fn`` wrapped; ``fused`` and ``flat`` then hold
    what the two hooks made, in model-part order. ``flat_kwargs`` go to :class:`FlatOptimizer`
    (its default ``fused="exact"`` keeps a ``fused=True`` optimizer's kernel: docs/optim.md)."""

    def __init__(self, *, alignment: int = 1, on_pinned: OnPinned = "warn",
                 **flat_kwargs: Any) -> None:
        self.alignment = alignment
        self.on_pinned: OnPinned = check_policy(on_pinned)  # refused now, not mid-build
        self.flat_kwargs = flat_kwargs
        self.fused: list[FusedModule] = []
        self.flat: list[FlatOptimizer] = []

    def apply(self, spec: S) -> S:
        """A copy of ``spec`` (a dataclass, as torchtitan's specs are) with both hooks wrapped."""
        names = {f.name for f in dataclasses.fields(spec)} if dataclasses.is_dataclass(spec) else set()
        missing = {"parallelize_fn", "post_optimizer_build_fn"} - names
        if missing:
            raise InvalidTypeError(
                f"{type(spec).__name__} is not a torchtitan spec with {sorted(missing)}: pass the "
                "ModelSpec/TrainSpec whose trainer calls post_optimizer_build_fn")
        return dataclasses.replace(  # type: ignore[type-var]
            spec, parallelize_fn=self.parallelize(getattr(spec, "parallelize_fn")),
            post_optimizer_build_fn=self.post_optimizer_build(
                getattr(spec, "post_optimizer_build_fn")))

    def parallelize(self, parallelize_fn: ParallelizeFn) -> ParallelizeFn:
        """``parallelize_fn``, then :func:`fuse_fully_sharded` of the part it returns."""
        def parallelize(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            out = parallelize_fn(model, *args, **kwargs)
            if isinstance(out, FSDPModule):
                self.fused.append(fuse_fully_sharded(
                    out, alignment=self.alignment, materialize=False, on_pinned=self.on_pinned))
            else:  # no data-parallel sharding in this job: nothing to fuse, nothing changed
                logger.info("torchtitan recipe: %s is not fully_shard-ed, left as it is",
                            type(out).__name__)
            return out

        return parallelize

    def post_optimizer_build(self, previous: PostOptimizerBuildFn | None) -> PostOptimizerBuildFn:
        """``previous`` (the spec's own, if any), then a flat optimizer per fused model part."""
        def post_optimizer_build(optimizers: torch.optim.Optimizer, model_parts: list[nn.Module],
                                 parallel_dims: Any, *args: Any, **kwargs: Any) -> None:
            pairs = self._pairs(optimizers, model_parts)  # checked before anything runs
            if previous is not None:
                previous(optimizers, model_parts, parallel_dims, *args, **kwargs)
            for fused, opt in pairs:
                lazy_init(fused.module)  # as the first forward would, before adopting
                with torch.no_grad():
                    fused.revalidate()  # to_empty + init_weights ran: adopt now, plan flat now
                self.flat.append(flat_optimizer(fused, opt, **self.flat_kwargs))

        return post_optimizer_build

    def _pairs(self, optimizers: torch.optim.Optimizer,
               model_parts: Sequence[nn.Module]) -> list[tuple[FusedModule, torch.optim.Optimizer]]:
        """(fused part, its optimizer) for each fused part: torchtitan's container keeps
        ``optimizers[i]`` for ``model_parts[i]``."""
        inner = getattr(optimizers, "optimizers", None)
        if not isinstance(inner, list):
            raise InvalidTypeError(
                f"{type(optimizers).__name__} has no list `optimizers`: pass torchtitan's "
                "OptimizersContainer (its inner optimizers are what flatpool steps)")
        if len(inner) != len(model_parts):
            raise InvalidRequestError(
                f"{len(inner)} optimizers for {len(model_parts)} model parts: the recipe needs one "
                "per part (early_step_in_backward steps one per parameter inside backward, which "
                "flatpool cannot); turn that off or leave post_optimizer_build_fn unwrapped")
        by_part = {id(f.module): f for f in self.fused}
        pairs = []
        for i, (part, opt) in enumerate(zip(model_parts, inner)):
            fused = by_part.get(id(part))
            if fused is not None:
                pairs.append((fused, opt))
            elif isinstance(part, FSDPModule):
                raise InvalidRequestError(
                    f"model part {i} ({type(part).__name__}) is fully_shard-ed but was not fused: "
                    "its parallelize_fn is not the recipe's; build it from recipe.apply(spec)")
        return pairs


__all__ = ["TorchtitanRecipe"]
