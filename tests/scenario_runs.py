"""Run a rank's named scenarios one after another, every rank in step, each failure reported.

The multi-rank test jobs start one process group and run many scenarios in it (a group start
costs seconds on the loaded machine). Each scenario's exception becomes its traceback in the
result instead of ending the job, and is printed to stderr at once: if the other rank is left
waiting in a collective, the job ends by timeout and this is what says why (``launch`` shows
the ranks' stderr). A barrier after every scenario keeps the ranks on the same one, and
:func:`together` around a step one rank may fail alone (an adoption) keeps the others from
going on into a collective it never joins.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from flatpool.errors import AdoptionError
from flatpool.testing import set_fault_hook


class OtherRankFailedError(RuntimeError):
    """This rank's step went well, another rank's raised (its traceback is its own report)."""


@contextmanager
def together() -> Iterator[None]:
    """Run the block on every rank, then agree: when it raised on any rank, raise on all (the
    rank's own exception where it had one), so none goes on into the next collective alone."""
    ok = False
    try:
        yield
        ok = True
    finally:
        failed = torch.tensor([0 if ok else 1])
        dist.all_reduce(failed)
        if ok and int(failed):
            raise OtherRankFailedError(f"{int(failed)} other rank(s) failed this step")


class FailingOps:
    """A fault hook making every flatpool operation raise a typed error while ``on`` (what a
    rank-local problem looks like to the fusion layer), counting them; installed for a ``with``
    block."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.raised = 0

    def __call__(self, step: str) -> None:
        if self.on:
            self.raised += 1
            raise AdoptionError(f"injected rank-local failure at {step!r}")

    def __enter__(self) -> FailingOps:
        set_fault_hook(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        set_fault_hook(None)


def run_scenarios(
    cases: Mapping[str, Callable[[], object]],
    *,
    skips: tuple[type[BaseException], ...] = (),
) -> dict[str, str | None]:
    """``{name: None | "SKIP: reason" | traceback}`` for each case, in order.

    ``skips``: exception types that mean "this torch cannot run the scenario" (reported as
    ``SKIP: ...``, which the test side turns into a skip), not a failure.
    """
    results: dict[str, str | None] = {}
    for name, fn in cases.items():
        try:
            fn()
            results[name] = None
        except skips as exc:
            results[name] = f"SKIP: {exc}"
        except Exception:  # noqa: BLE001 - reported per scenario
            results[name] = traceback.format_exc()
            print(f"rank {dist.get_rank()} {name}:\n{results[name]}", file=sys.stderr, flush=True)
        dist.barrier()
    return results


__all__ = ["FailingOps", "OtherRankFailedError", "run_scenarios", "together"]
