"""Batched byte copies into a pool: one ``_foreach_copy_`` per chunk, small copies threaded.

Adoption copies every original into its slice before anything is rebound; this module is only
that copy, so its speed can be tuned without touching the transaction around it.

:func:`copy_all` returns or raises only once no worker thread copies any more: a rollback that
starts because an interrupt landed in the calling thread frees the pool storage the workers
write into, so the workers are cancelled (none starts a chunk after that) and waited for first.
"""

from __future__ import annotations

import threading

import torch

from .. import torch_compat as tc

COPY_CHUNK = 1024
"""Tensors copied per ``copy_all`` call of a batch adoption (bounds the views alive at once)."""

SMALL_COPY = 32768
"""Byte copies below this are spread over Python threads by :func:`copy_all`: torch runs a
``copy_`` below its grain size (32768 elements; these are uint8 views) serially, so thousands
of them take their first-touch page faults one at a time. Larger copies already run in
parallel inside torch; threading them too oversubscribes the cores (measured on 2 idle cores,
1,000 copies of 256 KiB: 72 ms in one ``_foreach_copy_``, 93 ms threaded; 10,000 of 26 KiB:
133 ms in one call, 86 ms threaded)."""

THREADED_BYTES = 4 << 20
"""Small copies are threaded only when they add up to this many bytes: below it, starting and
joining the threads costs more than the page faults they would overlap (16 copies of 4 KiB:
0.8 ms threaded, 0.1 ms in one call)."""

Chunk = tuple[list[torch.Tensor], list[torch.Tensor]]


class _Crew:
    """Worker threads copying chunks, accountable to the calling thread.

    A worker counts itself running (under the lock) before it copies, unless the crew was
    cancelled: after :meth:`cancel` no copy starts, and :meth:`wait_idle` returns once none
    runs. Whether an interrupted ``Thread.start()`` started its thread does not matter: such a
    thread either counted itself before the cancel (and is waited for) or copies nothing.
    """

    def __init__(self, chunks: list[Chunk]) -> None:
        self.cond = threading.Condition()
        self.running = 0
        self.unfinished = len(chunks)
        self.cancelled = False
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._work, args=c, daemon=True) for c in chunks]

    def _work(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        with self.cond:
            if self.cancelled:
                self.unfinished -= 1
                self.cond.notify_all()
                return
            self.running += 1
        try:
            with torch.no_grad():  # grad mode is per thread
                tc.foreach_copy(dst, src)
        except BaseException as exc:  # re-raised in the calling thread
            self.errors.append(exc)
        finally:
            with self.cond:
                self.running -= 1
                self.unfinished -= 1
                self.cond.notify_all()

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def wait_done(self) -> None:
        """Every chunk copied (the normal end)."""
        with self.cond:
            while self.unfinished:
                self.cond.wait()

    def cancel(self) -> None:
        """No chunk starts any more; return once no worker copies. Safe to repeat."""
        with self.cond:
            self.cancelled = True
            while self.running:
                self.cond.wait()


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], *, threaded: bool = True) -> None:
    """``dst[i].copy_(src[i])`` for all ``i``: one ``_foreach_copy_``, and on CPU the small
    copies split over ``torch.get_num_threads()`` Python threads (the op releases the GIL).

    Thousands of small copies into a fresh pool are bound by first-touch page faults taken one
    at a time; threads take them in parallel, as a single large ``copy_`` does. ``threaded=False``
    copies in the calling thread only: the threads buy wall time with CPU time (at 10,000
    copies of 26 KiB on 2 cores, 17 % less wall for 25 % more CPU: OpenMP's spinning and
    page-fault contention), which a batch adoption judged on both does not take. Whatever lands
    in the calling thread (an interrupt at any bytecode), no worker writes into ``dst`` once
    this returns or raises.
    """
    workers = torch.get_num_threads() if threaded and dst and dst[0].device.type == "cpu" else 1
    small = [i for i, d in enumerate(dst) if d.nbytes < SMALL_COPY] if workers > 1 else []
    if len(small) < 4 * workers or sum(dst[i].nbytes for i in small) < THREADED_BYTES:
        with torch.no_grad():
            tc.foreach_copy(dst, src)
        return
    large = sorted(set(range(len(dst))) - set(small))
    mine: Chunk = ([dst[i] for i in large], [src[i] for i in large])
    chunks: list[Chunk] = []
    per = -(-len(small) // workers)
    for k in range(0, len(small), per):
        part = small[k : k + per]
        chunks.append(([dst[i] for i in part], [src[i] for i in part]))
    if not large:
        mine = chunks.pop(0)
    crew = _Crew(chunks)
    try:
        crew.start()
        with torch.no_grad():
            tc.foreach_copy(*mine)
        crew.wait_done()
    except BaseException:
        _cancel(crew)
        raise
    if crew.errors:
        raise crew.errors[0]


def _cancel(crew: _Crew) -> None:
    """:meth:`_Crew.cancel` to the end, even if exceptions land while it waits (signals are
    deferred while a flatpool operation unwinds; other asynchronous exceptions only retry)."""
    while True:
        try:
            crew.cancel()
            return
        except BaseException:  # noqa: B902 - the workers must stop before anything is freed
            continue
