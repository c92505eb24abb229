"""The bug report's seed case on every rank of a 2-rank gloo job, attributed with
flatpool.memory: FSDP2 shards two fp32 weights of 2048x1024 elements (4 MiB per rank each),
then either the naive rebase (the bug) or flatpool's fusion runs; each rank returns the
attribution of its memory after each (a census record of its CPU storages)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from examples.census import member_tensors
from flatpool.integrations.hsdp.fsdp2 import fsdp_param_groups, fuse_fully_sharded, lazy_init
from examples.naive import naive_rebase
from flatpool.memory import MemoryAttribution, WatchedStorages, capture

MODES = ("naive rebase", "flatpool")


class SeedCase(nn.Module):
    """As in the demo: ``up`` is 2048x1024 and ``down`` 1024x2048, fp32, no bias."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(1024, 2048, bias=False)
        self.down = nn.Linear(2048, 1024, bias=False)


def attribute_mode(mode: str, mesh: DeviceMesh) -> MemoryAttribution:
    torch.manual_seed(0)
    model = SeedCase()
    fully_shard(model, mesh=mesh)
    lazy_init(model)
    params = [p for g in fsdp_param_groups(model) for p in g.fsdp_params]
    watch = WatchedStorages({p._param_fqn or "?": member_tensors(p) for p in params})
    roots: dict[str, object] = {"model": model}
    if mode == "naive rebase":
        flats = [naive_rebase(params)]
        pools = []
    else:
        fused = fuse_fully_sharded(model)
        pools = [pl for b in fused.buffers for pl in b.pools()]
        flats = [f for b in fused.buffers for f in b.flats()]
        roots["fused"] = fused  # walked through its attributes down to the FSDP2 params
    # scan=False: the record holds what the manifest names (a full gc scan adds only the
    # process's small unrelated tensors, as unattributed, and half a second)
    return capture(roots=roots, pools=pools, flats=flats, watch=watch, scan=False)


def seed_case() -> dict[str, MemoryAttribution]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, MemoryAttribution] = {}
    for mode in MODES:
        out[mode] = attribute_mode(mode, mesh)
        gc.collect()  # the mode's model is gone before the next one is built
    return out
