"""The ```python examples of the README and the pool, ownership, census and meta docs run as
written.

The blocks of one document share a namespace and run in order, like a reader pasting them.
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest

from flatpool.testing import set_fault_hook

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(name: str) -> list[str]:
    return BLOCK.findall((DOCS / name).read_text())


@pytest.mark.parametrize(
    "doc", ["../README.md", "pool.md", "ownership.md", "census.md", "meta.md", "checkpoints.md"]
)
def test_doc_examples_run(doc: str) -> None:
    code = blocks(doc)
    assert code, f"{doc} has no python example"
    namespace: dict[str, object] = {"__name__": f"docs_{doc.replace('.', '_')}"}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, src in enumerate(code):
                exec(compile(src, f"{doc}[block {i}]", "exec"), namespace)
    finally:
        set_fault_hook(None)
