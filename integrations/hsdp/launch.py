"""Start ``world_size`` local ranks on 127.0.0.1 with real process groups and collect results.

The demo and the integration tests both need real collectives (no mocks): each rank is a
spawned process (a clean interpreter, so no thread state is inherited from the parent, which
``fork`` would risk once torch started threads) that joins a TCP-store process group, runs one
picklable function and sends back its return value, or its traceback.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp

R = TypeVar("R")


class RankFailedError(RuntimeError):
    """One or more ranks raised, crashed or timed out; ``failures`` maps rank to its traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")
        self.failures = failures


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        try:
            out = fn(*args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))


def launch(
    fn: Callable[..., R],
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> list[R]:
    """Run ``fn(*args)`` on ``world_size`` fresh ranks and return their results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). The process group is
    initialized before ``fn`` runs and destroyed after. Raises :class:`RankFailedError` naming
    every failing rank with its traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, backend, fn, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, R] = {}
    failures: dict[int, str] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = results.get(timeout=timeout_s)
            except queue.Empty:
                break
            if ok:
                got[rank] = payload
            else:
                failures[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) + len(failures) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        if r not in got and r not in failures:
            failures[r] = f"no result (exit code {p.exitcode}, timeout {timeout_s} s)"
    if failures:
        raise RankFailedError(failures)
    return [got[r] for r in range(world_size)]


__all__ = ["RankFailedError", "free_port", "launch"]
