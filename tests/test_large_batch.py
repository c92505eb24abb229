"""A batch larger than a copy chunk: a failure after every tensor moved puts every tensor back
through its journal record, and the journal holds exactly one record per move made."""

from __future__ import annotations

import pytest
import torch

from flatpool import FlatPool
from flatpool.ownership import _transaction as transaction_mod
from flatpool.ownership._moves import Member, Move
from flatpool.testing import set_fault_hook
from flatpool import _torch_compat as tc


class Injected(RuntimeError):
    pass


def _batch(n: int) -> list[torch.Tensor]:
    return [torch.arange(i, i + 3 + i % 5, dtype=torch.float32) for i in range(n)]


@pytest.mark.parametrize("exc_type", [Injected, KeyboardInterrupt])
def test_a_failure_after_every_move_puts_every_tensor_back(
    exc_type: type[BaseException],
) -> None:
    """2,500 tensors are copied in three chunks of 1,024 and moved; failing at the release
    (after every move, before the commit) undoes every move, through its journal record."""
    ts = _batch(2500)
    keys = [tc.storage_key(t.untyped_storage()) for t in ts]
    values = [t.clone() for t in ts]
    versions = [t._version for t in ts]
    steps = []

    def hook(step: str) -> None:
        steps.append(step)
        if step == "release":
            raise exc_type("injected")

    pool = FlatPool("cpu")
    set_fault_hook(hook)
    try:
        with pytest.raises(exc_type):
            pool.adopt(ts)
    finally:
        set_fault_hook(None)
    assert steps == ["allocate", "rebind", "copy", "release"]
    assert [tc.storage_key(t.untyped_storage()) for t in ts] == keys
    assert all(torch.equal(t, v) for t, v in zip(ts, values))
    assert [t._version for t in ts] == versions
    assert pool.slices() == () and len(pool.registry) == 0
    report = pool.adopt(ts)  # and the same batch then goes through
    assert report.all_released and all(pool.owns(t) for t in ts)
    assert all(torch.equal(t, v) for t, v in zip(ts, values))


def test_the_journal_holds_one_record_per_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """One :class:`Member` record per tensor moved, in order, saying where it sat."""
    seen: list[list[object]] = []
    close = transaction_mod.Transaction.close

    def spy(self: transaction_mod.Transaction) -> None:
        seen.append(list(self.journal))
        close(self)

    monkeypatch.setattr(transaction_mod.Transaction, "close", spy)
    ts = _batch(2100)
    offsets = [t.storage_offset() for t in ts]
    shapes = [tuple(t.shape) for t in ts]
    FlatPool("cpu").adopt(ts)
    (journal,) = [j for j in seen if j]
    moves = journal
    assert all(type(m) is Member and m.how is Move.IN_PLACE for m in moves)
    assert [m.obj for m in moves] == ts  # type: ignore[union-attr]
    assert [(m.offset, m.size) for m in moves] == list(zip(offsets, shapes))  # type: ignore[union-attr]
