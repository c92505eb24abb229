"""2-rank gloo scenarios of test_torchtitan.py: the recipe through the stand-in trainer vs the same
trainer without flatpool. Each raises ``AssertionError`` on failure."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flatpool import FlatStepWarning
from flatpool.errors import UnfusedGroupWarning
from flatpool.integrations.hsdp import TorchtitanRecipe
from scenario_runs import run_scenarios
from titan_standins import JobConfig, ModelSpec, build, parallelize, train

STEPS = 5


def _spec(calls: list[str]) -> ModelSpec:
    """The spec as a model registers it, with a post_optimizer_build_fn of its own (torchtitan's
    MoE load balancing registers a step pre-hook on the container this way)."""
    def own(optimizers: torch.optim.Optimizer, model_parts: list[torch.nn.Module],
            parallel_dims: object) -> None:
        optimizers.register_step_pre_hook(lambda *_: calls.append("pre-step"))

    return ModelSpec("stand-in", parallelize, None, own)


def recipe_vs_plain(mesh: DeviceMesh, implementation: str) -> None:
    rank = dist.get_rank()
    job = JobConfig(implementation="foreach")
    ref_calls: list[str] = []
    ref = train(*build(_spec(ref_calls), mesh, job), STEPS, rank)

    calls: list[str] = []
    recipe = TorchtitanRecipe()
    spec = recipe.apply(_spec(calls))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        parts, optimizers = build(spec, mesh, JobConfig(implementation=implementation))
        got = train(parts, optimizers, STEPS, rank)
    assert not [w for w in said if issubclass(w.category, UnfusedGroupWarning)], \
        [str(w.message) for w in said]
    flat_warned = [w for w in said if issubclass(w.category, FlatStepWarning)]
    if implementation == "fused":  # the flat step runs foreach math, and says so
        assert flat_warned and "fused" in str(flat_warned[0].message), \
            [str(w.message) for w in said]
    else:
        assert not flat_warned, [str(w.message) for w in flat_warned]
    # both parts fused and valid, each inner optimizer stepped flat, every group planned flat
    assert [f.module for f in recipe.fused] == parts
    assert all(f.is_valid() for f in recipe.fused), recipe.fused
    assert [fo.optimizer for fo in recipe.flat] == optimizers.optimizers
    assert all(fo.segments and not fo.fallback for fo in recipe.flat), \
        [fo.reasons for fo in recipe.flat]
    assert calls == ref_calls == ["pre-step"] * STEPS  # the spec's own hook still runs
    # bit-identical to the same loop without flatpool (foreach: what the flat step computes)
    assert got[0] == ref[0], (got[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


def run_all() -> dict[str, str | None]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases: dict[str, Callable[[], None]] = {
        "recipe-foreach": lambda: recipe_vs_plain(mesh, "foreach"),
        "recipe-fused-default": lambda: recipe_vs_plain(mesh, "fused"),
    }
    return run_scenarios(cases)


__all__ = ["run_all"]
