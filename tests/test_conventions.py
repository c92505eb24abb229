"""The conventions a PyTorch user expects of a library: every error flatpool raises on purpose
is a ``FlatPoolError``; every warning is one of flatpool's own categories, attributed to the
user's line (not to a line inside flatpool); no deprecated torch collective runs on the supported
range (torch 2.13 and 2.14 made ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` print
FutureWarnings)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import flatpool
from flatpool import (
    AdoptionError,
    ExternalMemoryWarning,
    FlatPool,
    FlatPoolDeprecationWarning,
    FlatPoolError,
    FlatPoolWarning,
    OriginalKeptAliveWarning,
    PinnedStorageError,
)

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(REPO / "flatpool").rglob("*.py"), *(REPO / "integrations").rglob("*.py")])


def _modules() -> list[str]:
    names = ["flatpool"]
    for info in pkgutil.walk_packages(flatpool.__path__, "flatpool."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return names


def test_every_exception_class_is_a_flatpool_error() -> None:
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == name and not issubclass(obj, Warning)):
                found[f"{name}.{obj.__qualname__}"] = obj
    assert "flatpool.errors.AdoptionError" in found and len(found) > 15, sorted(found)
    outside = sorted(n for n, c in found.items() if not issubclass(c, FlatPoolError))
    assert outside == []
    # adoption errors are also what torch raises for an operation the state forbids
    assert issubclass(AdoptionError, RuntimeError) and issubclass(PinnedStorageError, RuntimeError)


def test_every_warning_goes_through_the_shared_helper_with_a_flatpool_category() -> None:
    """No ``warnings.warn`` outside flatpool._warn (a counted stacklevel goes stale when a call
    path changes depth); every ``warn(...)`` names a FlatPoolWarning subclass."""
    direct, categories = [], set()
    for path in SOURCES:
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr == "warn" and rel != "flatpool/_warn.py":
                if isinstance(fn.value, ast.Name) and fn.value.id == "warnings":
                    direct.append(f"{rel}:{node.lineno}")
            if isinstance(fn, ast.Name) and fn.id == "warn" and len(node.args) == 2:
                category = node.args[1]
                assert isinstance(category, ast.Name), f"{rel}:{node.lineno}"
                categories.add(category.id)
    assert direct == []
    assert {"OriginalKeptAliveWarning", "ExternalMemoryWarning"} <= categories, categories
    for name in categories:
        assert issubclass(getattr(flatpool, name), FlatPoolWarning), name


def test_a_warning_points_at_the_callers_line() -> None:
    pool = FlatPool()
    lin = torch.nn.Linear(4, 4)
    keep = lin.weight.data  # a reference the caller holds pins the original: kept, warned
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        pool.adopt([lin.weight], on_pinned="warn")
    kept = [w for w in seen if w.category is OriginalKeptAliveWarning]
    assert len(kept) == 1, [str(w.message) for w in seen]
    assert (kept[0].filename, kept[0].lineno) == (__file__, line)
    del keep


def test_an_external_memory_warning_points_at_the_callers_line() -> None:
    np = pytest.importorskip("numpy")
    t = torch.from_numpy(np.zeros(16, dtype=np.float32))
    pool = FlatPool()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        pool.adopt([t])
    external = [w for w in seen if w.category is ExternalMemoryWarning]
    assert len(external) == 1, [str(w.message) for w in seen]
    assert (external[0].filename, external[0].lineno) == (__file__, line)


def test_a_moved_name_warns_at_the_callers_line_in_flatpools_category() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        hook = flatpool.set_fault_hook  # type: ignore[attr-defined]
    assert hook is flatpool.testing.set_fault_hook
    (w,) = seen
    assert w.category is FlatPoolDeprecationWarning and issubclass(w.category, DeprecationWarning)
    assert (w.filename, w.lineno) == (__file__, line)


@pytest.mark.parametrize("client", ["fsdp2", "hyperparallel"])
def test_the_demo_prints_no_future_warning(client: str) -> None:
    """The demo (and with it the HyperParallel simulation's collectives) on 2 gloo ranks: every
    FutureWarning and DeprecationWarning shown, none printed. Before, the simulation printed
    torch 2.13's FutureWarnings for all_gather_into_tensor and reduce_scatter_tensor."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONWARNINGS")}
    proc = subprocess.run(
        [sys.executable, "-W", "always::FutureWarning", "-W", "always::DeprecationWarning",
         "-m", "examples.demo", "--client", client,
         "--hidden", "32", "--ffn", "64", "--steps", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    report = f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    assert "BUG (as reported)" in proc.stdout, report
    assert "FutureWarning" not in proc.stderr and "DeprecationWarning" not in proc.stderr, report


_CALLISH = (ast.Call, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _returns_a_call_inside_with(tree: ast.AST) -> list[int]:
    """Lines of ``return <call>`` statements directly inside a ``with`` block (not inside a
    function defined there)."""
    found: list[int] = []

    def walk(node: ast.AST, in_with: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                walk(child, False)
            elif isinstance(child, (ast.With, ast.AsyncWith)):
                walk(child, True)
            else:
                if in_with and isinstance(child, ast.Return) and isinstance(child.value, _CALLISH):
                    found.append(child.lineno)
                walk(child, in_with)

    walk(tree, False)
    return found


def test_no_with_block_returns_a_call_directly() -> None:
    """``with cm: return f()`` lets a Ctrl-C that lands as ``f`` returns skip ``cm.__exit__``:
    CPython checks for signals right after the call, at an instruction already outside the
    block's protected range. A pool's lock then stays held for good, or grad, inference or
    torch-function mode stays switched (the signal-points walk found the lock case). Assign
    inside the block and return the name."""
    root = Path(flatpool.__file__).parent.parent
    bad = []
    for folder in ("flatpool", "integrations"):
        for path in sorted((root / folder).rglob("*.py")):
            lines = _returns_a_call_inside_with(ast.parse(path.read_text()))
            bad += [f"{path.relative_to(root)}:{n}" for n in lines]
    assert not bad, "return a name, not a call, inside a with block: " + ", ".join(bad)
    sample = ast.parse("def f(lock):\n    with lock:\n        return g()\n")
    assert _returns_a_call_inside_with(sample) == [3]  # the rule itself catches the pattern
