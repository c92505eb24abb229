"""The HyperParallel drop-in lines, taken from docs/integration.md as a reader would paste them.

Each ```python block of the document that defines ``class HSDPParamGroup`` (the V1 and
``enable_zero_copy`` shapes) or ``class AllGatherBucket`` (the newest shape) is executed as
written; the methods it defines are what the tests plug into the simulation's group.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any, Callable

DOC = Path(__file__).resolve().parents[2] / "docs" / "integration.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CLASSES = {"v1": "HSDPParamGroup", "newest": "AllGatherBucket"}
METHODS = {"v1": ("_init_flat_param_buffer", "_is_flat_buffer_valid"),
           "newest": ("init_flat_param_buffer", "is_flat_buffer_valid")}


def block(shape: str) -> str:
    """The one python block of the document that defines the shape's class."""
    found = [b for b in BLOCK.findall(DOC.read_text()) if f"\nclass {CLASSES[shape]}:" in b]
    assert len(found) == 1, f"docs/integration.md must have one block for {CLASSES[shape]}"
    return found[0]


def hooks(shape: str) -> dict[str, Callable[..., Any]]:
    """``init_flat`` / ``is_valid`` functions for ``FullyShardUnit``, executed from the doc."""
    namespace: dict[str, Any] = {"__name__": f"docs_integration_{shape}"}
    exec(compile(block(shape), f"docs/integration.md[{CLASSES[shape]}]", "exec"), namespace)
    cls = namespace[CLASSES[shape]]
    init, valid = METHODS[shape]
    return {"init_flat": cls.__dict__[init], "is_valid": cls.__dict__[valid]}


def _bodies(source: str, cls_name: str) -> dict[str, str]:
    """Method name -> its body's source lines (dedented), from a class in ``source``."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef):
                    first, last = fn.body[0].lineno, fn.body[-1].end_lineno
                    assert last is not None
                    out[fn.name] = textwrap.dedent("\n".join(lines[first - 1:last]))
    return out


def doc_bodies(shape: str) -> dict[str, str]:
    return _bodies(block(shape), CLASSES[shape])


def package_bodies(cls: type) -> dict[str, str]:
    """The same for one of flatpool's mixins (V1Lines, BucketLines)."""
    return _bodies(textwrap.dedent(inspect.getsource(cls)), cls.__name__)


__all__ = ["block", "doc_bodies", "hooks", "package_bodies"]
