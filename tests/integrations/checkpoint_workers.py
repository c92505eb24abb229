"""Checkpoint scenarios on every rank of the real 2-rank FSDP2 job (see hsdp_workers.run_all).

torch.distributed.checkpoint (DCP) saves a fused model and loads it back into a fused target,
built eagerly or on meta and materialized into its pools; plain ``torch.save`` of a fused
model's sharded state dict writes its shards' own bytes. Each scenario raises AssertionError
on failure.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from flatpool import local_tensor
from flatpool.integrations.hsdp.fsdp2 import FusedModule

from hsdp_workers import build, check_aliasing, refuse_if_torch_does, train


def _shared_dir() -> str:
    """A fresh directory every rank agrees on (rank 0 makes it)."""
    made = tempfile.mkdtemp(prefix="flatpool-dcp-") if dist.get_rank() == 0 else None
    box: list[str | None] = [made]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _locals(model: nn.Module) -> list[tuple[int, int]]:
    """Where every parameter's local shard lives (storage identity, offset)."""
    out = []
    for p in model.parameters():
        t = local_tensor(p)
        out.append((int(t.untyped_storage()._cdata), int(t.storage_offset())))
    return out


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for k, v in model.state_dict().items()}


def dcp_round_trip(mesh: DeviceMesh, name: str, target: str) -> None:
    """Save a trained fused model with DCP; load it into a fused ``target`` ("adopt"|"meta")."""
    refuse_if_torch_does(name, mesh)
    src, src_fused, _ = build(name, mesh, "adopt")
    assert src_fused is not None
    train(name, src, "adam")
    ref, _, _ = build(name, mesh, "ref")  # the same weights, never fused: the size reference
    ref.load_state_dict({k: v.detach().clone() for k, v in src.state_dict().items()})
    path, ref_path = _shared_dir(), _shared_dir()
    try:
        dcp.save(src.state_dict(), checkpoint_id=path)
        dcp.save(ref.state_dict(), checkpoint_id=ref_path)
        dist.barrier()
        if dist.get_rank() == 0:
            got, want = _dir_bytes(path), _dir_bytes(ref_path)
            assert abs(got - want) <= 4096, f"fused checkpoint {got} B vs unfused {want} B"

        model, fused, _ = build(name, mesh, target)
        assert isinstance(fused, FusedModule) and fused.is_valid()
        where = _locals(model)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state)
        assert fused.is_valid(), "pool not valid after the DCP load"
        assert _locals(model) == where, "the load moved a shard out of its slice"
        want_full = _full(src)
        for k, v in _full(model).items():
            assert torch.equal(v, want_full[k]), f"{k} not loaded"
        check_aliasing(model, fused, None)
        # training continues exactly as the source would
        a, b = train(name, model, "sgd_momentum"), train(name, src, "sgd_momentum")
        assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
        check_aliasing(model, fused, a[2])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(ref_path, ignore_errors=True)


def torch_save_local_shards(mesh: DeviceMesh, name: str) -> None:
    """``torch.save`` of a fused model's local shards writes each shard's own bytes.

    (``torch.save`` of the DTensors themselves fails in torch 2.13 for any DTensor whose local
    tensor starts at a non-zero storage offset, pool or not; see docs/checkpoints.md.)
    """
    refuse_if_torch_does(name, mesh)
    model, fused, _ = build(name, mesh, "adopt")
    assert fused is not None
    ref, _, _ = build(name, mesh, "ref")
    pools = [pl for b in fused.buffers for pl in b.pools()]

    def shards(m: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in m.state_dict().items()}

    def saved(m: nn.Module) -> bytes:
        buf = io.BytesIO()
        torch.save(shards(m), buf)
        return buf.getvalue()

    assert all(any(pl.owns(v) for pl in pools) for v in shards(model).values())
    got, want = saved(model), saved(ref)
    assert abs(len(got) - len(want)) <= 2048, f"fused {len(got)} B vs unfused {len(want)} B"
    loaded = torch.load(io.BytesIO(got), weights_only=True)
    for k, v in shards(model).items():
        assert torch.equal(loaded[k], v), k
        assert loaded[k].untyped_storage().nbytes() == v.numel() * v.element_size(), k


def scenarios(mesh: DeviceMesh) -> dict[str, Callable[[], None]]:
    return {
        "dcp-two_dtypes-eager": lambda: dcp_round_trip(mesh, "two_dtypes", "adopt"),
        "dcp-mlp_bias-meta": lambda: dcp_round_trip(mesh, "mlp_bias", "meta"),
        "torch_save-two_dtypes": lambda: torch_save_local_shards(mesh, "two_dtypes"),
    }
