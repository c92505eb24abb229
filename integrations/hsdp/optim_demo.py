"""Demo: what pooling saves, per kind of tensor (parameters, gradients, AdamW state), per rank.

Each rank trains the same FSDP2 model (one ``fully_shard`` group per layer) three times, on the
same data: with no pools (plain FSDP2 and a per-parameter ``foreach`` AdamW), with the
parameters pooled (:func:`fuse_fully_sharded`, one pool per group), and with everything pooled
(:func:`flatpool.integrations.hsdp.optim.flat_optimizer` adds one gradient pool and one pool per
state kind per group, and ``optimizer.step()`` steps each group with one AdamW kernel call). After the last step,
:func:`flatpool.census` (model and optimizer as roots) counts, per kind, the distinct storages
(memory allocations; tensors sharing one count once, and a pool is one) and their bytes. The
table says it per rank, with what pooling saves against no pools, and whether the three
trainings stayed bit-identical (step times: ``python -m benchmarks.run --only optim``).

    python -m flatpool.integrations.hsdp.optim_demo [--layers 8] [--hidden 64] [--steps 5]
    ./scripts/demo.sh --optim flat     # the same tables after the main demo's
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from attrs import define
from torch import nn

from flatpool import Census, census
from flatpool.memory.units import fmt_bytes

from .fsdp2 import fuse_fully_sharded
from .launch import launch
from .optim import flat_optimizer
from .table import render

CONFIGS = ("no pools", "parameters pooled", "all pooled")
"""The three trainings, in the table's column order."""
HEAD = ("kind", *CONFIGS, "pooling saves")
KINDS = (("parameters", "parameter"), ("gradients", "grad"), ("optimizer state", "optimizer state"))
"""Each row's name and the census role it counts."""

LEGEND = """\
no pools: plain FSDP2 and a per-parameter AdamW (foreach). parameters pooled: the same with
fuse_fully_sharded (one pool per group). all pooled: also flat_optimizer (per group, one
gradient pool and one pool per AdamW state kind; one foreach AdamW per group).
Each cell: the distinct storages (memory allocations) holding that kind of tensor on the rank
after the last step, as flatpool.census(model, optimizer) finds them, and their bytes; "pools"
when they are flatpool pools (a pool is one storage). Tensors sharing a storage count once:
without a gradient pool, a group's gradients are views of FSDP2's reduce-scatter output for the
group (a new one at every backward after zero_grad); the gradient pool stays, and FSDP2 adds
each reduce-scatter output into it. "pooling saves": no pools against all pooled. Pooling saves
allocations and AdamW's per-parameter step counters, not the tensors' bytes; the state pools
mirror the parameter pools, so on a rank whose shards FSDP2 pads (uneven sharding) they also
hold that padding (more bytes there)."""


@define(frozen=True)
class Usage:
    """What holds one kind of tensor on a rank: distinct storages, how many are pools, bytes."""

    storages: int
    pools: int
    nbytes: int

    def cell(self) -> str:
        if self.pools == self.storages and self.storages:
            what = f"{self.pools} pool{'s' * (self.pools != 1)}"
        else:
            what = f"{self.storages} storage{'s' * (self.storages != 1)}"
            if self.pools:
                what += f" ({self.pools} pools)"
        return f"{what}, {fmt_bytes(self.nbytes)}"


def usage(c: Census, role: str) -> Usage:
    """The storages of ``c`` that some tensor of ``role`` is on."""
    records = [r for r in c.records if role in r.roles]
    return Usage(len(records), sum(r.pool is not None for r in records),
                 sum(r.nbytes for r in records))


def saves(before: Usage, after: Usage) -> str:
    fewer, less = before.storages - after.storages, before.nbytes - after.nbytes
    storages = f"{fewer} of {before.storages} storages"
    nbytes = (f"{fmt_bytes(less)} less" if less > 0 else f"{fmt_bytes(-less)} more" if less
              else "same bytes")
    return f"{storages}, {nbytes}"


def _model(layers: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(hidden, hidden + 1) if i % 2 == 0 else
                           nn.Linear(hidden + 1, hidden) for i in range(layers)])


def _run(config: str, layers: int, hidden: int, steps: int) -> tuple[list[Usage], list[float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(layers, hidden)
    for layer in list(model.children())[:-1]:
        fully_shard(layer, mesh=mesh)  # one group per layer, the last one in the root's
    fully_shard(model, mesh=mesh)
    fused = fuse_fully_sharded(model) if config != "no pools" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    if fused is not None and config == "all pooled":
        flat_optimizer(fused, opt)  # from now on opt.step() is the flat step
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(8, hidden, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()  # the flat step when a flat optimizer was set up
        losses.append(loss.item())
        if step < steps - 1:
            opt.zero_grad()
    c = census(model, opt)
    return [usage(c, role) for _, role in KINDS], losses


def _total(kinds: Sequence[Usage]) -> Usage:
    return Usage(sum(u.storages for u in kinds), sum(u.pools for u in kinds),
                 sum(u.nbytes for u in kinds))


def _rank(layers: int, hidden: int, steps: int) -> str:
    runs = [_run(config, layers, hidden, steps) for config in CONFIGS]
    usages = [kinds + [_total(kinds)] for kinds, _ in runs]  # per config: each kind, the total
    names = [name for name, _ in KINDS] + ["total"]
    rows = [(name, *(u[k].cell() for u in usages), saves(usages[0][k], usages[-1][k]))
            for k, name in enumerate(names)]
    losses = [run_losses for _, run_losses in runs]
    verdicts = ["identical" if run_losses == losses[0] else "DIFFER" for run_losses in losses[1:]]
    same = all(v == "identical" for v in verdicts)
    rows.append(("losses", "-", *verdicts, "bit-identical training" if same else "TRAINING DIFFERS"))
    n = sum(1 for _ in _model(layers, hidden).parameters())
    title = f"{n} parameters in {layers} fully_shard groups, AdamW, {steps} steps"
    return render(dist.get_rank(), rows, HEAD, title)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flatpool.integrations.hsdp.optim_demo",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="an even number")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world-size", type=int, default=2)
    a = ap.parse_args(argv)
    tables = launch(_rank, a.layers, a.hidden, a.steps, world_size=a.world_size, timeout_s=300)
    for table in tables:
        print(table + "\n")
    print(LEGEND)
    if any("DIFFER" in t for t in tables):
        print("FAILED: pooling changed the training (losses differ from no pools)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["main"]
