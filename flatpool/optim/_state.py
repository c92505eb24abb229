"""Pooled optimizer state: each member's state entries are views of its companion pools.

``optimizer.state`` stays per parameter, so ``state_dict``, ``deepcopy`` and DCP see torch's
shape. An entry torch or the user replaced is adopted (values copied in, then the entry rebound,
so an interrupt between leaves the user's tensor); anything else is torch's to step.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from typing import Any

import torch

from .. import _torch_compat as tc
from .._aliasing import local_tensor
from ._torch import is_dtensor, step_dtype
from ._torch import local_of as wrapped_local
from ._companions import Companions, StepSlots, views
from ._layout import Member, multi_dim
from ._rules import Rule
from ._wrap import wrap_like

Assign = Callable[[dict[Any, Any], str, Any], None]
"""How an entry is rebound (``d[key] = value``; setup journals it)."""


def plain_assign(d: dict[Any, Any], key: str, value: Any) -> None:
    d[key] = value


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to past its last (strided, at least one element)."""
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


POOLED, FRESH = "pooled", "fresh"
_data_ptr = torch.Tensor.data_ptr
_contiguous = torch.Tensor.is_contiguous
Entry = tuple[int, str, torch.Tensor]
"""(member index, state key, the entry found there)."""


class State:
    """The pooled state of ``members`` (plan order); ``groups[i]`` is member ``i``'s group."""

    def __init__(self, opt: torch.optim.Optimizer, rule: Rule, members: Sequence[Member],
                 groups: Sequence[dict[str, Any]], companions: Companions) -> None:
        self.opt, self.rule = opt, rule
        self.members = list(members)
        self.params = [m.param for m in self.members]
        self.wrapped = [local_tensor(p) is not p for p in self.params]
        self._wrapped_at = [i for i, w in enumerate(self.wrapped) if w]
        self._multi = multi_dim(self.members)
        """Members whose entries' contiguity is checked (:func:`~._layout.multi_dim`)."""
        self.companions = companions
        n = len(self.members)
        self._kinds: dict[str, tuple[list[torch.Tensor | None], list[torch.Tensor | None]]] = {}
        """kind -> (each member's entry, its local tensor); None: not made yet."""
        self._addrs: dict[str, list[int | None]] = {}
        """kind -> each member's local tensor's data pointer when made: an entry whose data
        was moved (``entry.data = x``, ``set_``; offloading code does it) is not pooled."""
        self.dicts: list[dict[str, Any] | None] = [None] * n
        """Per member: the state dict object last seen with every entry pooled."""
        self.slots: dict[tuple[int, torch.dtype, torch.device], StepSlots] = {}
        self._slot_of: list[tuple[StepSlots, int] | None] = [None] * n
        self._unchanged = False
        self._seen: tuple[list[Any], list[Any]] | None = None
        """``optimizer.state``'s keys and values when :meth:`_dicts_unchanged` last held."""
        if rule.has_step:
            self._plan_steps(groups)

    def _plan_steps(self, groups: Sequence[dict[str, Any]]) -> None:
        """Each member's element of a step companion of torch's step dtype and device."""
        by_pool: dict[int, list[int]] = {}
        for i, m in enumerate(self.members):
            by_pool.setdefault(id(m.pool), []).append(i)
        for idx in by_pool.values():
            idx.sort(key=lambda i: self.members[i].offset)
            order = [self.members[i] for i in idx]
            for i in idx:
                fused = bool(groups[i].get("fused"))
                m = self.members[i]
                dtype = step_dtype(fused)
                device = m.pool.device if fused else torch.device("cpu")
                key = (id(m.pool), dtype, device)
                slots = self.slots.get(key)
                if slots is None:
                    slots = self.slots[key] = StepSlots(m.pool, order, dtype, device)
                self._slot_of[i] = (slots, slots.index[id(m)])

    # -- where --------------------------------------------------------------------------
    def _kind(self, kind: str) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        pair = self._kinds.get(kind)
        if pair is None:  # one store: an interrupt never leaves half of it
            self._addrs.setdefault(kind, [None] * len(self.members))
            pair = self._kinds[kind] = ([None] * len(self.members), [None] * len(self.members))
        return pair

    def step_slot(self, i: int) -> tuple[StepSlots, int]:
        got = self._slot_of[i]
        assert got is not None
        return got

    def ensure(self, kind: str, indices: Sequence[int]) -> None:
        """Make the pooled ``kind`` entries of members ``indices`` that do not exist yet."""
        entries, locals_ = self._kind(kind)
        addrs = self._addrs[kind]
        todo = [i for i in indices if entries[i] is None]
        if not todo:
            return
        by_pool: dict[int, list[int]] = {}
        for i in todo:
            key = id(self._slot_of[i][0]) if kind == "step" else id(self.members[i].pool)  # type: ignore[index]
            by_pool.setdefault(key, []).append(i)
        for idx in by_pool.values():
            if kind == "step":
                slots = self.step_slot(idx[0])[0]
                made = slots.views([self.step_slot(i)[1] for i in idx])
                for i, v in zip(idx, made):
                    entries[i] = locals_[i] = v
                    addrs[i] = _data_ptr(v)
                continue
            ms = [self.members[i] for i in idx]
            made = views(self.companions.get(ms[0].pool, kind), [m.offset for m in ms],
                         [m.shape for m in ms], [m.dtype for m in ms])
            for i, m, local in zip(idx, ms, made):
                locals_[i] = local
                addrs[i] = _data_ptr(local)
                entries[i] = wrap_like(m.param, local) if self.wrapped[i] else local

    def view_of(self, i: int, kind: str) -> torch.Tensor:
        """Member ``i``'s pooled ``kind`` entry (made on first use)."""
        v = self._kind(kind)[0][i]
        if v is None:
            self.ensure(kind, [i])
            v = self._kinds[kind][0][i]
            assert v is not None
        return v

    def local_of(self, i: int, kind: str) -> torch.Tensor:
        view = self.view_of(i, kind)
        local = self._kinds[kind][1][i]
        return view if local is None else local

    def _at_place(self, i: int, kind: str) -> bool:
        """Member ``i``'s pooled ``kind`` entry still holds its place's memory."""
        entries, locals_ = self._kind(kind)
        entry, local = entries[i], locals_[i]
        if entry is None or local is None:
            return False
        if self.wrapped[i] and kind != "step" and wrapped_local(entry) is not local:
            return False
        return _data_ptr(local) == self._addrs[kind][i] and (
            kind == "step" or len(self.members[i].shape) < 2 or local.is_contiguous())

    def _all_at_place(self, kind: str, idx: list[int] | None = None) -> bool:
        """:meth:`_at_place` of every member, or of members ``idx`` (C-level passes: their
        entries exist)."""
        entries, every_local = self._kinds[kind]
        locals_, addrs = every_local, self._addrs[kind]
        wrapped, multi = self._wrapped_at, self._multi
        if idx is not None:
            chosen = set(idx)
            wrapped, multi = [i for i in wrapped if i in chosen], [i for i in multi if i in chosen]
            locals_, addrs = list(map(locals_.__getitem__, idx)), list(map(addrs.__getitem__, idx))
        if kind != "step" and wrapped and not all(map(  # (a step entry is a plain tensor)
                operator.is_, map(wrapped_local, map(entries.__getitem__, wrapped)),  # type: ignore[arg-type]
                map(every_local.__getitem__, wrapped))):
            return False
        return (list(map(_data_ptr, locals_)) == addrs  # type: ignore[arg-type]
                and (kind == "step"  # (0-d: always contiguous)
                     or all(map(_contiguous, map(every_local.__getitem__, multi)))))  # type: ignore[arg-type]

    def _forget(self, i: int, kind: str) -> None:
        """Member ``i``'s ``kind`` entry left its place: it is the user's now (adopted like any
        foreign entry); a new view is made for the place."""
        entries, locals_ = self._kind(kind)
        entries[i] = locals_[i] = self._addrs[kind][i] = None

    def keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The entries torch keeps for a parameter of ``group``, in its order."""
        return (("step",) if self.rule.has_step else ()) + self.rule.kinds(group)

    # -- checking ---------------------------------------------------------------------------
    def all_pooled(self, lo: int, hi: int, group: dict[str, Any]) -> bool:
        """Every member of ``[lo, hi)`` has exactly its pooled entries (C-level passes)."""
        keys = self.keys(group)
        if not keys:
            return True
        sts = self.dicts[lo:hi] if self._unchanged else list(
            map(self.opt.state.get, self.params[lo:hi]))
        if not all(map(operator.is_, sts, self.dicts[lo:hi])):
            return False
        for k in keys:
            pair = self._kinds.get(k)
            if pair is None:
                return False
            try:
                got = list(map(operator.itemgetter(k), sts))  # type: ignore[arg-type]
            except (KeyError, TypeError):
                return False
            if not all(map(operator.is_, got, pair[0][lo:hi])):
                return False
            if not self._all_at_place(k, list(range(lo, hi))):
                return False
        return True

    def begin(self) -> None:
        """Before a step's checks: one look for all groups at whether the state dicts changed."""
        self._unchanged = self._dicts_unchanged()

    def _dicts_unchanged(self) -> bool:
        """``optimizer.state`` maps each member to its dict in :attr:`dicts` (no tensor hashed)."""
        state = self.opt.state
        seen = self._seen
        if (seen is not None and len(state) == len(seen[0])
                and all(map(operator.is_, state.keys(), seen[0]))
                and all(map(operator.is_, state.values(), seen[1]))):
            return True
        keys, values = list(state.keys()), list(state.values())
        known = {id(p): d for p, d in zip(self.params, self.dicts) if d is not None}
        if all(known.get(id(p)) is d for p, d in zip(keys, values) if id(p) in known) and len(
                known) == sum(1 for p in keys if id(p) in known):
            self._seen = (keys, values)
            return True
        self._seen = None
        return False

    def pooled_groups(self, spans: Sequence[tuple[int, int, dict[str, Any]]]) -> list[bool]:
        """:meth:`all_pooled` of each ``(lo, hi, group)``, one pass per key when keys agree."""
        keys = {self.keys(g) for _, _, g in spans}
        if self._unchanged and len(keys) == 1:
            if self._every_entry_pooled(next(iter(keys))):  # the steady step: one pass a key
                return [True] * len(spans)
            ok = [True] * len(self.members)
            try:
                for k in next(iter(keys)):
                    pair = self._kinds.get(k)
                    if pair is None:
                        return [lo == hi for lo, hi, _ in spans]
                    got = map(operator.itemgetter(k), self.dicts)  # type: ignore[arg-type]
                    ok = list(map(operator.and_, ok, map(operator.is_, got, pair[0])))
                    if not self._all_at_place(k, list(compress(range(len(ok)), ok))):
                        ok = [o and self._at_place(i, k) for i, o in enumerate(ok)]
            except (KeyError, TypeError):  # a member without a recorded dict or entry
                pass
            else:
                return [all(ok[lo:hi]) for lo, hi, _ in spans]
        return [self.all_pooled(lo, hi, g) for lo, hi, g in spans]

    def _every_entry_pooled(self, keys: tuple[str, ...]) -> bool:
        """Every member's recorded dict holds its pooled entry under each of ``keys`` (one
        C-level pass a key, no list made)."""
        dicts = self.dicts
        try:
            for k in keys:
                pair = self._kinds.get(k)
                if pair is None or not all(map(operator.is_, map(operator.itemgetter(k), dicts),  # type: ignore[arg-type]
                                               pair[0])):
                    return False
        except (KeyError, TypeError):  # a member without a recorded dict or entry
            return False
        return all(map(self._all_at_place, keys))  # (every entry exists: identical to one)

    def classify(self, i: int, group: dict[str, Any], adopt: list[Entry]) -> str:
        """Member ``i``: :data:`POOLED` (entries to adopt added to ``adopt``), :data:`FRESH`, or
        why torch's own step must handle it."""
        st = self.opt.state.get(self.params[i])
        if self.rule.fresh(st, group):
            return FRESH
        keys = self.keys(group)
        if not keys:
            return POOLED
        assert st is not None
        found = []
        for k in keys:
            v = st.get(k)
            if v is None:
                return f"its optimizer state has no {k!r} (torch's own step decides what that means)"
            if v is self.view_of(i, k):
                if self._at_place(i, k):
                    continue
                self._forget(i, k)  # its data was moved: the user's tensor now
            why = self._foreign(i, k, v)
            if why is not None:
                return why
            found.append((i, k, v))
        adopt.extend(found)
        if not found:
            self._seen = None  # first: the snapshot was checked against the old dicts
            self.dicts[i] = st
        return POOLED

    def existing(self, indices: Sequence[int], group: dict[str, Any]) -> list[Entry]:
        """The adoptable entries members ``indices`` hold now."""
        state = self.opt.state
        keys = self.keys(group)
        sts: list[tuple[int, dict[str, Any]]] = [
            (i, st) for i in indices if (st := state.get(self.params[i]))]
        out: list[Entry] = []
        for k in keys:
            self.ensure(k, [i for i, _ in sts])
            mine = self._kinds[k][0] if k in self._kinds else []
            for i, st in sts:
                v = st.get(k)
                if v is not None and v is not mine[i] and self._foreign(i, k, v) is None:
                    out.append((i, k, v))
        return [] if self.shared(out) else out  # (the step decides: torch steps them)

    def shared(self, items: Sequence[Entry], others: Iterable[int | None] = ()) -> str | None:
        """Why copying ``items`` into their places would not be torch's step: torch updates an
        entry in place, so one on the memory of flatpool's pools (another member's entry) or
        two on the same bytes are seen through each other. ``others``: more storage keys."""
        if not items:
            return None
        ours = {p.storage_key for p in self.pools()}
        ours.update({m.pool.storage_key for m in self.members}, others)
        ours.discard(None)
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for i, k, v in items:
            local = wrapped_local(v) if self.wrapped[i] and k != "step" else v
            key = tc.storage_address(local)
            if key in ours:
                return (f"state {k!r} of a parameter shares memory with flatpool's pools "
                        "(another parameter's entry): torch's step updates it in place")
            if local.numel():
                start = local.data_ptr()
                spans.setdefault(key, []).append((start, start + _extent(local), k))
        for found in spans.values():
            found.sort()
            for (_, end, k), (start, _, _) in zip(found, found[1:]):
                if start < end:
                    return (f"two state entries ({k!r}) share bytes: torch's step updates them "
                            "in place, each seeing the other")
        return None

    def _foreign(self, i: int, kind: str, v: Any) -> str | None:
        """Why entry ``v`` cannot be adopted into member ``i``'s place, or ``None``."""
        m = self.members[i]
        if not isinstance(v, torch.Tensor):
            return f"state {kind!r} is a {type(v).__name__}, not a tensor"
        if kind == "step":
            slots, _ = self.step_slot(i)
            if (type(v) is not torch.Tensor or v.dim() != 0 or v.dtype != slots.dtype
                    or v.device != slots.device or v.requires_grad):
                return (f"state 'step' is a {tuple(v.shape)} {v.dtype} tensor on {v.device}, "
                        f"not torch's 0-d {slots.dtype} on {slots.device}")
            return None
        if self.wrapped[i]:
            if is_dtensor(m.param) != is_dtensor(v) or not hasattr(v, "_local_tensor"):
                return f"state {kind!r} is a {type(v).__name__}, the parameter a {type(m.param).__name__}"
            local = v._local_tensor
        elif hasattr(v, "_local_tensor"):
            return f"state {kind!r} is a {type(v).__name__}, the parameter a plain tensor"
        else:
            local = v
        if (local.layout != torch.strided or local.shape != m.shape or local.dtype != m.dtype
                or local.device != m.pool.device or v.requires_grad):
            return (f"state {kind!r} ({tuple(local.shape)}, {local.dtype}, {local.device}) is not "
                    f"shaped like its parameter ({tuple(m.shape)}, {m.dtype})")
        return None

    # -- changing ---------------------------------------------------------------------------
    def adopt(self, items: Sequence[Entry], assign: Assign = plain_assign) -> None:
        """Copy each foreign entry into its member's place, then rebind the entry."""
        if not items:
            return
        dst = [self.local_of(i, k) for i, k, _ in items]
        src = [wrapped_local(v) if self.wrapped[i] and k != "step" else v for i, k, v in items]
        with torch.no_grad():  # a view of the same companion at another place: copied first
            torch._foreach_copy_(dst, [s.clone() if tc.storage_address(s) == tc.storage_address(d)
                                       else s for d, s in zip(dst, src)])
        del dst, src
        state = self.opt.state
        done: dict[int, None] = {}
        for i, k, _ in items:
            assign(state[self.params[i]], k, self.view_of(i, k))
            done[i] = None
        self._seen = None  # first: the snapshot was checked against the old dicts
        for i in done:
            self.dicts[i] = state[self.params[i]]

    def make_fresh(self, indices: Sequence[int], group: dict[str, Any]) -> None:
        """State as torch makes it at a first step (zeros), each member's entries at once."""
        keys = self.keys(group)
        for k in keys:
            self.ensure(k, indices)
        with torch.no_grad():
            for k in keys:
                torch._foreach_zero_([self.local_of(i, k) for i in indices])
        state = self.opt.state
        for i in indices:
            entries = {k: self.view_of(i, k) for k in keys}
            st = state[self.params[i]]  # torch: ``state = self.state[p]``
            st.update(entries)
            self._seen = None  # first: the snapshot was checked against the old dicts
            self.dicts[i] = st

    def install_made(self, indices: Sequence[int], kind: str) -> None:
        """After a kernel made ``kind`` (its values already copied into the places)."""
        self.ensure(kind, indices)
        state = self.opt.state
        for i in indices:
            st = state[self.params[i]]
            st[kind] = self.view_of(i, kind)
            self._seen = None  # first: the snapshot was checked against the old dicts
            self.dicts[i] = st

    def pools(self) -> list[Any]:
        return self.companions.pools() + [s.pool for s in self.slots.values()]
