"""Name what keeps a storage alive: the Python holders a gc scan finds, or "C++ only".

Best effort, on the error path only (a gc scan is slow); the release proof never depends on it.
"""

from __future__ import annotations

import gc
import inspect
import os
import sys
import types
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from .. import _torch_compat as tc
from .._aliasing import own_storage

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


NUMPY_BASE = (
    "held by an object gc cannot see, such as the numpy array of t.numpy() or "
    "numpy.asarray(t) (it reads this memory through a raw pointer, so flatpool never moves "
    "that tensor; drop the array to release the original)"
)
"""A tensor without nameable holders on a storage torch marked non-resizable for numpy."""


CXX_ONLY = "held only from C++ (autograd saved tensors, hooks)"
"""Names a holder no Python object explains (it may let go by itself, like gloo's worker)."""


def only_cxx(reasons: Iterable[str]) -> bool:
    """Every reason :func:`name_pins` gave is :data:`CXX_ONLY`."""
    return all(r.startswith(CXX_ONLY) for r in reasons)


def tensors_on_storage(key: int, exclude: Iterable[int] = ()) -> list[torch.Tensor]:
    """Every Python-visible tensor object whose own storage is the one with ``key``."""
    exclude = set(exclude)
    found: list[torch.Tensor] = []
    with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        for obj in objects:
            if isinstance(obj, torch.Tensor) and id(obj) not in exclude:
                storage = own_storage(obj)
                if storage is not None and tc.storage_key(storage) == key:
                    found.append(obj)
    del objects
    return found


def movable_tensors_on(key: int, exclude: Iterable[int] = ()) -> list[torch.Tensor]:
    """The Python-visible tensors on storage ``key`` (a gc scan) that may be moved: not one gc
    sees no referrer of on a non-resizable storage, such as the base ``t.numpy()`` makes, which
    the ndarray reads by raw pointer (it stays, and pins the storage)."""
    found = tensors_on_storage(key, exclude)
    out = []
    for t in found:
        storage = own_storage(t)
        if storage is None or storage.resizable() or name_referrers(t, {id(found)}):
            out.append(t)
    del found
    return out


def _local_name(frame: types.FrameType, name: str) -> str:
    return (f"local variable {name!r} in {frame.f_code.co_name}() "
            f"({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")


def _ours(obj: Any) -> bool:
    return isinstance(obj, types.FrameType) and obj.f_code.co_filename.startswith(_PACKAGE_DIR)


def _frame_locals(frame: types.FrameType) -> list[tuple[str, Any]]:
    """A frame's locals, without leaving a snapshot behind: before Python 3.13 the dict cached
    on the frame would keep every value alive (pinning the storages being named)."""
    snapshot = frame.f_locals
    items = list(snapshot.items())
    if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        snapshot.clear()
    return items


def _locals_copies() -> set[int]:
    """Ids of the ``f_locals`` dicts of this stack's frames: a gc scan must not follow them
    (under a 3.10 tracer each call makes a new one); frames are named by the stack walk."""
    if sys.version_info >= (3, 13):
        return set()
    ids = set()
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            copy = frame.f_locals
            ids.add(id(copy))
            copy.clear()
            del copy
        frame = frame.f_back
    return ids


def _owner_of_dict(d: dict[Any, Any], skip: set[int], depth: int = 0) -> str | None:
    if depth > _MAX_PARENTS:
        return None
    skip = skip | _locals_copies()
    for owner in gc.get_referrers(d):
        if id(owner) in skip or _ours(owner):
            continue
        if isinstance(owner, torch.nn.Module):
            for attr in ("_parameters", "_buffers", "_modules"):
                if owner.__dict__.get(attr) is d:
                    return f"{type(owner).__name__}.{attr}"
        if isinstance(owner, types.ModuleType):
            return f"module {owner.__name__}"
        if getattr(owner, "__dict__", None) is d:
            return type(owner).__name__
        if isinstance(owner, dict):
            for k, v in owner.items():
                if v is d:
                    obj = next(  # the object whose attribute dict this is: "Type.attr"
                        (o for o in gc.get_referrers(owner)
                         if not isinstance(o, type) and getattr(o, "__dict__", None) is owner),
                        None)
                    if obj is not None and isinstance(k, str):
                        return f"{type(obj).__name__}.{k}"
                    parent = _owner_of_dict(owner, skip | {id(d)}, depth + 1)
                    key = f"param{tuple(k.shape)}" if isinstance(k, torch.Tensor) else repr(k)
                    return f"{parent or 'dict'}[{key}]"
        attrs = getattr(owner, "__dict__", None)  # an attribute of an object (inline values)
        if isinstance(attrs, dict) and not isinstance(owner, type):
            for k, v in attrs.items():
                if v is d:
                    return f"{type(owner).__name__}.{k}"
    return None


_MAX_PARENTS = 8
"""How many enclosing dicts a holder's name follows (``a[k1][k2]...``) before it stops."""


def _slot(obj: Any, name: str) -> Any:
    try:
        return object.__getattribute__(obj, name)
    except AttributeError:
        return None


def name_referrers(obj: Any, skip: Iterable[int] = (), depth: int = 0) -> list[str]:
    """Describe each Python object that references ``obj`` (attribute paths, keys, frames)."""
    skip_ids = set(skip) | {id(obj)} | _locals_copies()
    names: list[str] = []
    seen_frames: set[int] = set()
    for ref in gc.get_referrers(obj):
        if id(ref) in skip_ids or _ours(ref):
            continue
        if isinstance(ref, dict):
            keys = [k for k, v in ref.items() if v is obj]
            owner = _owner_of_dict(ref, skip_ids | {id(ref)})
            for k in keys:
                if owner is not None and owner.endswith("._parameters"):
                    names.append(f"{owner[: -len('._parameters')]}.{k} (parameter)")
                elif owner is not None and owner.endswith("._buffers"):
                    names.append(f"{owner[: -len('._buffers')]}.{k} (buffer)")
                elif owner is not None and "." not in owner and "[" not in owner:
                    names.append(f"{owner}.{k}" if isinstance(k, str) else f"{owner}[{k!r}]")
                else:
                    names.append(f"{owner or 'dict'}[{k!r}]")
        elif isinstance(ref, (list, tuple)):
            for idx, value in enumerate(ref):
                if value is obj:
                    names.append(f"{type(ref).__name__}[{idx}]")
        elif isinstance(ref, types.FrameType):
            seen_frames.add(id(ref))
            local = "?"
            for name, value in _frame_locals(ref):
                if value is obj:
                    local = name
            names.append(_local_name(ref, local))
        elif isinstance(ref, types.CellType):
            owners = [
                f for f in gc.get_referrers(ref)
                if isinstance(f, types.FunctionType)
                and not f.__code__.co_filename.startswith(_PACKAGE_DIR)
            ]
            for f in owners:
                names.append(f"a closure variable of {f.__qualname__}()")
        elif isinstance(getattr(ref, "__dict__", None), dict) and any(
            v is obj for v in vars(ref).values()
        ):  # an instance whose attributes live inline (no dict object for gc to report)
            names.extend(f"{type(ref).__name__}.{k}" for k, v in vars(ref).items() if v is obj)
        elif (isinstance(ref, torch.Tensor) and depth < _MAX_PARENTS
              and _slot(ref, "_local_tensor") is obj):
            # A wrapper (a DTensor in a state_dict or a detach() alias): name who holds *it*.
            outer = name_referrers(ref, skip_ids | {id(obj)}, depth + 1)
            names.extend(f"{n}._local_tensor" for n in outer or [f"a {type(ref).__name__}"])
        else:
            names.append(f"a {type(ref).__name__} object")
    # Locals of running frames are invisible to gc.get_referrers (Python >= 3.11): walk the stack.
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if id(frame) not in seen_frames and not _ours(frame):
            for name, value in _frame_locals(frame):
                if value is obj:
                    names.append(_local_name(frame, name))
        frame = frame.f_back
    del frame
    return names


def name_pins(storage: torch.UntypedStorage, skip: set[int], known: Iterable[str] = (),
              ) -> tuple[str, ...]:
    """Explain what pins ``storage``, beside ``skip``'s ids and the ``known`` reasons."""
    reasons = list(known)
    key = tc.storage_key(storage)
    found = tensors_on_storage(key, skip)
    skip = skip | {id(found)}
    with tc.no_torch_function():
        bases = {id(b) for t in found if (b := tc.impl_base(t)) is not None}
    unseen = NUMPY_BASE if not storage.resizable() else CXX_ONLY
    for t in found:
        where = name_referrers(t, skip)
        if not where and id(t) in bases:
            continue  # the base of a view found here: the view's holders keep it (autograd's link)
        with tc.no_torch_function():
            desc = f"tensor {tuple(tc.impl_size(t))} {str(tc.impl_dtype(t)).replace('torch.', '')}"
        reasons.extend(f"{w} ({desc})" for w in where or [unseen])
    storage_refs = name_referrers(storage, skip)
    reasons.extend(f"{w} (the UntypedStorage object itself)" for w in storage_refs)
    if not reasons:
        reasons.append(CXX_ONLY)
    # The holders a user can drop first; "held only from C++" last, and only as what it is.
    return tuple(sorted(reasons, key=lambda r: r.startswith((CXX_ONLY, NUMPY_BASE))))
