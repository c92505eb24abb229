"""How ranks are started: ``launch()`` (spawn + a file:// rendezvous) and the demo under torchrun.

``launch()`` jobs started at the same moment must not race for a TCP port (each meets in a
rendezvous file of its own), and every failing rank is reported with what it raised, or with
its exit code when it died without a word. The demo must also run as a torchrun job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from flatpool import FlatPoolError, InvalidRequestError
from examples.launch import RankFailedError, launch

REPO = Path(__file__).resolve().parents[2]


def store_name() -> str:
    """The kind of store the ranks met through (under PrefixStore wrappers)."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return type(store).__name__


def rank_sum(offset: int) -> tuple[int, str]:
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)  # a real collective over the rendezvous
    return int(t.item()), store_name()


def rank_one_raises() -> str:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    return store_name()


def rank_one_dies() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return 7


def rank_tensor() -> torch.Tensor:
    return torch.arange(4) * (dist.get_rank() + 1)


def _explode() -> None:
    raise ValueError("this result cannot be rebuilt here")


class Unloadable:
    """Pickles fine in the rank; unpickling it in the launcher raises."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_explode, ())


def rank_returns(what: str) -> Any:
    if dist.get_rank() == 0:
        return "fine"
    return Unloadable() if what == "unloadable" else (lambda: None)


def test_a_rank_may_return_tensors() -> None:
    """Sent by value: torch's shared-memory handles died with the rank (FileNotFoundError)."""
    got = launch(rank_tensor, world_size=2, timeout_s=120)
    assert [t.tolist() for t in got] == [[0, 1, 2, 3], [0, 2, 4, 6]]


@pytest.mark.parametrize("what, message", [("unloadable", "could not be unpickled here"),
                                           ("lambda", "cannot be pickled")])
def test_a_result_that_cannot_travel_is_that_ranks_typed_failure(what: str, message: str) -> None:
    with pytest.raises(RankFailedError) as info:
        launch(rank_returns, what, world_size=2, timeout_s=120)
    assert set(info.value.failures) == {1} and message in info.value.failures[1]
    assert info.value.results == {0: "fine"}


def test_world_size_is_bounded_by_the_machine() -> None:
    from examples.launch import max_world_size

    assert max_world_size("cpu") == 4 * (os.cpu_count() or 1)
    with pytest.raises(InvalidRequestError, match="more ranks than this machine hosts"):
        launch(rank_sum, 0, world_size=10**6)


def test_ranks_meet_in_a_file_and_a_failing_rank_is_reported() -> None:
    with pytest.raises(RankFailedError) as info:
        launch(rank_one_raises, world_size=2, timeout_s=120)
    err = info.value
    assert isinstance(err, FlatPoolError)
    assert set(err.failures) == {1} and "ValueError: rank 1 refuses" in err.failures[1]
    assert err.results == {0: "FileStore"}, "rank 0 must have met rank 1 through a file://"


@pytest.mark.slow
def test_concurrent_jobs_do_not_collide_and_a_dead_rank_is_reported() -> None:
    jobs: dict[str, Any] = {"sum": (rank_sum, 100), "dies": (rank_one_dies,)}
    outcome: dict[str, Any] = {}

    def run(name: str) -> None:
        fn, *args = jobs[name]
        try:
            outcome[name] = launch(fn, *args, world_size=2, timeout_s=120)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome[name] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert outcome["sum"] == [(201, "FileStore"), (201, "FileStore")]
    died = outcome["dies"]
    assert isinstance(died, RankFailedError) and set(died.failures) == {1}
    assert "exited with code 3" in died.failures[1] and died.results == {0: 7}


@pytest.mark.parametrize("world_size", [0, -2])
def test_world_size_is_checked_before_anything_starts(world_size: int) -> None:
    with pytest.raises(InvalidRequestError, match="world_size"):
        launch(rank_sum, 0, world_size=world_size)


@pytest.mark.slow
def test_demo_runs_under_torchrun(tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m examples.demo`` from the repository root
    (the README's command; the demo is not installed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "examples.demo", "--hidden", "32", "--ffn", "64", "--steps", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    report = f"exit code {proc.returncode}\n--- stdout ---\n{out}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert out.count("flatpool demo: 2 ranks on cpu (gloo)") == 1, "only rank 0 prints\n" + report
    for rank in (0, 1):
        assert f"rank {rank}:" in out, report
    assert out.count("BUG (as reported)") == 2, report
    assert out.count("flatpool adopt  1") == 2 and out.count("meta init       1") == 2, report
    assert "FAIL" not in out, report
    assert "flatpool rows: no stale shard storage, training bit-identical to no fusion." in out, report
