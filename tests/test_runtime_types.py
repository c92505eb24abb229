"""Every public annotation resolves at run time (issue 32.5).

``typing.get_type_hints`` is what Sphinx, runtime type checkers and IDEs call; it raised
``NameError`` for ``flatpool.live_pools`` and ``Slice`` (annotations naming ``FlatPool``, which
their modules import only for type checkers) and ``flatpool.memory.attribute`` (a quoted
``os.PathLike`` in an alias). This walks the ``__all__`` of every public module and resolves
every function, class, and public method (``__init__``, properties, static and class methods
included), so a regression anywhere fails here, naming what.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Iterator
from typing import Any

import pytest

PUBLIC_MODULES = ("flatpool", "flatpool.memory", "flatpool.optim", "flatpool.integrations.hsdp")


def _ours(fn: Any) -> bool:
    return inspect.isfunction(fn) and (fn.__module__ or "").startswith("flatpool")


def _methods(cls: type) -> Iterator[tuple[str, Any]]:
    for name in dir(cls):
        if name.startswith("_") and name != "__init__":
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, property):
            fns = [raw.fget, raw.fset]
        elif isinstance(raw, (staticmethod, classmethod)):
            fns = [raw.__func__]
        else:
            fns = [raw]
        for fn in fns:
            if _ours(fn):  # attrs-made ``__init__`` included (it carries the class's module)
                yield name, fn


def _public_callables() -> Iterator[tuple[str, Any]]:
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            where = f"{module_name}.{name}"
            if inspect.isclass(obj):
                yield where, obj
                for method, fn in _methods(obj):
                    yield f"{where}.{method}", fn
            elif inspect.isfunction(obj):
                yield where, obj


def test_the_walk_sees_the_public_api() -> None:
    names = {name for name, _ in _public_callables()}
    for expected in ("flatpool.live_pools", "flatpool.Slice", "flatpool.Slice.__init__",
                     "flatpool.FlatPool.adopt", "flatpool.FlatPool.capacity",
                     "flatpool.memory.attribute", "flatpool.optim.FlatOptimizer.step",
                     "flatpool.integrations.hsdp.FusedModule.kept_alive"):
        assert expected in names
    assert len(names) > 250


def test_every_public_annotation_resolves_at_run_time() -> None:
    failures = []
    for name, obj in _public_callables():
        try:
            typing.get_type_hints(obj)
        except Exception as exc:  # noqa: BLE001 - collect them all, then fail naming each
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failures, "annotations that do not resolve:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", ["live_pools", "Slice"])
def test_the_reported_ones_name_the_pool_class(name: str) -> None:
    import flatpool

    hints = typing.get_type_hints(getattr(flatpool, name))
    pool_hint = hints["return"] if name == "live_pools" else hints["pool"]
    assert pool_hint in (list[flatpool.FlatPool], flatpool.FlatPool)
