"""Keep a group fused from inside a framework's forward, without ever breaking the step.

Inside a forward, a user's reference to an original is kept alive and reported once
(``on_pinned="warn"``); a group whose dtype, device or size changed is planned anew; any other
:class:`flatpool.FlatPoolError` leaves the group unfused this step. The path depends only on
structure, the same on every rank, so no rank-local problem hangs the next collective.
``on_pinned="raise"`` turns the policy off.

Two cases are never retried: a group skipped for its structure (``GroupBuffers.final``: world
size 1, CPU offload, no member), and anything while autograd's backward runs (activation
checkpointing's recompute calls the forward hooks there, where storages cannot move): the group
stays as it is, without a warning, until the next forward (under ``on_pinned="raise"`` the
engine's ``AdoptionError`` says why instead).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence

from attrs import evolve

from flatpool import FlatPoolError, OnPinned, OriginalKeptAliveWarning
from flatpool import _torch_compat as tc
from flatpool._warn import logger, warn
from flatpool.errors import UnfusedGroupWarning

from .group import GroupBuffers
from ._kept import KeptAlive
from ._protocol import ShardedParam
from .validity import is_valid, needs_replan, readopt_group

IN_BACKWARD = ("unfused while autograd's backward pass runs (activation checkpointing's "
               "recompute), where storages cannot move: tried again at the next forward")

Build = Callable[[OnPinned, KeptAlive], GroupBuffers]
"""Adopt a group anew (``adopt_group`` / ``materialize_group`` with the caller's arguments)."""


class _Quiet(warnings.catch_warnings):
    """The engine's batch-level kept-alive warning is replaced by one per original."""

    def __enter__(self) -> None:
        super().__enter__()
        warnings.filterwarnings("ignore", category=OriginalKeptAliveWarning)


def keep_fused(
    previous: GroupBuffers,
    params: Sequence[ShardedParam],
    build: Build,
    *,
    on_pinned: OnPinned = "warn",
    where: str = "group",
) -> tuple[GroupBuffers, int]:
    """Bring one group into its pools, or leave it unfused; returns ``(buffers, re-adopted)``."""
    told = previous.kept.logged
    if previous.final:  # its structure: no step changes it
        return previous, 0
    if previous.adopted and is_valid(previous, params):
        previous.kept.refresh()
        return previous, 0
    if tc.in_backward() and on_pinned != "raise":  # (strict: the engine's AdoptionError)
        if previous.adopted:  # its pools no longer describe the members: do not hand them out
            previous = GroupBuffers(skipped=IN_BACKWARD, kept=previous.kept)
            if IN_BACKWARD not in told:
                told.add(IN_BACKWARD)
                logger.info("%s: %s", where, IN_BACKWARD)
        return previous, 0
    moved = 0
    out = previous
    try:
        with _Quiet() if on_pinned != "raise" else warnings.catch_warnings():
            replan = needs_replan(previous, params)
            if previous.adopted and replan is None:
                moved = readopt_group(previous, params, on_pinned=on_pinned)
                logger.info("%s: re-adopted %d moved member(s)", where, moved)
            else:
                if replan is not None:
                    logger.info("%s: planned anew (%s)", where, replan)
                    previous = GroupBuffers(skipped=replan, kept=previous.kept)  # old pools go
                out = _built(build(on_pinned, previous.kept), previous.kept, where)
    except FlatPoolError as e:
        if on_pinned == "raise":
            raise
        reason = f"{type(e).__name__}: {e}"
        out = GroupBuffers(skipped=f"fusion failed, the group trains unfused: {reason}",
                           kept=previous.kept)
        if reason not in told:
            told.add(reason)
            logger.info("%s: %s", where, out.skipped)  # the warning is the alert
            warn(f"{where}: {out.skipped}. It is tried again at the next step.",
                 UnfusedGroupWarning, past_torch=True)
    out.kept.report()
    return out, moved


BuildAll = Callable[[OnPinned], list[GroupBuffers]]
"""Adopt several groups anew in one transaction, all or nothing."""


def keep_all_fused(
    fresh: Sequence[GroupBuffers], build: BuildAll, *, on_pinned: OnPinned = "warn",
    where: Sequence[str],
) -> list[GroupBuffers] | None:
    """:func:`keep_fused` for groups never adopted, in one transaction; ``None`` when that fails
    (nothing changed), and the caller goes group by group: a failure changes only the cost."""
    try:
        with _Quiet() if on_pinned != "raise" else warnings.catch_warnings():
            built = build(on_pinned)
    except FlatPoolError:
        return None
    out = []
    for b, f, w in zip(built, fresh, where):
        out.append(_built(b, f.kept, w))
        b.kept.report()
    return out


def _built(out: GroupBuffers, kept: KeptAlive, where: str) -> GroupBuffers:
    """A group built anew, keeping its tracker; logged (a skip once per reason)."""
    if out.kept is not kept:
        out = evolve(out, kept=kept)
    if out.adopted:
        if logger.isEnabledFor(logging.INFO):  # (the counts cost a pass over the buckets)
            logger.info("%s: adopted %d member(s) into %d pool(s), %d bytes freed",
                        where, sum(len(b.members) for b in out.buckets),
                        len(out.buckets), out.freed_bytes)
    elif out.skipped not in kept.logged:
        kept.logged.add(out.skipped or "")
        logger.info("%s: skipped: %s", where, out.skipped)
    return out


__all__ = ["IN_BACKWARD", "Build", "BuildAll", "keep_all_fused", "keep_fused"]
