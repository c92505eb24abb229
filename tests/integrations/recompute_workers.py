"""2-rank gloo scenarios of test_recompute.py: a group skipped for a passing reason (meta shards)
under activation checkpointing. Each raises ``AssertionError`` on failure."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from flatpool import local_tensor
from flatpool.errors import UnfusedGroupWarning
from flatpool.integrations.hsdp import FusedModule, fuse_fully_sharded
from scenario_runs import run_scenarios
from test_recompute import Checkpointed, _train


def _on_meta(mesh: DeviceMesh, keep_valid: bool) -> tuple[Checkpointed, FusedModule]:
    """Built on meta and fused unmaterialized, then ``to_empty`` and initialized in place (as
    torchtitan does): the group is skipped for its meta shards until the next look."""
    torch.manual_seed(0)
    full = Checkpointed().state_dict()
    with torch.device("meta"):
        model = Checkpointed()
    fully_shard(model.model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    fused = fuse_fully_sharded(model.model[0], materialize=False, keep_valid=keep_valid)
    assert "meta shards" in (fused.buffers[0].skipped or ""), fused.buffers
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            local_tensor(p).copy_(distribute_tensor(full[name], mesh, [Shard(0)]).to_local())
    return model, fused


def _reference(mesh: DeviceMesh) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Checkpointed()
    fully_shard(model.model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train(model)


def revalidate_in_backward(mesh: DeviceMesh) -> None:
    """``revalidate()`` from a backward hook leaves the group as it is, without a warning; the
    next call outside backward adopts it."""
    model, fused = _on_meta(mesh, keep_valid=False)
    before = fused.buffers[0]
    x = torch.randn(3, 4, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: fused.revalidate())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        y.sum().backward()
    assert fused.buffers[0] is before, fused.buffers
    assert not [w for w in said if issubclass(w.category, UnfusedGroupWarning)], \
        [str(w.message) for w in said]
    fused.revalidate()
    assert fused.buffers[0].adopted and fused.is_valid(), fused.buffers
    del model


def meta_then_checkpointed_training(mesh: DeviceMesh) -> None:
    """The hooks adopt the group at the first real forward, the recompute's hook call does
    nothing, no warning, and training is bit-identical to plain FSDP2 with checkpointing."""
    ref = _reference(mesh)
    model, fused = _on_meta(mesh, keep_valid=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = _train(model)
    assert not [w for w in said if issubclass(w.category, UnfusedGroupWarning)], \
        [str(w.message) for w in said]
    assert fused.buffers[0].adopted and fused.is_valid(), fused.buffers
    assert fused.readoptions == 0
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def run_all() -> dict[str, str | None]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases: dict[str, Callable[[], None]] = {
        "revalidate-in-backward": lambda: revalidate_in_backward(mesh),
        "meta-then-checkpointed-training": lambda: meta_then_checkpointed_training(mesh),
    }
    return run_scenarios(cases)


__all__ = ["run_all"]
