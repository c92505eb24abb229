"""Checkpoints after ``del pool`` (issue 18.8): the storage outlives the pool object.

Adopted tensors keep the pool's storage alive once the pool object is gone; they still view a
part of one big buffer that may hold several dtypes. Before, compaction needed the live pool:
a Linear's state_dict wrote the whole 16 MiB buffer, a BatchNorm's raised torch's raw
``RuntimeError`` (two dtypes, one storage).
"""

from __future__ import annotations

import copy
import gc
import io

import torch
from torch import nn

import flatpool
from flatpool import FlatPool, checkpoint

MiB = 1 << 20
SLACK = 1024


def saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def orphaned(module: nn.Module, capacity: int | None = None) -> nn.Module:
    """``module`` adopted into a pool that is then dropped (and collected)."""
    pool = FlatPool(name="gone", capacity=capacity)
    pool.adopt(list(module.parameters()) + list(module.buffers()))
    del pool
    gc.collect()
    assert not any(p.name == "gone" for p in flatpool.live_pools())
    return module


def test_linear_saves_its_own_bytes_after_del_pool() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(4, 4)
    lin = orphaned(copy.deepcopy(ref), capacity=16 * MiB)
    assert lin.weight.untyped_storage().nbytes() == 16 * MiB  # still the pool's buffer
    data = saved(lin.state_dict())
    assert len(data) < len(saved(ref.state_dict())) + SLACK, f"{len(data)} bytes written"
    back = torch.load(io.BytesIO(data), weights_only=True)
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())
    assert all(v.untyped_storage().nbytes() == v.nbytes for v in back.values())


def test_mixed_dtype_module_saves_after_del_pool() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.BatchNorm1d(8))
    model = orphaned(copy.deepcopy(ref))
    data = saved(model.state_dict())  # raised RuntimeError: two dtypes view one storage
    assert len(data) < len(saved(ref.state_dict())) + SLACK
    back = torch.load(io.BytesIO(data), weights_only=True)
    for k, v in ref.state_dict().items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_deepcopy_after_del_pool_costs_own_bytes() -> None:
    lin = orphaned(nn.Linear(4, 4), capacity=16 * MiB)
    snap = copy.deepcopy(lin.state_dict())
    for k, v in snap.items():
        assert v.untyped_storage().nbytes() == v.nbytes, k
        assert torch.equal(v, lin.state_dict()[k])
    snap["weight"].add_(1)  # independent of the old buffer
    assert not torch.equal(snap["weight"], lin.weight)


def test_the_rule_follows_the_storage_not_the_pool_object() -> None:
    """A live pool and a dropped pool's storage answer alike; an ordinary storage's view is
    left to torch (views of it still share their storage within one save)."""
    bias = orphaned(nn.Linear(4, 4)).state_dict()["bias"]  # a plain tensor, as saved
    assert checkpoint.pool_of(bias) is None  # no live pool ...
    assert checkpoint.pooled(bias)  # ... but still the pool's storage
    base = torch.arange(16.0)
    assert not checkpoint.pooled(base[4:8])
    both = torch.load(io.BytesIO(saved([base, base[4:8]])), weights_only=True)
    both[0][4] = -1.0
    assert both[1][0] == -1.0  # torch's own behaviour: the view shares its base's storage
