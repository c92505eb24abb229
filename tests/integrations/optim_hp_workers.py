"""Flat optimizer steps in the HyperParallel simulation (2 gloo ranks): its group fused by the
drop-in lines, AdamW flat vs per-parameter ``foreach=True``, 20 steps, clipping, 2 micro-batches
accumulated before the reduce-scatter (HyperParallel's ``no_sync`` shape)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatpool import FlatPool, census, local_tensor
from examples.demo_hyperparallel import BUCKET_HOOKS, V1_HOOKS
from examples.hyperparallel_sim import Config, FullyShardUnit, skip_dtensor_dispatch
from examples.hyperparallel_sim.unit import batch
from flatpool.optim import FlatOptimizer
from scenario_runs import run_scenarios

STEPS = 20
MAX_NORM = 0.05
CONFIGS = {
    "v1-even": (Config(rows=8, cols=6, group="v1"), V1_HOOKS),
    "bucketed-padded": (Config(rows=9, cols=6, group="bucketed", setter="rebind", flavor="padded"),
                        BUCKET_HOOKS),
}


def pools_of(unit: FullyShardUnit) -> list[FlatPool]:
    group = unit.group
    holders = getattr(group, "all_gather_buckets", None) or [group]
    return [b.pool for h in holders for b in h._flatpool.buckets]


def train(cfg: Config, hooks: dict[str, Any], flat: bool) -> dict[str, Any]:
    unit = FullyShardUnit(cfg, **hooks)
    unit.lazy_init()
    params = list(unit.module.parameters())
    # The simulation's DTensor cannot run foreach ops on lists of wrappers, so the reference is
    # torch's per-parameter foreach AdamW over plain copies of the local shards, written back
    # into the (pooled) shards after each step.
    ref = [local_tensor(p).detach().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(params if flat else ref, lr=3e-2, weight_decay=0.1, foreach=True)
    fo: FlatOptimizer | None = None
    losses, clipped, outside = [], [], []
    rank = dist.get_rank()
    for step in range(STEPS):
        unit.lazy_init()
        unit.unshard()  # the newest group makes its buckets (and flat buffers) here
        if flat and fo is None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # every group steps flat
                fo = FlatOptimizer(opt, pools_of(unit))
            assert fo.segments and not fo.fallback, fo.reasons
        total = 0.0
        for micro in range(2):  # accumulate into the unsharded grads, one reduce-scatter
            x, y = batch(cfg, 2 * step + micro, rank)
            loss = nn.functional.mse_loss(unit.module(x), y) / 2
            loss.backward()
            total += loss.item()
        for p in unit.hsdp_params:
            p.reduce_scatter_grad()
        unit.reshard()
        with skip_dtensor_dispatch():
            if fo is None:
                for r, p in zip(ref, params):
                    r.grad = local_tensor(p.grad).detach().clone()
                    p.grad = None
                norm = torch.nn.utils.clip_grad_norm_(ref, MAX_NORM, foreach=True)
                opt.step()
                with torch.no_grad():
                    for r, p in zip(ref, params):
                        local_tensor(p).copy_(r)
            else:
                norm = fo.clip_grad_norm_(MAX_NORM)
                fo.step()  # copies the reduce-scatter's gradients in: they stay the .grads
            clipped.append(float(norm) > MAX_NORM)
            opt.zero_grad()
            if fo is not None:
                outside += [r.referrers for r in census(unit.module, opt).records if r.pool is None]
        losses.append(total)
    state = {(i, k): local_tensor(v).clone() for i, st in enumerate(opt.state_dict()["state"].values())
             for k, v in st.items()}
    pools = sorted(r.pool or "" for r in census(unit.module, opt).records) if flat else []
    return {"losses": losses, "params": [local_tensor(p).detach().clone() for p in params],
            "state": state, "clipped": clipped, "outside": outside, "pools": pools}


def compare(name: str) -> None:
    cfg, hooks = CONFIGS[name]
    ref = train(cfg, hooks, flat=False)
    got = train(cfg, hooks, flat=True)
    assert ref["losses"] == got["losses"], (ref["losses"], got["losses"])
    assert all(torch.equal(a, b) for a, b in zip(ref["params"], got["params"]))
    assert sorted(ref["state"]) == sorted(got["state"])
    assert all(torch.equal(ref["state"][k], got["state"][k]) for k in ref["state"])
    assert any(got["clipped"]) and got["clipped"] == ref["clipped"], got["clipped"]
    assert not got["outside"], got["outside"]  # between steps: no per-parameter storage
    # after zero_grad: one parameter pool and one per state kind (grads are None now)
    base = got["pools"][0]
    assert got["pools"] == [base] + [f"{base}/{k}" for k in ("exp_avg", "exp_avg_sq", "step")]


def run_all() -> dict[str, str | None]:
    return run_scenarios({name: lambda n=name: compare(n) for name in CONFIGS})


__all__ = ["CONFIGS", "run_all"]
