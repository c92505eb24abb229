"""Start ``world_size`` local ranks with real process groups and collect their results.

The demo and the integration tests both need real collectives (no mocks). Each rank is a
process started by ``torch.multiprocessing.start_processes`` with ``spawn`` (a clean
interpreter: ``fork`` would inherit torch's threads and can hang). The ranks meet through a
``file://`` rendezvous in a temporary directory made for this run, so concurrent runs never
race for a TCP port (picking a free port and letting the ranks bind it later did). Each rank
runs one picklable function and sends back its return value, or its traceback.

Built to pass on a loaded machine (CI, a shared 2-core box with busy neighbours):

* No ports: the ranks meet in a rendezvous *file* (nothing to race for).
* A slow start is not a failure: each rank waits at a barrier after ``init_process_group``, so
  no rank leaves (or fails, closing its connections) while a peer is still connecting its
  gloo mesh ("Connection closed by peer"); a connection error during that setup is retried,
  every rank moving to a fresh rendezvous file (up to :data:`SETUP_ATTEMPTS` times).
* A result travels by value (plain pickle, tensors included), never through shared-memory
  handles that die with the rank; one that cannot be pickled or unpickled is that rank's
  failure, reported in :class:`RankFailedError`.
* ``world_size`` is bounded (:func:`max_world_size`): one process per rank, each importing
  torch, is what a machine can host.

For multi-node or production runs use ``torchrun``; the demo runs under it too.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessContext

_start_processes: Callable[..., ProcessContext | None] = getattr(mp, "start_processes")

from flatpool.errors import FlatPoolError, InvalidRequestError, InvalidTypeError

R = TypeVar("R")


class RankFailedError(FlatPoolError, RuntimeError):
    """One or more ranks raised, crashed or timed out.

    ``failures`` maps each failed rank to its traceback (or how it died); ``results`` holds what
    the other ranks returned.
    """

    def __init__(self, failures: dict[int, str], results: dict[int, Any] | None = None) -> None:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")
        self.failures = failures
        self.results: dict[int, Any] = dict(results or {})


def set_local_device(device: str, local_rank: int) -> None:
    """Make ``local_rank``'s accelerator current (one device per rank); nothing on CPU."""
    kind = device.split(":", 1)[0]
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
    elif kind == "npu":
        from flatpool import resolve_device

        resolve_device(f"npu:{local_rank}")  # imports torch_npu, checks the index exists
        getattr(torch, "npu").set_device(local_rank)


SETUP_ATTEMPTS = 3
"""How many rendezvous a rank tries before a connection error at setup counts as its failure."""
SETUP_TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for its peers at the rendezvous and the start barrier (slow starts on
a loaded machine take seconds; a peer that died is caught sooner by :func:`launch`'s watch)."""
_CONNECTION_ERRORS = ("connection", "connect", "closed by peer", "broken pipe", "timed out",
                      "timeout", "reset by peer")


def _setup_error(exc: BaseException) -> bool:
    """A transient error of the process-group setup (gloo's full-mesh connect under load)."""
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, OSError)) and any(k in text for k in _CONNECTION_ERRORS)


def _init(backend: str, init_method: str, rank: int, world_size: int) -> None:
    """``init_process_group`` and a barrier, retried on a fresh rendezvous file on a connection
    error (every rank sees it: a peer's failure closes the connections this rank is on)."""
    for attempt in range(SETUP_ATTEMPTS):
        try:
            dist.init_process_group(backend, init_method=f"{init_method}.{attempt}", rank=rank,
                                    world_size=world_size, timeout=SETUP_TIMEOUT)
            dist.barrier()  # nobody starts (and may fail, and leave) before the mesh is whole
            return
        except Exception as exc:  # noqa: BLE001 - re-raised unless a setup error to retry
            if dist.is_initialized():
                dist.destroy_process_group()
            if attempt + 1 == SETUP_ATTEMPTS or not _setup_error(exc):
                raise
            time.sleep(0.2 * (attempt + 1))


def _child(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    device: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        set_local_device(device, rank)
        _init(backend, init_method, rank, world_size)
        try:
            out = fn(*args)
        finally:
            dist.destroy_process_group()
        try:
            payload = pickle.dumps(out)  # by value: tensors' bytes, not shared-memory handles
        except Exception as exc:  # noqa: BLE001 - the rank's failure, with the reason
            results.put((rank, False, (
                f"the rank returned a {type(out).__name__} that cannot be pickled "
                f"({type(exc).__name__}: {exc}); return plain data (numbers, strings, lists, "
                "dicts, tensors)")))
            return
        results.put((rank, True, payload))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))


def max_world_size(device: str = "cpu") -> int:
    """The most ranks :func:`launch` starts: one per accelerator on ``cuda``/``npu``; on CPU
    four per core (gloo ranks mostly wait; each is a process that imports torch)."""
    kind = device.split(":", 1)[0]
    if kind == "cuda":
        return max(1, torch.cuda.device_count())
    if kind == "npu":
        npu = getattr(torch, "npu", None)
        return max(1, int(npu.device_count())) if npu is not None else 1
    return 4 * (os.cpu_count() or 1)


def launch(
    fn: Callable[..., R],
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    device: str = "cpu",
    timeout_s: float = 300.0,
) -> list[R]:
    """Run ``fn(*args)`` on ``world_size`` fresh local ranks and return their results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). The process group is
    initialized before ``fn`` runs and destroyed after; on ``device`` "cuda"/"npu" rank ``r``
    first makes device ``r`` current. Raises :class:`RankFailedError` naming every failing
    rank with its traceback (a result that cannot be pickled or unpickled is its rank's
    failure), and kills ranks still running after ``timeout_s``. Raises
    :class:`flatpool.InvalidRequestError` for a ``world_size`` below 1 or above
    :func:`max_world_size`, before anything starts.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise InvalidTypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise InvalidRequestError(f"world_size must be at least 1, got {world_size}")
    limit = max_world_size(device)
    if world_size > limit:
        raise InvalidRequestError(
            f"world_size {world_size} is more ranks than this machine hosts on {device!r}: at "
            f"most {limit} ({'four per CPU core' if device.startswith('cpu') else 'one per device'}"
            "). Use fewer ranks, or torchrun across machines. Nothing was started.")
    with tempfile.TemporaryDirectory(prefix="flatpool-launch-") as rendezvous:
        # The file must not exist yet: init_process_group creates it (and never deletes it).
        init_method = "file://" + os.path.join(rendezvous, "store")
        results = mp.get_context("spawn").SimpleQueue()
        procs = _start_processes(
            _child,
            args=(world_size, init_method, backend, device, fn, args, results),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        assert procs is not None, "start_processes(join=False) returns its ProcessContext"
        got: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
            _collect(results, procs.processes, timeout_s, got, failures)
        finally:
            complete = len(got) + len(failures) == world_size
            for p in procs.processes:
                p.join(timeout=10 if complete else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
        for r, p in enumerate(procs.processes):
            if r not in got and r not in failures:
                failures[r] = f"no result (exit code {p.exitcode}, timeout {timeout_s} s)"
    if failures:
        raise RankFailedError(failures, got)
    return [got[r] for r in range(world_size)]


def _collect(
    results: Any,
    processes: list[Any],
    timeout_s: float,
    got: dict[int, Any],
    failures: dict[int, str],
) -> None:
    """Read one result per rank until all arrived, a rank died silently, or time ran out.

    Ranks ``put`` synchronously before they exit, so a dead rank whose result is not in the
    queue by then never sends one (a segfault, ``os._exit``).
    """
    deadline = time.monotonic() + timeout_s
    while len(got) + len(failures) < len(processes) and time.monotonic() < deadline:
        if results.empty():
            dead = [r for r, p in enumerate(processes)
                    if not p.is_alive() and r not in got and r not in failures]
            if dead and results.empty():
                for r in dead:  # crashed (segfault, os._exit) before reporting
                    failures[r] = f"rank exited with code {processes[r].exitcode} without a result"
                continue
            time.sleep(0.01)
            continue
        rank, ok, payload = results.get()
        if not ok:
            failures[rank] = payload
            continue
        try:
            got[rank] = pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - the rank's failure, with the reason
            failures[rank] = (f"its result could not be unpickled here ({type(exc).__name__}: "
                              f"{exc}); return objects the launching process can import")


__all__ = ["SETUP_ATTEMPTS", "SETUP_TIMEOUT", "RankFailedError", "launch", "max_world_size",
           "set_local_device"]
