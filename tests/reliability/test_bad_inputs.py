"""Every bad input of the catalogue raises its typed error with a helpful message and changes
nothing; ``docs/bad-inputs.md`` shows exactly the catalogue's table."""

from __future__ import annotations

import re

import pytest

from .catalogue import DOC, ROWS, Ctx, Row, doc_table, render
from .state import Snapshot, check_layout


def _params() -> list[object]:
    return [
        pytest.param(r, id=r.id, marks=pytest.mark.xfail(strict=True, reason=r.xfail))
        if r.xfail else pytest.param(r, id=r.id)
        for r in ROWS
    ]


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.parametrize("row", _params())
def test_bad_input(row: Row) -> None:
    ctx = Ctx()
    call = row.arrange(ctx)
    if row.error is None:  # accepted: the call asserts its own outcome
        call()
        return
    if issubclass(row.error, Warning):
        with pytest.warns(row.error, match=row.match):
            call()
        return
    snap = Snapshot(ctx.pools, ctx.tensors, ctx.places)
    with pytest.raises(BaseException) as info:
        call()
    exc = info.value
    assert type(exc) is row.error, f"{row.id}: expected {row.error.__name__}, got {exc!r}"
    message = str(exc)
    assert len(message) >= 20 and re.search(row.match, message, re.S), (
        f"{row.id}: unhelpful message {message!r}"
    )
    snap.assert_unchanged()
    for p in ctx.pools:
        check_layout(p)


def test_ids_are_unique() -> None:
    assert len({r.id for r in ROWS}) == len(ROWS)


def test_doc_table_matches_catalogue() -> None:
    assert doc_table(DOC.read_text()) == render(), (
        "docs/bad-inputs.md is out of date: run `python -m tests.reliability.catalogue`"
    )
