"""The names docs/ tables present as API are the ones a user imports (issue 42 item 4): each
dotted ``flatpool...`` name in a table row resolves, through public modules only, and the
integration page's API table names every function by its public path."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
DOTTED = re.compile(r"`(flatpool(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def table_names() -> list[tuple[str, int, str]]:
    out = []
    for doc in sorted(DOCS.glob("*.md")):
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("|"):
                out.extend((doc.name, n, m.group(1)) for m in DOTTED.finditer(line))
    return out


def test_the_tables_name_something() -> None:
    assert len(table_names()) >= 20


@pytest.mark.parametrize("doc,line,name", table_names())
def test_a_table_name_imports_from_public_modules(doc: str, line: int, name: str) -> None:
    private = [p for p in name.split(".") if p.startswith("_")]
    assert not private, f"{doc}:{line}: {name} goes through private {private}"
    resolve(name)  # raises when the name does not exist


def test_the_integration_api_table_uses_public_paths() -> None:
    text = (DOCS / "integration.md").read_text()
    section = text.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 12
    for row in rows:
        first = row.split(" | ", 1)[0]
        for name in re.findall(r"`([^`]+)`", first):
            assert name.startswith(("flatpool.", ".")), f"not a public path: {name!r} in {row[:80]}"
