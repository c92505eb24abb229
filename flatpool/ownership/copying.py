"""Batched byte copies into a pool: one ``_foreach_copy_`` per chunk, small copies threaded.

Adoption copies every original into its slice before anything is rebound; this module is only
that copy, so its speed can be tuned without touching the transaction around it.
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


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all ``i``: one ``_foreach_copy_``, and on CPU the small
    copies split over ``torch.get_num_threads()`` Python threads (the op releases the GIL).

    Thousands of small copies into a fresh pool are bound by first-touch page faults taken one
    at a time; threads take them in parallel, as a single large ``copy_`` does.
    """
    workers = torch.get_num_threads() if dst and dst[0].device.type == "cpu" else 1
    small = [i for i, d in enumerate(dst) if d.nbytes < SMALL_COPY] if workers > 1 else []
    if len(small) < 4 * workers or sum(dst[i].nbytes for i in small) < THREADED_BYTES:
        with torch.no_grad():
            tc.foreach_copy(dst, src)
        return
    large = sorted(set(range(len(dst))) - set(small))
    chunks: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    if large:
        chunks.append(([dst[i] for i in large], [src[i] for i in large]))
    per = -(-len(small) // workers)
    for k in range(0, len(small), per):
        part = small[k : k + per]
        chunks.append(([dst[i] for i in part], [src[i] for i in part]))
    errors: list[BaseException] = []

    def run(d: list[torch.Tensor], s: list[torch.Tensor]) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                tc.foreach_copy(d, s)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=c, daemon=True) for c in chunks[1:]]
    for t in threads:
        t.start()
    run(*chunks[0])
    for t in threads:
        t.join()  # every copy has finished before anything (a rollback) touches the bytes
    if errors:
        raise errors[0]
