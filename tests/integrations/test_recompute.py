"""Activation checkpointing (issue 42 item 2): its recompute runs the forward hooks again inside
autograd's backward, where no storage may move. A group skipped for its structure is never
tried again, and nothing is tried from inside backward: no "fusion failed" warning, training as
on plain FSDP2. A group skipped for a passing reason (meta shards) is still adopted at the next
real forward (2 ranks: on one rank every group is skipped for its structure)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from examples.launch import launch
from flatpool.errors import UnfusedGroupWarning
from flatpool.integrations.hsdp import fuse_fully_sharded


class Checkpointed(nn.Module):
    """``model[0]`` runs under non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.model[0], x, use_reentrant=False)
        return self.model[1](torch.tanh(h))


def _train(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(3, 4, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]


def _build(mesh: Any) -> Checkpointed:
    torch.manual_seed(0)
    model = Checkpointed()
    fully_shard(model.model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_world_size_one_under_checkpoint_warns_nothing(single_rank_mesh: Any) -> None:
    ref = _train(_build(single_rank_mesh))
    model = _build(single_rank_mesh)
    fused = fuse_fully_sharded(model.model[0])
    skipped = fused.buffers[0]
    assert skipped.skipped is not None and skipped.skipped.startswith("shard world size is 1")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = _train(model)
    unfused = [str(w.message) for w in said if issubclass(w.category, UnfusedGroupWarning)]
    assert unfused == []
    assert not [w for w in said if "backward pass" in str(w.message)]
    assert fused.buffers[0] is skipped  # never tried again: the same record, step after step
    assert skipped.final
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_structural_skip_is_not_retried(single_rank_mesh: Any) -> None:
    model = _build(single_rank_mesh)
    fused = fuse_fully_sharded(model, keep_valid=False)
    before = list(fused.buffers)
    fused.revalidate()
    assert all(a is b for a, b in zip(fused.buffers, before))


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, str | None]]:
    import recompute_workers

    return launch(recompute_workers.run_all, world_size=2, timeout_s=300)


@pytest.mark.parametrize("name", ["revalidate-in-backward", "meta-then-checkpointed-training"])
def test_two_ranks(two_ranks: list[dict[str, str | None]], name: str) -> None:
    outcomes = [r.get(name, "not run") for r in two_ranks]
    assert outcomes == [None, None], "\n".join(o or "" for o in outcomes)


def test_strict_revalidate_in_backward_raises_and_changes_nothing(single_rank_mesh: Any) -> None:
    """``on_pinned="raise"`` keeps explicit calls strict: inside backward a group that would be
    worked on raises the engine's typed error, and the group's record is unchanged."""
    from flatpool import AdoptionError
    from flatpool.integrations.hsdp import GroupBuffers

    model = _build(single_rank_mesh)
    fused = fuse_fully_sharded(model.model[0], keep_valid=False)
    transient = GroupBuffers(skipped="not adopted yet")  # as a retriable group looks
    fused.buffers[0] = transient
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    raised: list[BaseException] = []

    def strict(_: torch.Tensor) -> None:
        try:
            fused.revalidate(on_pinned="raise")
        except AdoptionError as e:
            raised.append(e)

    y.register_hook(strict)
    y.sum().backward()
    assert len(raised) == 1 and "backward pass is running" in str(raised[0])
    assert fused.buffers[0] is transient
    fused.revalidate()  # outside backward: tried (and skipped for world size 1, for good)
    assert fused.buffers[0].final
