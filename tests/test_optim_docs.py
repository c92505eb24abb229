"""docs/optim.md's runnable example runs as written, and its numbers table names the
benchmark that measured it."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

from flatpool.errors import FlatStepWarning

DOC = Path(__file__).resolve().parent.parent / "docs" / "optim.md"


def test_optim_doc_example_runs() -> None:
    from test_docs_examples import blocks

    code = [b.source for b in blocks("docs/optim.md")]
    assert len(code) == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("error", FlatStepWarning)  # the example steps flat, no fallback
        exec(compile(code[0], "optim.md[block 0]", "exec"), {"__name__": "docs_optim"})
    assert "params/exp_avg" in out.getvalue()


def test_optim_doc_names_its_benchmark() -> None:
    text = DOC.read_text()
    assert "python -m benchmarks.run --only optim" in text
    assert "## Bad inputs" in text
