"""Checkpoints of pooled tensors: pickle and deep-copy them as if they were ordinary tensors.

torch serializes a tensor with its whole storage: for a pooled tensor that is the pool, and
``torch.save`` refuses once the pool holds two dtypes; ``copy.deepcopy`` copies the whole pool
too. ``state_dict()`` returns fresh tensors, so the fix sits on the tensor itself:

* **pickling**: a :mod:`copyreg` reducer for plain ``torch.Tensor`` (``nn.Parameter`` pickles
  its ``.data``). ``ForkingPickler`` puts torch's shared-memory reducer above the copyreg
  table, so tensors sent to other processes still share memory.
* **deep copies**: ``torch.Tensor.__deepcopy__`` is wrapped (there is no registry for it).

Both act only on a plain, strided, leaf tensor on a live pool's storage larger than its own
bytes; it is replaced by a *compact twin* (its own bytes, same geometry, dtype, bits and
attributes), which loads anywhere, ``weights_only=True`` included. Tensors covering exactly the
same bytes as the same dtype share one twin per save or deepcopy, so tied weights stay tied.
Subclasses go to torch untouched (torch's DTensor pickles its plain ``_local_tensor``).
"""

from __future__ import annotations

import copy
import copyreg
import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.overrides import handle_torch_function, has_torch_function_unary

from . import _torch_compat as tc
from .pool import FlatPool
from ._state import pool_of_storage, was_pool_storage

Reducer = Callable[[torch.Tensor], Any]
DeepCopy = Callable[[torch.Tensor, Optional[dict[Any, Any]]], torch.Tensor]


_lock = threading.Lock()
_prior_reducer: Reducer | None = None
"""What ``copyreg.dispatch_table[torch.Tensor]`` held before :func:`install` (normally none)."""
_prior_deepcopy: DeepCopy | None = None
"""``torch.Tensor.__deepcopy__`` as it was before :func:`install`."""

_twins: weakref.WeakValueDictionary[tuple[int, int, int, torch.dtype], torch.UntypedStorage] = (
    weakref.WeakValueDictionary())
"""Twin storages of the saves in progress, by (pool storage, byte start, byte end, dtype):
alive while a save holds them; a hit is reused only if its bytes still equal the pool's."""
_twins_lock = threading.Lock()


def _extent(t: torch.Tensor) -> int:
    """Elements of ``t``'s storage its strided view can reach, from its storage offset."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _viewed_storage_key(t: torch.Tensor) -> int | None:
    """The key of ``t``'s storage if ``t`` is a plain strided tensor viewing only part of it."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_meta:
        return None
    if t.is_quantized or t.is_nested:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # backends without storages
        return None
    nbytes, item = storage.nbytes(), t.element_size()
    if t.storage_offset() == 0:  # a tensor that reaches its whole storage is saved as it is
        if t.numel() * item >= nbytes and t.is_contiguous():
            return None
        if _extent(t) * item >= nbytes:
            return None
    return tc.storage_key(storage)


def pool_of(t: torch.Tensor) -> FlatPool | None:
    """The live, materialized pool whose storage ``t`` views part of, else ``None``."""
    key = _viewed_storage_key(t)
    state = None if key is None else pool_of_storage(key)
    return None if state is None else state.public


def pooled(t: torch.Tensor) -> bool:
    """``t`` views part of a pool's storage, even after ``del pool`` (the storage lives on)."""
    key = _viewed_storage_key(t)
    return key is not None and was_pool_storage(key)


def _span(t: torch.Tensor) -> torch.Tensor:
    """A base-less 1-D tensor over the elements ``t`` can reach (no copy)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), (_extent(t),), (1,))
    return out


def _twin_on(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """A leaf tensor with ``t``'s geometry at the start of ``storage`` (a copy of t's span)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(storage, 0, t.shape, t.stride())
    tc.copy_tensor_flags(t, out)  # conj / neg bits
    return out


def _bytes(
    storage: torch.UntypedStorage, start: int, nbytes: int, device: torch.device
) -> torch.Tensor:
    out = torch.empty(0, dtype=torch.uint8, device=device)
    out.set_(storage, start, (nbytes,), (1,))
    return out


def _twin_storage(t: torch.Tensor, memo: dict[Any, Any] | None) -> torch.UntypedStorage:
    """A fresh storage holding a copy of ``t``'s span, shared by equal spans (see ``_twins``)."""
    span = _span(t)
    start = int(t.storage_offset()) * t.element_size()
    nbytes = span.numel() * t.element_size()
    key = (tc.storage_key(t.untyped_storage()), start, start + nbytes, t.dtype)
    if memo is not None:  # deepcopy: its memo lives exactly as long as the copy
        memo_key = ("flatpool.checkpoint", *key)
        found = memo.get(memo_key)
        if found is None:
            found = memo[memo_key] = tc.clone(span).untyped_storage()
        return found
    with _twins_lock:
        cached = _twins.get(key)
    if cached is not None and cached.nbytes() == nbytes:
        mine = _bytes(t.untyped_storage(), start, nbytes, t.device)
        if torch.equal(_bytes(cached, 0, nbytes, t.device), mine):
            return cached
    fresh = tc.clone(span).untyped_storage()
    with _twins_lock:
        _twins[key] = fresh
    return fresh


def compact_copy(t: torch.Tensor) -> torch.Tensor:
    """A leaf copy of ``t`` holding only the bytes ``t`` can reach, strides, flags and
    attributes kept (``clone()`` loses strides; pickling copies the whole storage)."""
    with torch.no_grad():
        out = _twin_on(t, tc.clone(_span(t)).untyped_storage())
    return _finish(t, out, None)


def _finish(t: torch.Tensor, out: torch.Tensor, memo: dict[Any, Any] | None) -> torch.Tensor:
    if t.requires_grad:
        out.requires_grad_(True)
    state = t.__dict__
    if state:
        out.__dict__ = copy.deepcopy(state, memo) if memo is not None else dict(state)
    return out


def _reduce(t: torch.Tensor) -> Any:
    """copyreg reducer for ``torch.Tensor``: compact pooled tensors, delegate the rest."""
    if pooled(t):
        from torch.utils.hooks import warn_if_has_hooks

        warn_if_has_hooks(t)  # as torch does: hooks are never saved
        with torch.no_grad():
            twin = _twin_on(t, _twin_storage(t, None))
        t = _finish(t, twin, None)
    if _prior_reducer is not None:
        return _prior_reducer(t)
    return t.__reduce_ex__(2)  # type: ignore[no-untyped-call]


def _deepcopy(self: torch.Tensor, memo: dict[Any, Any] | None) -> torch.Tensor:
    """``torch.Tensor.__deepcopy__`` that copies a pooled tensor's own bytes, not its pool."""
    prior = _prior_deepcopy
    assert prior is not None, "flatpool.checkpoint: __deepcopy__ wrapper without an original"
    if memo is None:
        memo = {}
    if type(self) is torch.Tensor and self.is_leaf and pooled(self):
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        with torch.no_grad():
            out = _twin_on(self, _twin_storage(self, memo))
        if self.requires_grad:
            out.requires_grad_(True)
        if self.grad is not None:
            out.grad = copy.deepcopy(self.grad, memo)
        if self.__dict__:
            out.__dict__ = copy.deepcopy(self.__dict__, memo)
        memo[id(self)] = out
        return out
    if has_torch_function_unary(self):
        # Hand subclasses and modes torch's own function, so tables keyed on it still match.
        return handle_torch_function(prior, (self,), self, memo)
    return prior(self, memo)


def is_installed() -> bool:
    """True while both the reducer and the ``__deepcopy__`` wrapper are in place."""
    return (
        copyreg.dispatch_table.get(torch.Tensor) is _reduce
        and getattr(torch.Tensor, "__deepcopy__", None) is _deepcopy)


def install() -> None:
    """Make pickling and deep copies of pooled tensors compact (idempotent; on import)."""
    global _prior_reducer, _prior_deepcopy
    with _lock:
        if copyreg.dispatch_table.get(torch.Tensor) is not _reduce:
            _prior_reducer = copyreg.dispatch_table.get(torch.Tensor)
            copyreg.pickle(torch.Tensor, _reduce)
        current = torch.Tensor.__deepcopy__
        if current is not _deepcopy:
            _prior_deepcopy = current
            torch.Tensor.__deepcopy__ = _deepcopy  # type: ignore[method-assign]


def uninstall() -> None:
    """Give torch its own behaviour back (whole storages; mixed-dtype pools refuse to save)."""
    with _lock:
        if copyreg.dispatch_table.get(torch.Tensor) is _reduce:
            if _prior_reducer is None:
                del copyreg.dispatch_table[torch.Tensor]
            else:
                copyreg.dispatch_table[torch.Tensor] = _prior_reducer
        if torch.Tensor.__deepcopy__ is _deepcopy and _prior_deepcopy is not None:
            torch.Tensor.__deepcopy__ = _prior_deepcopy  # type: ignore[method-assign]


__all__ = ["compact_copy", "install", "is_installed", "pool_of", "pooled", "uninstall"]
