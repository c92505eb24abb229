"""How a demo client runs: its options, its ranks (``launch()`` or torchrun), its progress lines.

Both clients (FSDP2 and the HyperParallel simulation) share one way to start: under torchrun
(``RANK`` and ``WORLD_SIZE`` set) this process is one rank and rank 0 prints; otherwise
:func:`~.launch.launch` starts ``world_size`` local ranks. Progress goes to stderr, one line per
mode and training step from rank 0 (the ranks move in step through the collectives), so a long
run is never silent and the tables on stdout stay clean.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from attrs import define, evolve

from .launch import launch, set_local_device

R = TypeVar("R")
_STARTED_ENV = "FLATPOOL_DEMO_STARTED"
"""The launching process's start (``time.time()``), inherited by the ranks it spawns, so every
progress line counts seconds from the same moment."""
_STARTED = float(os.environ.get(_STARTED_ENV) or time.time())


@define(frozen=True)
class Config:
    device: str = "cpu"
    backend: str = "gloo"
    world_size: int = 2
    hidden: int = 1024
    ffn: int = 2048
    batch: int = 8
    steps: int = 3
    lr: float = 1e-2
    client: str = "fsdp2"
    png: str | None = None
    """A folder: each rank writes rank<r>.png there, its memory in the buggy mode beside its
    memory after flatpool's fusion (flatpool.memory; needs the viz extra)."""
    optim: str = "per-parameter"
    """``"flat"`` adds the optimizer tables: per kind, storages and bytes with no pools,
    parameters pooled and all pooled (:mod:`examples.optim_demo`)."""


def progress(text: str) -> None:
    """``progress: text (N s)`` on stderr, from rank 0 only (or from a process outside any
    job); N counts from the start of the process that launched the ranks."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"progress: {text} ({time.time() - _STARTED:.1f} s)", file=sys.stderr, flush=True)


def picture_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.png")


def draw_panels(cfg: Config, panels: Sequence[tuple[str, Any]]) -> None:
    """This rank's memory pictures (one column per mode) in ``cfg.png``/rank<r>.png."""
    from flatpool.memory import draw_comparison

    assert cfg.png is not None
    os.makedirs(cfg.png, exist_ok=True)
    path = picture_path(cfg.png, dist.get_rank())
    progress(f"drawing {path}")
    draw_comparison(path, panels)


def launched_by_torchrun() -> bool:
    """True in a process started by torchrun (or another launcher setting the env protocol)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_client(
    cfg: Config,
    header: Callable[[Config], str],
    rank_main: Callable[[Config], R],
    report: Callable[[Sequence[R], float], int],
) -> int:
    """Run ``rank_main`` on every rank, ``report`` the gathered results; the exit code.

    ``rank_main`` must be a module-level function (it is pickled to spawned ranks). Under
    torchrun the launcher's ``WORLD_SIZE`` replaces ``cfg.world_size`` and every rank returns
    rank 0's code.
    """
    if launched_by_torchrun():
        return _torchrun_rank(cfg, header, rank_main, report)
    print(header(cfg), flush=True)
    os.environ.setdefault(_STARTED_ENV, repr(_STARTED))  # for the spawned ranks
    progress(f"starting {cfg.world_size} ranks on {cfg.device} ({cfg.backend})")
    t0 = time.perf_counter()
    results = launch(rank_main, cfg, world_size=cfg.world_size, backend=cfg.backend,
                     device=cfg.device)
    code = report(results, time.perf_counter() - t0)
    _say_pictures(cfg)
    return code


def _torchrun_rank(
    cfg: Config,
    header: Callable[[Config], str],
    rank_main: Callable[[Config], R],
    report: Callable[[Sequence[R], float], int],
) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = evolve(cfg, world_size=world_size)  # the launcher decides the world size
    set_local_device(cfg.device, int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(cfg.backend)  # MASTER_ADDR / MASTER_PORT from the launcher
    try:
        if rank == 0:
            print(header(cfg), flush=True)
        t0 = time.perf_counter()
        rows = rank_main(cfg)
        gathered: list[R | None] = [None] * world_size
        dist.gather_object(rows, gathered if rank == 0 else None, dst=0)
        code = [0]
        if rank == 0:
            code[0] = report([g for g in gathered if g is not None], time.perf_counter() - t0)
            _say_pictures(cfg)
        dist.broadcast_object_list(code, src=0)
        # Every rank past its last collective before any tears gloo down. (An abort at exit,
        # "terminate called without an active exception", is a torch bug this does not
        # prevent: docs/compatibility.md, "A rank that aborts at exit on gloo".)
        dist.barrier()
        return int(code[0])
    finally:
        dist.destroy_process_group()


def _say_pictures(cfg: Config) -> None:
    if cfg.png is not None:
        paths = [picture_path(cfg.png, r) for r in range(cfg.world_size)]
        print(f"memory pictures: {', '.join(paths)}", flush=True)


__all__ = ["Config", "draw_panels", "launched_by_torchrun", "picture_path", "progress",
           "run_client"]
