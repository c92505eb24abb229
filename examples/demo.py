"""Demo: comm fusion without stale shard storages (the bug report's case, on FSDP2).

Run ``./scripts/demo.sh`` (or ``python -m examples.demo --help``). It starts
``--world-size`` ranks (CPU and gloo by default) and, on each, shards a two-layer model with
FSDP2. With the default sizes each of its two weights gives every rank a 4 MiB shard, as in the
report. Four modes are compared:

* ``no fusion``: FSDP2 as is; one storage per shard.
* ``naive rebase``: the bug. Shards are copied into a flat buffer and only
  ``_sharded_param_data`` is pointed at it: the old storages stay alive (2 x 4 MiB + 8 MiB)
  and training silently diverges (the optimizer updates what the all-gather no longer reads).
* ``flatpool adopt``: :func:`flatpool.integrations.hsdp.fuse_fully_sharded`. One 8 MiB pool, the old
  storages proven dead, training bit-identical.
* ``meta init``: built on meta and materialized straight into the pool, then loaded.

Each rank's table is printed on stdout; the process exits non-zero if a flatpool row fails its
checks. Rank 0 writes a ``progress:`` line per mode and training step to stderr. ``--png DIR``
draws each rank's memory, buggy mode beside flatpool, in ``DIR/rank<r>.png``. Under
``torchrun --nproc-per-node N -m examples.demo`` (or any launcher that sets
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``) every process runs one rank, rank 0 prints the
same tables, and every rank exits with the same code. ``--client hyperparallel``
(:mod:`.demo_hyperparallel`) does all of this in the HyperParallel simulation.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any
from collections.abc import Sequence

import torch
import torch.distributed as dist
from attrs import define
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from flatpool import local_tensor

from .census import OriginalStorages, live_storages
from flatpool.integrations.hsdp import FusedModule, fsdp_param_groups, fuse_fully_sharded, lazy_init
from .demo_run import Config, draw_panels, progress, run_client
from .naive import naive_rebase
from .table import mib
from .table import render as table_render
from .table import report as table_report

MODES = ("no fusion", "naive rebase", "flatpool adopt", "meta init")


class ZeroThreeCase(nn.Module):
    """Two weights, ``ffn x hidden`` each: 8 MiB in fp32 at the defaults, 4 MiB per rank."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up: nn.Linear = nn.Linear(hidden, ffn, bias=False)
        self.down: nn.Linear = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


@define(frozen=True)
class Row:
    mode: str
    storages: int
    live_bytes: int
    flat_bytes: int
    stale: int
    stale_bytes: int
    losses_match: bool
    params_match: bool
    checks: tuple[str, ...]
    """Failed checks of a flatpool row (empty when it passed); unused for the other rows."""
    not_fused: str = ""
    """Why ``fuse_fully_sharded`` left every group unfused by design (shard world size 1)."""


def full_state(cfg: Config) -> dict[str, torch.Tensor]:
    """The same initial full weights on every rank (seeded, then sharded)."""
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in ZeroThreeCase(cfg.hidden, cfg.ffn).state_dict().items()}


def build(mode: str, cfg: Config, mesh: DeviceMesh, init: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """Model after ``fully_shard`` and the mode's fusion step, the flats, the originals."""
    if mode == "meta init":
        with torch.device("meta"):
            model = ZeroThreeCase(cfg.hidden, cfg.ffn)
        fully_shard(model, mesh=mesh)
        fused = fuse_fully_sharded(model)  # materializes the meta shards into the pools
        sharded = {k: distribute_tensor(v.to(cfg.device), mesh, [Shard(0)]) for k, v in init.items()}
        model.load_state_dict(sharded)  # in place: writes into the pools
        params = [p for g in fsdp_param_groups(model) for p in g.fsdp_params]
        return model, params, [f for b in fused.buffers for f in b.flats()], None, fused
    model = ZeroThreeCase(cfg.hidden, cfg.ffn).to(cfg.device)
    model.load_state_dict({k: v.to(cfg.device) for k, v in init.items()})
    fully_shard(model, mesh=mesh)
    lazy_init(model)  # where HyperParallel builds its flat buffer
    params = [p for g in fsdp_param_groups(model) for p in g.fsdp_params]
    if mode == "no fusion":
        return model, params, [], None, None
    originals = OriginalStorages(params, [p._param_fqn or "?" for p in params])
    if mode == "naive rebase":
        flat = naive_rebase(params)
        return model, params, [flat], originals, None
    fused = fuse_fully_sharded(model)
    return model, params, [f for b in fused.buffers for f in b.flats()], originals, fused


def train(model: nn.Module, cfg: Config, mode: str = "") -> tuple[list[float], list[torch.Tensor]]:
    """``cfg.steps`` Adam steps on per-rank data; the losses and the final full parameters."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    losses = []
    rank = dist.get_rank()
    for step in range(cfg.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(cfg.batch, cfg.hidden, generator=g).to(cfg.device)
        y = torch.randn(cfg.batch, cfg.hidden, generator=g).to(cfg.device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        progress(f"{mode}: step {step + 1}/{cfg.steps}, loss {losses[-1]:.6f}")
    full = [p.full_tensor().cpu() if isinstance(p, DTensor) else p.cpu() for p in model.parameters()]
    return losses, full


PICTURED = ("naive rebase", "flatpool adopt")


def rank_main(cfg: Config) -> list[Row]:
    mesh = init_device_mesh(cfg.device, (cfg.world_size,))
    init = full_state(cfg)
    rows: list[Row] = []
    panels: list[tuple[str, Any]] = []
    ref: tuple[list[float], list[torch.Tensor]] | None = None
    for mode in MODES:
        progress(f"{mode}: building")
        model, params, flats, originals, fused = build(mode, cfg, mesh, init)
        if cfg.png is not None and mode in PICTURED:
            from flatpool.memory import capture

            pools = [pl for b in fused.buffers for pl in b.pools()] if fused is not None else []
            panels.append((mode, capture(roots={"model": model}, pools=pools, flats=flats,
                                         watch=originals or (), scan=False)))
        live = live_storages(params, flats)
        stale = originals.stale() if originals is not None else []
        checks: list[str] = []
        not_fused = _unfused_by_design(fused, cfg.world_size)
        if not_fused:
            fused = None  # nothing to check in a pool: training must still match
        if fused is not None:
            if not fused.is_valid():
                checks.append("members left their slices before training")
            pools = [pl for b in fused.buffers for pl in b.pools()]
            for name, prm in model.named_parameters():
                if not any(pl.owns(local_tensor(prm)) for pl in pools):
                    checks.append(f"module parameter {name} is not in the pool")
        result = train(model, cfg, mode)
        if ref is None:
            ref = result
        losses_match = result[0] == ref[0]
        params_match = all(torch.equal(a, b) for a, b in zip(result[1], ref[1]))
        if not_fused and not (losses_match and params_match):
            checks.append("training differs from no fusion")
        if fused is not None:
            if stale:
                checks.append(f"{len(stale)} original storage(s) still alive")
            if any(r.kind != "flat" for r in live):
                checks.append("a shard storage outside the pools is reachable")
            if not (losses_match and params_match):
                checks.append("training differs from no fusion")
            if not fused.is_valid():
                checks.append("members left their slices during training")
        rows.append(
            Row(
                mode,
                len(live),
                sum(r.nbytes for r in live),
                sum(r.nbytes for r in live if r.kind == "flat"),
                len(stale),
                sum(n for _, n in stale),
                losses_match,
                params_match,
                tuple(checks),
                not_fused,
            )
        )
        del model, params, flats, originals, fused
    if panels:
        draw_panels(cfg, panels)
    progress("every mode done; the ranks send their tables and exit")
    return rows


def _unfused_by_design(fused: FusedModule | None, world_size: int) -> str:
    """At shard world size 1 ``fuse_fully_sharded`` leaves every group unfused on purpose
    (nothing is all-gathered): the reason it gave, else ``""``."""
    if fused is None or world_size != 1 or not fused.buffers:
        return ""
    return "" if any(b.adopted for b in fused.buffers) else fused.buffers[0].skipped or ""


def render(rank: int, rows: Sequence[Row]) -> str:
    table = []
    for r in rows:
        same = r.losses_match and r.params_match
        if r.mode == "no fusion":
            verdict = "reference"
        elif r.mode == "naive rebase":
            verdict = "BUG (as reported)" if (r.stale or not same) else "bug not reproduced"
        else:
            verdict = ("FAIL: " + "; ".join(r.checks) if r.checks
                       else f"not fused, by design: {r.not_fused}" if r.not_fused else "ok")
        table.append((
            r.mode, str(r.storages), mib(r.live_bytes), mib(r.flat_bytes),
            "-" if r.mode == "no fusion" or r.not_fused else f"{r.stale} ({mib(r.stale_bytes)})",
            "identical" if same else ("DIVERGED" if not r.losses_match else "params differ"),
            verdict,
        ))
    return table_render(rank, table)


def parse(argv: Sequence[str] | None) -> Config:
    ap = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description="Comm fusion with and without stale shard storages, on FSDP2 ranks.",
    )
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or npu")
    ap.add_argument("--backend", default=None, help="default: gloo on cpu, nccl on cuda, hccl on npu")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    ap.add_argument("--ffn", type=int, default=2048, help="inner width (default 2048: 4 MiB shards)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--png", default=None, metavar="DIR",
                    help="write each rank's memory picture (the buggy mode beside flatpool's) "
                         "to DIR/rank<r>.png (needs matplotlib: pip install 'flatpool[viz]')")
    ap.add_argument("--client", choices=("fsdp2", "hyperparallel"), default="fsdp2",
                    help="fsdp2 (default) or hyperparallel (the simulation, docs' drop-in lines)")
    ap.add_argument("--optim", choices=("per-parameter", "flat"), default="per-parameter",
                    help="flat: also show what pooling saves per rank and per kind "
                         "(parameters, gradients, AdamW state: storages and bytes), with no "
                         "pools, parameters pooled, and all pooled (flatpool.optim)")
    a = ap.parse_args(argv)
    backend = a.backend or {"cuda": "nccl", "npu": "hccl"}.get(a.device.split(":")[0], "gloo")
    return Config(a.device, backend, a.world_size, a.hidden, a.ffn, a.batch, a.steps,
                  client=a.client, png=a.png, optim=a.optim)


def header(cfg: Config) -> str:
    per_weight = cfg.hidden * cfg.ffn * 4
    return (
        f"flatpool demo: {cfg.world_size} ranks on {cfg.device} ({cfg.backend}); two weights of "
        f"{cfg.ffn}x{cfg.hidden} fp32 ({mib(per_weight)} each, about {mib(per_weight // cfg.world_size)} "
        f"per rank); {cfg.steps} Adam steps per mode.\n"
        "Live shard storages are the distinct storages reachable from the FSDP2 params (padded\n"
        "data, local tensors, their autograd bases) plus the flat buffers; stale originals are\n"
        "the per-parameter storages that existed before fusion and are still alive after it.\n"
    )


def report(results: Sequence[Sequence[Row]], seconds: float) -> int:
    """Print every rank's table and the verdict; the exit code (1 if a flatpool row failed)."""
    return table_report(results, seconds, render,
                        "flatpool rows: no stale shard storage, training bit-identical to no fusion.")


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse(argv)
    if cfg.png is not None:
        from flatpool.memory import MissingExtraError, load_matplotlib

        try:
            load_matplotlib()  # before any rank starts: a missing extra is said at once
        except MissingExtraError as exc:
            print(f"--png: {exc}", file=sys.stderr)
            return 2
    if cfg.client == "hyperparallel":
        from . import demo_hyperparallel

        rc = demo_hyperparallel.main(cfg)
    else:
        rc = run_client(cfg, header, rank_main, report)
    if cfg.optim == "flat" and rc == 0:
        from . import optim_demo

        rc = optim_demo.main(["--steps", str(cfg.steps), "--world-size", str(cfg.world_size)])
    return rc


if __name__ == "__main__":
    sys.exit(main())
