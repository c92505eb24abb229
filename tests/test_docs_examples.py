"""The ```python examples of the README and the docs run as written, both ways a reader uses
them: every self-contained block alone (pasted into a fresh interpreter), and every chain of
blocks that continue each other in order, in one namespace.

A block that continues the one before it is fenced ```python continues and its lead-in says
so ("Continuing the example above ..."); a chain is a block and the ``continues`` blocks right
after it. A block fenced ```python torchrun is a complete script, run on 2 gloo ranks with
torchrun.
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest
from attrs import define

from flatpool.testing import set_fault_hook
from torchrun_jobs import run_torchrun

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *(f"docs/{n}" for n in ("pool.md", "ownership.md", "census.md", "meta.md",
                                            "checkpoints.md", "integration.md", "threading.md",
                                            "optim.md"))]
BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


@define(frozen=True)
class Block:
    doc: str
    index: int
    marks: tuple[str, ...]
    source: str
    lead_in: str
    """The prose between the previous ```python block (or the document's start) and this one."""

    @property
    def name(self) -> str:
        return f"{self.doc}[block {self.index}]"


def blocks(doc: str) -> list[Block]:
    text = (ROOT / doc).read_text()
    out, prose_from = [], 0
    for i, m in enumerate(BLOCK.finditer(text)):
        out.append(Block(doc, i, tuple(m.group(1).split()), m.group(2),
                         text[prose_from:m.start()]))
        prose_from = m.end()
    return out


def chains(doc: str) -> list[list[Block]]:
    out: list[list[Block]] = []
    for b in blocks(doc):
        if "torchrun" in b.marks:
            continue
        if "continues" in b.marks:
            assert out, f"{b.name} continues nothing: it is the first block"
            out[-1].append(b)
        else:
            out.append([b])
    return out


def run(chain: list[Block]) -> None:
    namespace: dict[str, object] = {"__name__": "docs_example"}
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for b in chain:
                exec(compile(b.source, b.name, "exec"), namespace)
    finally:
        set_fault_hook(None)


ALONE = [b for doc in DOCS for b in blocks(doc) if not {"continues", "torchrun"} & set(b.marks)]
CHAINS = [c for doc in DOCS for c in chains(doc) if len(c) > 1]
SCRIPTS = [b for doc in DOCS for b in blocks(doc) if "torchrun" in b.marks]


def test_every_document_has_examples() -> None:
    for doc in DOCS:
        assert blocks(doc), f"{doc} has no python example"
    assert CHAINS and SCRIPTS


@pytest.mark.parametrize("block", ALONE, ids=lambda b: b.name)
def test_self_contained_block_runs_alone(block: Block) -> None:
    run([block])


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c[0].name)
def test_continuing_blocks_run_in_order(chain: list[Block]) -> None:
    run(chain)


@pytest.mark.parametrize("block", [b for c in CHAINS for b in c[1:]], ids=lambda b: b.name)
def test_a_continuing_block_says_so_and_needs_what_came_before(block: Block) -> None:
    """Its lead-in tells the reader; alone it fails for a name an earlier block defined (a
    block that runs alone must not be marked, so readers can trust the mark)."""
    assert re.search(r"continu", block.lead_in, re.I), (
        f"{block.name} continues the block above but its lead-in does not say so")
    with pytest.raises(NameError):
        run([block])


@pytest.mark.parametrize("block", SCRIPTS, ids=lambda b: b.name)
def test_script_runs_on_two_torchrun_ranks(block: Block, tmp_path: Path) -> None:
    """The complete FSDP2 script of docs/integration.md, as a user runs it."""
    script = tmp_path / "example.py"
    script.write_text(block.source)
    proc = run_torchrun([str(script)], cwd=tmp_path)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    for rank in (0, 1):
        assert f"rank {rank}: fused and valid after 3 steps" in proc.stdout, proc.stdout
