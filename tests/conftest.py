"""Shared pytest configuration for the flatpool test suite.

* ``--slow`` runs the tests marked ``slow`` and switches hypothesis to the ``slow`` profile
  (many examples); without it those tests are skipped and the ``ci`` profile is used.
* ``tests/typing_usage`` holds modules that are type-checked by ``test_static_typing.py``,
  never imported or collected by pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from flatpool.testing import set_fault_hook
from hypothesis import HealthCheck, settings

collect_ignore = ["typing_usage"]

settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "slow",
    max_examples=5000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="run tests marked slow and use the hypothesis 'slow' profile (many examples)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running fuzzing, only with --slow")
    config.addinivalue_line("markers", "device: needs a CUDA or NPU device (skipped without "
                            "one); scripts/device_check.sh runs them with -m device")
    if config.getoption("--slow"):
        settings.load_profile("slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow test: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


# -- tensor wrappers the pool and aliasing checks must see through -------------------------
class SharedStorageWrapper(torch.Tensor):
    """HyperParallel-style DTensor stand-in: a ``_make_subclass`` wrapper that *shares* the
    local tensor's storage, carries it as ``_local_tensor`` and overrides ``data_ptr()``."""

    _local_tensor: torch.Tensor

    @staticmethod
    def __new__(cls, local: torch.Tensor) -> SharedStorageWrapper:
        out = torch.Tensor._make_subclass(cls, local, local.requires_grad)
        out._local_tensor = local
        return out

    def data_ptr(self) -> int:
        return int(self._local_tensor.data_ptr())


@pytest.fixture(autouse=True)
def _no_fault_hook() -> Iterator[None]:
    """No test leaves a fault-injection hook installed for the next one."""
    yield
    set_fault_hook(None)


@pytest.fixture
def hp_wrap() -> Callable[[torch.Tensor], torch.Tensor]:
    """Wrap a local tensor like HyperParallel's torch DTensor does."""
    return SharedStorageWrapper


@pytest.fixture(scope="session")
def single_rank_mesh() -> Iterator[Any]:
    """A 1-rank gloo process group and its CPU ``DeviceMesh`` (destroyed at session end).

    Reuses an already initialized default group instead of making a second one.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield DeviceMesh("cpu", list(range(dist.get_world_size())))
    finally:
        if created:
            dist.destroy_process_group()


@pytest.fixture
def dtensor_from_local(single_rank_mesh: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """Wrap a local tensor into a torch DTensor sharded on dim 0 of the 1-rank mesh."""
    from torch.distributed.tensor import DTensor, Shard

    def make(local: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(local, single_rank_mesh, [Shard(0)], run_check=False)

    return make


@pytest.fixture(scope="session")
def hp_job() -> list[dict[str, Any]]:
    """Per rank, the results of the HyperParallel-simulation scenarios (tests/integrations/
    hp_jobs.py): one spawned 2-rank gloo job shared by the HyperParallel test modules."""
    import time

    from examples.launch import launch

    import hp_jobs

    t0 = time.perf_counter()
    out: list[dict[str, Any]] = launch(hp_jobs.run_all, world_size=2, timeout_s=900)
    print(f"2-rank HyperParallel job: {time.perf_counter() - t0:.1f} s")
    return out
