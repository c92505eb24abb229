"""The torchtitan recipe (issue 42 item 5) at torchtitan's two hook points, against stand-ins as
hostile as the real spec and ``OptimizersContainer`` (tests/integrations/titan_standins.py):
2 gloo ranks, two model parts under activation checkpointing, trained bit-identical to the same
loop without flatpool; and the bad inputs, refused before anything changed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from examples.launch import launch
from flatpool import InvalidRequestError, InvalidTypeError
from flatpool.integrations.hsdp import TorchtitanRecipe
from titan_standins import JobConfig, ModelSpec, OptimizersContainer, ParallelDims, Stage
from titan_standins import build_optimizers, parallelize


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, str | None]]:
    import titan_workers

    return launch(titan_workers.run_all, world_size=2, timeout_s=300)


@pytest.mark.parametrize("name", ["recipe-foreach", "recipe-fused-default", "recipe-dcp-resume"])
def test_two_ranks(two_ranks: list[dict[str, str | None]], name: str) -> None:
    outcomes = [r.get(name, "not run") for r in two_ranks]
    assert outcomes == [None, None], "\n".join(o or "" for o in outcomes)


def test_apply_refuses_what_is_not_a_spec() -> None:
    with pytest.raises(InvalidTypeError, match="post_optimizer_build_fn"):
        TorchtitanRecipe().apply(object())


def test_a_bad_policy_is_refused_at_once() -> None:
    with pytest.raises(InvalidRequestError, match="on_pinned"):
        TorchtitanRecipe(on_pinned="bogus")  # type: ignore[arg-type]


def test_apply_keeps_the_spec_as_it_was() -> None:
    spec = ModelSpec("stand-in", parallelize, None, None)
    wrapped = TorchtitanRecipe().apply(spec)
    assert spec.parallelize_fn is parallelize and spec.post_optimizer_build_fn is None
    assert wrapped is not spec and wrapped.parallelize_fn is not parallelize


def _parts(spec: ModelSpec, mesh: Any) -> list[nn.Module]:
    parts = []
    for widths in ((4, 3), (3, 2)):
        with torch.device("meta"):
            model = Stage(widths)
        # (the keyword form of newer trainers; the 2-rank job calls it positionally)
        model = spec.parallelize_fn(model, parallel_dims=ParallelDims(mesh), job_config=JobConfig())
        model.to_empty(device="cpu")
        parts.append(model)
    return parts


def _refused(recipe: TorchtitanRecipe, spec: ModelSpec, optimizers: torch.optim.Optimizer,
             parts: list[nn.Module], error: type[Exception], match: str) -> None:
    steps = [type(o).step for o in getattr(optimizers, "optimizers", [])]
    with pytest.raises(error, match=match):
        spec.post_optimizer_build_fn(optimizers, parts, None)  # type: ignore[misc]
    assert recipe.flat == []  # nothing made, each optimizer's step its own
    assert [type(o).step for o in getattr(optimizers, "optimizers", [])] == steps
    assert all("step" not in vars(o) for o in getattr(optimizers, "optimizers", []))


def test_one_optimizer_per_parameter_is_refused(single_rank_mesh: Any) -> None:
    calls: list[str] = []
    recipe = TorchtitanRecipe()
    spec = recipe.apply(ModelSpec("stand-in", parallelize, None,
                                  lambda *a: calls.append("own")))
    parts = _parts(spec, single_rank_mesh)
    per_param = build_optimizers(parts, JobConfig())
    per_param.optimizers = [torch.optim.AdamW([p]) for part in parts for p in part.parameters()]
    _refused(recipe, spec, per_param, parts, InvalidRequestError, "one per part")
    assert calls == []  # refused before the spec's own hook ran


def test_a_part_parallelized_without_the_recipe_is_refused(single_rank_mesh: Any) -> None:
    recipe = TorchtitanRecipe()
    spec = recipe.apply(ModelSpec("stand-in", parallelize, None, None))
    parts = _parts(spec, single_rank_mesh)
    with torch.device("meta"):
        stray = parallelize(Stage((3, 2)), ParallelDims(single_rank_mesh), JobConfig())
    stray.to_empty(device="cpu")
    parts[1] = stray
    _refused(recipe, spec, build_optimizers(parts, JobConfig()), parts, InvalidRequestError,
             "not fused")


def test_a_container_without_inner_optimizers_is_refused(single_rank_mesh: Any) -> None:
    recipe = TorchtitanRecipe()
    spec = recipe.apply(ModelSpec("stand-in", parallelize, None, None))
    parts = _parts(spec, single_rank_mesh)
    plain = torch.optim.AdamW([p for part in parts for p in part.parameters()])
    _refused(recipe, spec, plain, parts, InvalidTypeError, "OptimizersContainer")


def test_a_part_without_fully_shard_is_left_alone() -> None:
    recipe = TorchtitanRecipe()
    spec = recipe.apply(ModelSpec("stand-in", lambda m, *a: m, None, None))
    part = spec.parallelize_fn(Stage((4, 3)), None, JobConfig())
    optimizers = OptimizersContainer([part], torch.optim.AdamW, {"foreach": True})
    spec.post_optimizer_build_fn(optimizers, [part], None)  # type: ignore[misc]
    assert recipe.fused == [] and recipe.flat == []
