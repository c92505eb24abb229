"""Demo: gradients and AdamW state per rank, per parameter vs in pools (2 gloo ranks, FSDP2).

Both rows fuse the shards with :func:`fuse_fully_sharded`; they differ in the optimizer. Per
parameter, every parameter has three AdamW state tensors of its own (``exp_avg``,
``exp_avg_sq``, ``step``) and a gradient (FSDP2's are views of one reduce-scatter output per
group and step, kept alive until ``zero_grad``; ``.grad`` tensors made by autograd are one
each). With :func:`flatpool.integrations.hsdp.optim.flat_optimizer` each (group, dtype) has one
gradient pool and one pool per state kind, and ``optimizer.step()`` is one AdamW kernel call per
group; the table also says whether the two trainings stayed bit-identical (step times:
``python -m benchmarks.run --only optim``).

    python -m flatpool.integrations.hsdp.optim_demo [--layers 8] [--hidden 64] [--steps 5]
    ./scripts/demo.sh --optim flat     # the same table after the main demo's
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from flatpool import census

from .fsdp2 import fuse_fully_sharded
from .launch import launch
from .optim import flat_optimizer
from .table import render

HEAD = ("optimizer", "parameters", "parameter storages", "gradient storages", "state storages",
        "losses vs per-parameter")


def _model(layers: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(hidden, hidden + 1) if i % 2 == 0 else
                           nn.Linear(hidden + 1, hidden) for i in range(layers)])


def _run(flat: bool, layers: int, hidden: int, steps: int) -> tuple[tuple[str, ...], list[float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(layers, hidden)
    for layer in list(model.children())[:-1]:
        fully_shard(layer, mesh=mesh)  # one group per layer, the last one in the root's
    fully_shard(model, mesh=mesh)
    fused = fuse_fully_sharded(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    if flat:
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
    roles: dict[str, int] = {}
    for r in census(model, opt).records:  # one record per distinct live storage
        for role in set(r.roles):
            roles[role] = roles.get(role, 0) + 1
    n = sum(1 for _ in model.parameters())
    row = ("flat (flatpool.optim)" if flat else "per parameter (foreach=True)", str(n),
           str(roles.get("parameter", 0)), str(roles.get("grad", 0)),
           str(roles.get("optimizer state", 0)))
    return row, losses


def _rank(layers: int, hidden: int, steps: int) -> str:
    ref_row, ref_losses = _run(False, layers, hidden, steps)
    flat_row, flat_losses = _run(True, layers, hidden, steps)
    rows = [ref_row + ("-",), flat_row + ("identical" if flat_losses == ref_losses else "DIFFER",)]
    return render(dist.get_rank(), rows, HEAD)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flatpool.integrations.hsdp.optim_demo",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="an even number")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world-size", type=int, default=2)
    a = ap.parse_args(argv)
    tables = launch(_rank, a.layers, a.hidden, a.steps, world_size=a.world_size, timeout_s=300)
    for table in tables:
        print(table)
    if any("DIFFER" in t for t in tables):
        print("FAILED: the flat optimizer's losses differ from the per-parameter ones",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["main"]
