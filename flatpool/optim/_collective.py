"""A gradient pool as a collective's output (FSDP2's reduce-scatter writes a group's gradients
straight into it): whether the collective's parameters are exactly one parameter pool's flat
members at the collective's offsets. Per-member work: checked once per plan, pool storage and
layout (:class:`Layouts`), not at every backward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..pool import FlatPool
from ._grads import Grads, Run, run_of

NOT_MEMBERS = "not every member of the group is a flat member of this optimizer"
GAPS = "the pool has gaps between the padded shards (alignment > 1)"


def check(grads: Grads, pool: FlatPool, params: Sequence[torch.Tensor],
          offsets: Sequence[int]) -> Run | str:
    """The members of ``pool`` as a :class:`Run` when they are ``params`` (in that order) at
    byte ``offsets``, else why not."""
    idx = [i for i, m in enumerate(grads.members) if m.pool is pool]
    if [id(grads.params[i]) for i in idx] != [id(p) for p in params]:
        return NOT_MEMBERS
    if [grads.members[i].offset for i in idx] != list(offsets):
        return GAPS
    return run_of(grads, idx)


class Layouts:
    """The last check per parameter pool, for one plan (dies with it). A check is reused while
    the pool's storage and the caller's ``params``/``offsets`` objects are the same: identity,
    so no per-member comparison at a backward."""

    def __init__(self, grads: Grads) -> None:
        self._grads = grads
        self._last: dict[int, tuple[FlatPool, int | None, Sequence[torch.Tensor], Sequence[int],
                                    Run | str]] = {}
        """Per ``id(pool)``: the pool (kept: its id stays its own), its storage, the arguments
        checked and the result."""

    def get(self, pool: FlatPool, params: Sequence[torch.Tensor],
            offsets: Sequence[int]) -> Run | str:
        have = self._last.get(id(pool))
        storage = pool.storage_key
        if have is not None and have[1] == storage and have[2] is params and have[3] is offsets:
            return have[4]
        found = check(self._grads, pool, params, offsets)
        self._last[id(pool)] = (pool, storage, params, offsets, found)
        return found
