"""``demo --client hyperparallel``: the bug report's case in the HyperParallel simulation.

Each rank builds the report's two-weight unit (``--ffn`` x ``--hidden`` fp32 weights, sharded
on dim 0) in :mod:`examples.hyperparallel_sim` and trains it in six modes:

* ``no fusion``: per-parameter all-gathers (the reference).
* ``HyperParallel as shipped``: the V1 group with its own flat-buffer code and the DTensor
  whose ``.data`` setter is routed to the local tensor: the old shard storages stay alive
  next to the flat buffer (2 x 4 MiB + 8 MiB at the defaults), the Parameter reads stale memory.
* ``flatpool, V1 lines`` / ``flatpool, newest lines``: the drop-in lines of
  docs/integration.md (:class:`~.hyperparallel.V1Lines`, :class:`~.hyperparallel.BucketLines`)
  in the V1 group and in the newest bucketed group (newest DTensor, padded members).
* ``..., meta init``: the same after deferred init (``to_empty``; ``_local_tensor`` assigned
  to a meta wrapper, which adoption gives its slice).

The table has the FSDP2 demo's columns; a flatpool row fails when more than the pool is live,
an original survived, a Parameter wrapper does not alias its slice with the local shape, the
validity check was false after a step, the pool's storage is not exactly its capacity, or
training differs from no fusion.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from attrs import define, evolve

from flatpool import own_storage
from flatpool import _torch_compat as tc

from flatpool.integrations.hsdp import BucketLines, V1Lines
from .demo_run import Config, draw_panels, progress, run_client
from .hyperparallel_sim import Config as UnitConfig
from .hyperparallel_sim import FullyShardUnit, Originals, digest, live_storages, member_holders
from .hyperparallel_sim.dtensor import wrapper_local_geometry, wrapper_storage_key
from .table import mib
from .table import render as table_render
from .table import report as table_report

V1_HOOKS: dict[str, Callable[..., Any]] = {
    "init_flat": V1Lines._init_flat_param_buffer, "is_valid": V1Lines._is_flat_buffer_valid}
BUCKET_HOOKS: dict[str, Callable[..., Any]] = {
    "init_flat": BucketLines.init_flat_param_buffer, "is_valid": BucketLines.is_flat_buffer_valid}


DemoConfig = Config
"""The demo's options (:class:`.demo_run.Config`); this client reads device, backend,
world_size, hidden, ffn, steps and png."""

PICTURED = ("HyperParallel as shipped", "flatpool, V1 lines")
"""The modes drawn side by side with ``--png``: the reported bug, then the same V1 group
with flatpool's drop-in lines."""


class _AliveOriginals:
    """The unit's surviving originals as a :class:`flatpool.memory.StorageWatch`.

    :class:`~.hyperparallel_sim.Originals` keys storages by identity; the memory picture wants
    their addresses, read from the member tensors that still reach them.
    """

    def __init__(self, unit: FullyShardUnit, originals: Originals) -> None:
        self._unit, self._originals = unit, originals

    def alive_storages(self) -> list[tuple[str, int, int]]:
        alive = {k: name for name, _, k, ref in self._originals.refs if not ref.expired()}
        out: dict[int, tuple[str, int, int]] = {}
        for p in self._unit.hsdp_params:
            for role, t in member_holders(p):
                s = own_storage(t)
                if s is not None and tc.storage_key(s) in alive:
                    out.setdefault(tc.storage_key(s), (role, s.data_ptr(), s.nbytes()))
        return list(out.values())


@define(frozen=True)
class Row:
    mode: str
    storages: int
    live_bytes: int
    flat_bytes: int
    stale: int
    stale_bytes: int
    same_training: bool
    checks: tuple[str, ...]
    """Failed checks of a flatpool row (empty when it passed); unused for the other rows."""


def modes(rows: int, cols: int, device: str) -> list[tuple[str, UnitConfig, dict[str, Any]]]:
    shipped = UnitConfig(rows=rows, cols=cols, device=device)  # V1, routed setter, even members
    newest = evolve(shipped, group="bucketed", setter="rebind", flavor="padded")
    return [
        ("no fusion", evolve(shipped, group="none"), {}),
        ("HyperParallel as shipped", shipped, {}),
        ("flatpool, V1 lines", shipped, V1_HOOKS),
        ("flatpool, newest lines", newest, BUCKET_HOOKS),
        ("flatpool, V1 lines, meta init", evolve(shipped, materialize="to_empty"), V1_HOOKS),
        ("flatpool, newest lines, meta init", evolve(newest, materialize="local_assign"),
         BUCKET_HOOKS),
    ]


def pools_of(unit: FullyShardUnit) -> list[Any]:
    """The flatpool pools behind the unit's group (empty when flatpool is not plugged in)."""
    group = unit.group
    holders = getattr(group, "all_gather_buckets", None) or [group]
    buffers = [getattr(h, "_flatpool", None) for h in holders]
    return [p for b in buffers if b is not None and b.adopted for p in b.pools()]


def _checks(unit: FullyShardUnit, valid_each_step: list[bool]) -> list[str]:
    out = []
    if not all(valid_each_step):
        out.append(f"validity false after a step: {valid_each_step}")
    pools = pools_of(unit)
    if len(pools) != 1:
        return out + [f"{len(pools)} pools, expected 1"]
    pool = pools[0]
    if pool.storage.nbytes() != pool.capacity:
        out.append(f"pool storage {pool.storage.nbytes()} B, capacity {pool.capacity} B")
    for p in unit.hsdp_params:
        local = p._sharded_local_tensor
        geometry = wrapper_local_geometry(p.sharded_param) if wrapper_storage_key(
            p.sharded_param) is not None else None
        if wrapper_storage_key(p.sharded_param) != pool.storage_key or geometry is None or \
                geometry[0] != tuple(local.shape) or geometry[2] != local.storage_offset():
            out.append(f"{p.param_name}: the Parameter wrapper does not alias its slice")
    return out


def run_mode(cfg: UnitConfig, hooks: dict[str, Any], steps: int, mode: str = "",
             picture: list[tuple[str, Any]] | None = None) -> tuple[Row, list[float], list[str]]:
    """One mode on this rank: the row (without the training comparison), losses, digests.

    With ``picture`` (a list), the rank's memory after fusion, before training, is appended
    to it as ``(mode, MemoryAttribution)``.
    """
    progress(f"{mode}: building")
    unit = FullyShardUnit(cfg, **hooks)
    originals = unit.originals
    if cfg.materialize != "eager":
        unit.materialize()
        unit.lazy_init()
        originals = Originals.of(unit)  # the materialized storages are the originals now
    if picture is not None:
        from flatpool.memory import capture

        picture.append((mode, capture(roots={"module": unit.module}, pools=pools_of(unit),
                                      flats=unit.flat_buffers(),
                                      watch=_AliveOriginals(unit, originals), scan=False)))
    opt = unit.make_optimizer()
    losses, valid = [], []
    for s in range(steps):
        losses.append(unit.train_step(s, opt))
        valid.append(bool(unit.is_valid()) if unit.group is not None else True)
        progress(f"{mode}: step {s + 1}/{steps}, loss {losses[-1]:.6f}")
    live = live_storages(unit)
    flat_keys = {tc.storage_address(f) for f in unit.flat_buffers()}
    stale = originals.alive()
    checks = _checks(unit, valid) if hooks else []
    row = Row("", len(live), sum(r.nbytes for r in live),
              sum(r.nbytes for r in live if r.key in flat_keys), len(stale),
              sum(n for _, n in stale), True, tuple(checks))
    return row, losses, [digest(t) for t in unit.local_values()]


def rank_rows(rows: int, cols: int, steps: int, device: str = "cpu",
              panels: list[tuple[str, Any]] | None = None) -> list[Row]:
    """Every mode on this rank, compared with the first (no fusion).

    With ``panels`` (a list), the :data:`PICTURED` modes' memory is appended to it.
    """
    out: list[Row] = []
    ref: tuple[list[float], list[str]] | None = None
    for mode, cfg, hooks in modes(rows, cols, device):
        pictured = panels if mode in PICTURED else None
        row, losses, digests = run_mode(cfg, hooks, steps, mode, pictured)
        if ref is None:
            ref = (losses, digests)
        same = (losses, digests) == ref
        checks = list(row.checks)
        if hooks:
            if row.stale:
                checks.append(f"{row.stale} original storage(s) still alive")
            if row.storages != 1:
                checks.append(f"{row.storages} live shard storages, expected the pool only")
            if not same:
                checks.append("training differs from no fusion")
        out.append(evolve(row, mode=mode, same_training=same, checks=tuple(checks)))
    return out


def rank_main(cfg: Config) -> list[Row]:
    panels: list[tuple[str, Any]] | None = [] if cfg.png is not None else None
    rows = rank_rows(cfg.ffn, cfg.hidden, cfg.steps, cfg.device, panels)
    if panels:
        draw_panels(cfg, panels)
    progress("every mode done; the ranks send their tables and exit")
    return rows


def render(rank: int, rows: Sequence[Row]) -> str:
    table = []
    for r in rows:
        if r.mode == "no fusion":
            verdict = "reference"
        elif r.mode == "HyperParallel as shipped":
            verdict = "BUG (as reported)" if r.stale else "bug not reproduced"
        else:
            verdict = "ok" if not r.checks else "FAIL: " + "; ".join(r.checks)
        table.append((
            r.mode, str(r.storages), mib(r.live_bytes), mib(r.flat_bytes),
            "-" if r.mode == "no fusion" else f"{r.stale} ({mib(r.stale_bytes)})",
            "identical" if r.same_training else "DIFFERS", verdict,
        ))
    return table_render(rank, table)


def header(cfg: Config) -> str:
    per_weight = cfg.hidden * cfg.ffn * 4
    return (
        f"flatpool demo, HyperParallel simulation: {cfg.world_size} ranks on {cfg.device} "
        f"({cfg.backend}); two weights of {cfg.ffn}x{cfg.hidden} fp32 ({mib(per_weight)} each, "
        f"about {mib(per_weight // cfg.world_size)} per rank); {cfg.steps} Adam steps per mode.\n"
        "Live shard storages are the distinct storages reachable from the members (padded data,\n"
        "local tensors, their bases, the Parameter wrappers' own memory) and the flat buffer;\n"
        "stale originals are the member storages from before fusion that are still alive.\n"
    )


def report(results: Sequence[Sequence[Row]], seconds: float) -> int:
    """Print every rank's table and the verdict; the exit code (1 if a flatpool row failed)."""
    return table_report(results, seconds, render,
                        ("flatpool rows: the pool is the only live shard storage, no stale original, every "
                  "Parameter wrapper on its slice, training bit-identical to no fusion."))


def main(cfg: Config) -> int:
    """Run every rank (or this torchrun rank), print the tables; non-zero when a flatpool row
    failed its checks."""
    return run_client(cfg, header, rank_main, report)


__all__ = ["BUCKET_HOOKS", "DemoConfig", "PICTURED", "Row", "V1_HOOKS", "header", "main",
           "modes", "rank_main", "rank_rows", "render", "report", "run_mode"]
