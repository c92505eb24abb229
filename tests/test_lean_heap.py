"""Issue 20's heap budget on the lean adoption path: the journal is columns, not a record per
tensor, and rolling back through those columns is still exact."""

from __future__ import annotations

import pytest
import torch

from flatpool import FlatPool
from flatpool.ownership import transaction as transaction_mod
from flatpool.ownership.moves import SetMove, SetMoves
from flatpool.testing import set_fault_hook
from flatpool import torch_compat as tc


class Injected(RuntimeError):
    pass


def _batch(n: int) -> list[torch.Tensor]:
    return [torch.arange(i, i + 3 + i % 5, dtype=torch.float32) for i in range(n)]


@pytest.mark.parametrize("exc_type", [Injected, KeyboardInterrupt])
def test_a_failure_after_moves_in_the_second_chunk_puts_every_tensor_back(
    exc_type: type[BaseException],
) -> None:
    """2,500 tensors are moved in three chunks of 1,024; failing at the third chunk's copy
    undoes the two chunks already moved and copied, through their column records."""
    ts = _batch(2500)
    keys = [tc.storage_key(t.untyped_storage()) for t in ts]
    values = [t.clone() for t in ts]
    versions = [t._version for t in ts]
    copies = []

    def hook(step: str) -> None:
        if step == "copy":
            copies.append(step)
            if len(copies) == 3:
                raise exc_type("injected")

    pool = FlatPool("cpu")
    set_fault_hook(hook)
    try:
        with pytest.raises(exc_type):
            pool.adopt(ts)
    finally:
        set_fault_hook(None)
    assert len(copies) == 3
    assert [tc.storage_key(t.untyped_storage()) for t in ts] == keys
    assert all(torch.equal(t, v) for t, v in zip(ts, values))
    assert [t._version for t in ts] == versions
    assert pool.slices() == () and len(pool.registry) == 0
    report = pool.adopt(ts)  # and the same batch then goes through
    assert report.all_released and all(pool.owns(t) for t in ts)
    assert all(torch.equal(t, v) for t, v in zip(ts, values))


def test_the_lean_journal_holds_one_record_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SetMove object per tensor (88 B each at the peak): one SetMoves per chunk of 1,024,
    whose records are exactly the moves made."""
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
    assert [type(r) for r in journal] == [SetMoves] * 3
    moves = [m for r in journal for m in r.records()]  # type: ignore[attr-defined]
    assert all(type(m) is SetMove for m in moves)
    assert [m.obj for m in moves] == ts
    assert [(m.offset, m.size) for m in moves] == list(zip(offsets, shapes))
