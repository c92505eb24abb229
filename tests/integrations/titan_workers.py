"""2-rank gloo scenarios of test_torchtitan.py: the recipe through the stand-in trainer vs the same
trainer without flatpool. Each raises ``AssertionError`` on failure."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flatpool import FlatStepWarning
from flatpool.errors import UnfusedGroupWarning
from flatpool.integrations.hsdp import TorchtitanRecipe
from scenario_runs import run_scenarios
from titan_standins import JobConfig, ModelSpec, build, model_state_dict, parallelize
from titan_standins import schedulers, train

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
    job = JobConfig(implementation=implementation)  # the user's kernel is the reference
    ref_calls: list[str] = []
    ref_parts, ref_opt = build(_spec(ref_calls), mesh, job)
    ref = train(ref_parts, ref_opt, schedulers(ref_opt), range(STEPS), rank)

    calls: list[str] = []
    recipe = TorchtitanRecipe()
    spec = recipe.apply(_spec(calls))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        parts, optimizers = build(spec, mesh, JobConfig(implementation=implementation))
        got = train(parts, optimizers, schedulers(optimizers), range(STEPS), rank)
    assert not [w for w in said if issubclass(w.category, UnfusedGroupWarning)], \
        [str(w.message) for w in said]
    flat_warned = [w for w in said if issubclass(w.category, FlatStepWarning)]
    if implementation == "fused":  # float32 fused: torch's own fused step, and it says so
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
    # bit-identical to the same loop without flatpool, with the kernel the user chose
    assert got[0] == ref[0], (got[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


def _shared_dir() -> str:
    path = [tempfile.mkdtemp(prefix="flatpool-titan-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    return str(path[0])


def resume(mesh: DeviceMesh) -> None:
    """Saved mid-training through DCP (the parts' merged model state, the container's flattened
    optimizer state) and resumed in a job built the same way, in the same order: bit-identical
    to the run that never stopped (without flatpool)."""
    rank, half = dist.get_rank(), STEPS // 2
    job = JobConfig(implementation="foreach")
    ref_parts, ref_opt = build(_spec([]), mesh, job)
    ref = train(ref_parts, ref_opt, schedulers(ref_opt), range(STEPS), rank)

    parts, optimizers = build(TorchtitanRecipe().apply(_spec([])), mesh, job)
    lr = schedulers(optimizers)
    train(parts, optimizers, lr, range(half), rank)
    path = _shared_dir()
    try:
        dcp.save({"model": model_state_dict(parts), "optimizer": optimizers.state_dict()},
                 checkpoint_id=path)
        dist.barrier()
        recipe = TorchtitanRecipe()
        parts2, optimizers2 = build(recipe.apply(_spec([])), mesh, job)
        lr2 = schedulers(optimizers2)
        for mine, saved in zip(lr2, lr):
            mine.load_state_dict(saved.state_dict())
        sd = {"model": model_state_dict(parts2), "optimizer": optimizers2.state_dict()}
        dcp.load(sd, checkpoint_id=path)  # as torchtitan's CheckpointManager.load
        for part in parts2:  # as torchtitan's ModelWrapper (each part takes its own keys)
            set_model_state_dict(part, sd["model"], options=StateDictOptions(strict=False))
        optimizers2.load_state_dict(sd["optimizer"])
        del sd
        got = train(parts2, optimizers2, lr2, range(half, STEPS), rank)
        assert got[0] == ref[0][half:], (got[0], ref[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
        assert all(f.is_valid() for f in recipe.fused), recipe.fused
        assert all(fo.segments and not fo.fallback for fo in recipe.flat), \
            [fo.reasons for fo in recipe.flat]
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def run_all() -> dict[str, str | None]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases: dict[str, Callable[[], None]] = {
        "recipe-foreach": lambda: recipe_vs_plain(mesh, "foreach"),
        "recipe-fused-default": lambda: recipe_vs_plain(mesh, "fused"),
        "recipe-dcp-resume": lambda: resume(mesh),
    }
    return run_scenarios(cases)


__all__ = ["run_all"]
