"""Pooled gradients: every member's ``.grad`` is a view of one buffer per parameter pool,
laid out like the pool, so a flat step and a flat clip read one tensor per segment.

Autograd and FSDP2 both add into an existing ``.grad`` in place (FSDP2: ``grad._local_tensor +=
reduce-scatter output``) and install a new tensor only when ``.grad`` is ``None``. So the
buffers are kept installed: :meth:`GradBuffers.install` (a forward pre-hook, and the start of
every flat step) puts a zeroed pooled view where ``optimizer.zero_grad()`` left ``None``, and
copies a gradient someone installed elsewhere into its place, which lets the outside storage
die. ``zero_grad(set_to_none=False)`` zeroes the pooled views in place.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from ..aliasing import local_tensor
from ..pool import FlatPool
from .buffers import Mirrors, member_view, segment_view
from .errors import FlatStepError
from .layout import Member, Segment
from .wrap import wrap_like


_grad_of = operator.attrgetter("grad")


class GradBuffers:
    """The gradient views of ``members``, one mirror of each member's pool."""

    def __init__(self, members: Sequence[Member], mirrors: Mirrors) -> None:
        self.members = list(members)
        self._bufs: dict[int, FlatPool] = {}
        for m in self.members:
            if id(m.pool) not in self._bufs:
                self._bufs[id(m.pool)] = mirrors.get(m.pool, "grad")[0]
        self.locals = [member_view(self._bufs[id(m.pool)], m) for m in self.members]
        self.views = [wrap_like(m.param, v) for m, v in zip(self.members, self.locals)]
        self._params = [m.param for m in self.members]
        self.install()

    def buffer(self, pool: FlatPool) -> FlatPool:
        return self._bufs[id(pool)]

    def pools(self) -> list[FlatPool]:
        return list(self._bufs.values())

    def flat(self, segment: Segment) -> torch.Tensor:
        return segment_view(self._bufs[id(segment.pool)], segment)

    def install(self, *, fill_missing: bool = True) -> list[Member]:
        """Make every member's ``.grad`` its pooled view, in one pass over the members.

        A gradient elsewhere is copied into the view (its own storage then dies). ``None``
        becomes a zeroed view (all of them at once: one fill of each buffer) with
        ``fill_missing``; otherwise it stays ``None`` and the members left so are returned.
        """
        grads = list(map(_grad_of, self._params))
        if all(map(operator.is_, grads, self.views)):
            return []
        todo_none: list[int] = []
        todo_copy: list[int] = []
        for i, (g, v) in enumerate(zip(grads, self.views)):
            if g is v:
                continue
            if g is None:
                todo_none.append(i)
            else:
                todo_copy.append(i)
        missing = [] if fill_missing else [self.members[i] for i in todo_none]
        if not fill_missing:
            todo_none = []
        with torch.no_grad():
            if todo_copy:
                src = []
                for i in todo_copy:
                    g = local_tensor(self.members[i].param.grad)  # type: ignore[arg-type]
                    if g.is_sparse or g.shape != self.locals[i].shape or g.dtype != self.locals[i].dtype:
                        raise FlatStepError(
                            f"{self._name(i)}: its gradient ({g.layout}, {tuple(g.shape)}, "
                            f"{g.dtype}) cannot be pooled at its place "
                            f"({tuple(self.locals[i].shape)}, {self.locals[i].dtype}); "
                            "set it to None or give it the parameter's local shape and dtype")
                    src.append(g)
                torch._foreach_copy_([self.locals[i] for i in todo_copy], src)
                for i in todo_copy:
                    self.members[i].param.grad = self.views[i]
            if todo_none:
                if len(todo_none) == len(self.members):
                    for buf in self._bufs.values():
                        buf.view_bytes(0, buf.capacity).zero_()
                else:
                    torch._foreach_zero_([self.locals[i] for i in todo_none])
                for i in todo_none:
                    self.members[i].param.grad = self.views[i]
        return missing

    def _name(self, i: int) -> str:
        m = self.members[i]
        return f"param_groups[{m.group}] parameter {tuple(m.param.shape)} at byte {m.offset} of {m.pool.name!r}"


__all__ = ["GradBuffers"]
