"""The adoption engine's structure and invariants.

* Layering: no import circles among flatpool's modules, every module imports on its own, and
  private torch APIs appear in ``flatpool/_torch_compat.py`` only.
* Geometry comes from the TensorImpl: a wrapper whose Python ``shape`` is a global shape is
  moved with its local geometry, and the pool storage stays exactly ``capacity`` bytes.
* The invariant check after every move: a tensor that lies about its geometry is caught and
  the operation rolled back.
* The fast form of a member plan (a plain tensor named alone: ``_moves_alone``) gives the
  same results as the general member rules on random batches.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flatpool
from flatpool import AdoptSpec, FlatPool, PoolInvariantError, storage_of
from flatpool import _torch_compat as tc

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"flatpool": ROOT / "flatpool", "flatpool.integrations": ROOT / "integrations"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for prefix, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([prefix, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the project that ``name`` imports (deferred ones too, TYPE_CHECKING not)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if not typing_only:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.add(t)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(tree, False)
    return found


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    # A package's __init__ importing its own submodules is not a layering edge back.
    for m in graph:
        graph[m] = {d for d in graph[m] if not (m.startswith(d + ".") and modules[d].name == "__init__.py")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    """Every module of the package (the simulation, the demo, the memory tools included) imports
    in a clean process, whatever order: no module relies on state another one leaves."""
    names = sorted(_modules(), reverse=True)  # deepest modules first
    script = (
        "import importlib\n"
        f"for n in {names!r}:\n"
        "    importlib.import_module(n)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


PRIVATE = re.compile(r"torch\._C|_unsafe_|_cdata|getrefcount")


def test_private_torch_apis_live_in_one_module() -> None:
    offenders = []
    for name, path in _modules().items():
        if name == "flatpool._torch_compat":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# -- geometry from the TensorImpl ---------------------------------------------------------------
class GlobalShapeWrapper(torch.Tensor):
    """HyperParallel-like: a ``_make_subclass`` wrapper sharing its local tensor's storage whose
    Python ``shape``/``size()`` answer with the global shape (here: world size 2 on dim 0)."""

    _local_tensor: torch.Tensor

    @staticmethod
    def __new__(cls, local: torch.Tensor) -> GlobalShapeWrapper:
        out = torch.Tensor._make_subclass(cls, local, local.requires_grad)
        out._local_tensor = local
        return out

    @property  # type: ignore[override]
    def shape(self) -> torch.Size:
        local = tc.impl_size(self)
        return torch.Size((local[0] * 2, *local[1:]))

    def size(self, dim: Any = None) -> Any:  # type: ignore[override]
        return self.shape if dim is None else self.shape[dim]


def test_a_global_shape_wrapper_is_moved_with_its_local_geometry() -> None:
    locals_ = [torch.randn(4, 3), torch.randn(4, 3)]
    wrappers = [GlobalShapeWrapper(t) for t in locals_]
    assert wrappers[0].shape == (8, 3)  # the lie
    pool = FlatPool(alignment=1)
    report = pool.adopt([AdoptSpec(t, views=[w]) for t, w in zip(locals_, wrappers)])
    assert report.all_released
    assert pool.storage.nbytes() == pool.capacity == 2 * 4 * 3 * 4
    for w, slc in zip(wrappers, report.slices):
        with tc.no_torch_function():
            assert tuple(tc.impl_size(w)) == (4, 3)
            assert tc.impl_storage_offset(w) * 4 == slc.offset
        assert pool.slice_of(w) == slc


def test_a_wrong_geometry_is_caught_and_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """If a move leaves a tensor somewhere else than asked (here: ``set_`` is handed a doubled
    size once, as a global-shape read would), the check after the moves reads the TensorImpl
    back, raises, and everything is put back: the pool's storage is exactly its capacity again."""
    t, u = torch.randn(6), torch.randn(6)
    keys = [tc.storage_key(storage_of(x)) for x in (t, u)]
    values = [t.clone(), u.clone()]
    pool = FlatPool(alignment=1)
    real = tc.impl_set_
    lied: list[bool] = []

    def wrong(obj: torch.Tensor, storage: Any, offset: int, size: Any, stride: Any) -> Any:
        if obj is u and not lied:
            lied.append(True)
            size = (size[0] * 2,)
        return real(obj, storage, offset, size, stride)

    monkeypatch.setattr(tc, "impl_set_", wrong)
    with pytest.raises(PoolInvariantError, match="outside its slice|not its capacity"):
        pool.adopt([t, u])
    monkeypatch.undo()
    assert lied
    assert [tc.storage_key(storage_of(x)) for x in (t, u)] == keys
    assert torch.equal(t, values[0]) and torch.equal(u, values[1]) and u.shape == (6,)
    assert pool.slices() == ()
    assert not pool.is_materialized or pool.storage.nbytes() == pool.capacity
    assert pool.adopt([t, u]).all_released


def test_the_read_back_catches_a_move_inside_its_slice_but_not_as_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The read-back after the moves compares each TensorImpl with the place, size and stride
    it was given, not only with its slice's bounds: a shorter size (in bounds) is caught too,
    and everything is put back."""
    t, u = torch.randn(6), torch.randn(6)
    values = [t.clone(), u.clone()]
    pool = FlatPool(alignment=1)
    real = tc.impl_set_
    lied: list[bool] = []

    def wrong(obj: torch.Tensor, storage: Any, offset: int, size: Any, stride: Any) -> Any:
        if obj is u and not lied and storage.nbytes() == 48:
            lied.append(True)
            size = (3,)
        return real(obj, storage, offset, size, stride)

    monkeypatch.setattr(tc, "impl_set_", wrong)
    with pytest.raises(PoolInvariantError, match="does not sit where it was placed"):
        pool.adopt([t, u])
    monkeypatch.undo()
    assert lied
    assert torch.equal(t, values[0]) and torch.equal(u, values[1]) and u.shape == (6,)
    assert pool.slices() == ()
    assert pool.adopt([t, u]).all_released


def test_the_invariant_check_sees_a_grown_storage() -> None:
    pool = FlatPool(capacity=64)
    pool.adopt(torch.randn(4))
    with torch.no_grad():  # what a global-shape set_ would do: the storage silently grows
        torch.empty(0).set_(pool.storage, 0, (64,), (1,))
    pool.storage.resize_(128)
    with pytest.raises(PoolInvariantError, match="not its capacity"):
        pool.check_invariants()


# -- the fast member plan equals the general one -------------------------------------------------------
shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)
dtypes = st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8, torch.bfloat16])


@st.composite
def batches(draw: Any) -> list[tuple[tuple[int, ...], torch.dtype, bool, bool]]:
    n = draw(st.integers(1, 6))
    return [(draw(shapes), draw(dtypes), draw(st.booleans()), draw(st.booleans()))
            for _ in range(n)]


def _make(spec: list[tuple[tuple[int, ...], torch.dtype, bool, bool]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for shape, dtype, transposed, param in spec:
        t = (torch.randn(shape, generator=g) * 50).to(dtype)
        if transposed and t.dim() >= 2:
            t = t.transpose(0, 1).contiguous().transpose(0, 1)  # strided, owns its storage
        if param and dtype.is_floating_point:
            t = torch.nn.Parameter(t)
        out.append(t)
    return out


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([1, 64, 512]))
def test_the_fast_and_general_member_plans_agree(spec: Any, alignment: int) -> None:
    """The two fast forms against the rules they stand in for: ``_moves_alone`` (a bare tensor's
    members) against the general member rules, and ``_copies_into_itself`` (a copy into the
    moved tensor from an alias) against the byte-for-byte copy of the original's extent."""
    import unittest.mock

    import flatpool.ownership._adopt as adopt_mod

    lean, general = _make(spec, 0), _make(spec, 0)
    p1, p2 = FlatPool(alignment=alignment), FlatPool(alignment=alignment)
    r1 = p1.adopt(lean)  # bare tensors: the fast member plan
    with unittest.mock.patch.object(adopt_mod, "_copies_into_itself", lambda *a: False):
        r2 = p2.adopt([AdoptSpec(t, views=[t[()] if t.dim() == 0 else t.view(t.shape)])
                       for t in general])  # a view each: the general member rules, byte copies
    assert p1.describe().splitlines()[1:] == p2.describe().splitlines()[1:]  # but the name
    assert [i.slice.offset for i in r1.items] == [i.slice.offset for i in r2.items]
    assert [(i.original_nbytes, i.released, i.freed_bytes) for i in r1.items] == \
        [(i.original_nbytes, i.released, i.freed_bytes) for i in r2.items]
    assert torch.equal(p1.flat(torch.uint8), p2.flat(torch.uint8)) or _same_slices(p1, p2)
    for a, b in zip(lean, general):
        assert type(a) is type(b) and torch.equal(a, b) and a.stride() == b.stride()
        assert p1.slice_of(a) is not None and p2.slice_of(b) is not None
        assert a.requires_grad == b.requires_grad and a._version == b._version
    assert p1.is_valid() and p2.is_valid()


def _same_slices(p1: FlatPool, p2: FlatPool) -> bool:
    """Gaps between slices are uninitialized: compare the slices' bytes only."""
    return all(torch.equal(a.bytes(), b.bytes()) for a, b in zip(p1.slices(), p2.slices()))


def test_plain_tensors_named_alone_take_the_fast_member_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import flatpool.ownership._adopt as adopt_mod

    calls: list[str] = []
    monkeypatch.setattr(adopt_mod, "_expand", lambda *a, **k: calls.append("general") or [])
    FlatPool().adopt([torch.randn(3), torch.nn.Parameter(torch.randn(2, 2))])
    assert calls == []
