"""``python -m flatpool.memory SNAPSHOT.pickle [--manifest M.json] [--png OUT.png]``.

Prints the attribution table; without a manifest every active block is unattributed. Exit
status 0, or 2 for a bad input or a picture that cannot be written (checked before any work).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from ..errors import FlatPoolError
from ._attribution import attribute_manifest
from ._errors import PictureError
from ._manifest import Manifest
from ._mpl import load
from ._snapshot import MAX_BLOCKS, load_snapshot
from ._viz import draw

LARGE = 10_000
"""Snapshots with at least this many blocks report progress on stderr."""

NO_MANIFEST = (
    "note: no --manifest given, so every active block is unattributed (the totals still hold). "
    "Pass the manifest the training process wrote (flatpool.memory.Manifest.write() or "
    "capture(manifest_out=...)) to name pools, slices, tensors and stale originals.")


def _check_picture_path(path: str) -> None:
    """Fail before any work if ``path``'s folder does not exist."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise PictureError(f"--png {path!r} is a folder; give a file name, e.g. "
                           f"{os.path.join(path, 'memory.png')!r}")
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise PictureError(f"--png {path!r}: the folder {folder!r} {what}; create it first "
                           "(nothing was read or drawn)")


def _progress(stream: TextIO, every_s: float = 0.5) -> Callable[[int, int], None]:
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < every_s:
            return
        last[0] = now
        end = "\n" if done >= total else "\r"
        print(f"flatpool.memory: attributed {done}/{total} blocks", end=end, file=stream,
              flush=True)

    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flatpool.memory",
        description="Attribute an allocator snapshot to flatpool pools, named tensors and "
                    "stale originals.")
    ap.add_argument("snapshot", help="pickle written by torch.cuda.memory._dump_snapshot() "
                                     "(or torch_npu's)")
    ap.add_argument("--manifest", help="JSON written in the training process by "
                                       "flatpool.memory.Manifest.write()")
    ap.add_argument("--png", help="also draw the picture here (needs flatpool[viz])")
    ap.add_argument("--pool", help="pool to lay out in the picture (default: the largest)")
    ap.add_argument("--title", default=None, help="picture title")
    ap.add_argument("--top", type=int, default=15, help="largest items listed (default 15)")
    ap.add_argument("--max-blocks", type=int, default=MAX_BLOCKS,
                    help=f"refuse snapshots listing more blocks (default {MAX_BLOCKS:,})")
    ap.add_argument("--progress", action="store_true",
                    help=f"report progress even below {LARGE} blocks")
    args = ap.parse_args(argv)
    try:
        if args.png:
            load()  # fail before the work when the viz extra is missing
            _check_picture_path(args.png)  # ... or when the picture could not be written
        t0 = time.perf_counter()
        snap = load_snapshot(args.snapshot, max_blocks=args.max_blocks)
        manifest = Manifest.read(args.manifest) if args.manifest else Manifest()
        loud = args.progress or snap.block_count >= LARGE
        result = attribute_manifest(snap, manifest,
                                    progress=_progress(sys.stderr) if loud else None)
        print(result.render(top=args.top))
        if not args.manifest:
            print(NO_MANIFEST, file=sys.stderr)
        if args.png:
            draw(result, args.png, title=args.title or args.snapshot, pool=args.pool)
            print(f"picture: {args.png}")
        if loud:
            print(f"flatpool.memory: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    except (FlatPoolError, OSError) as exc:  # OSError: the picture could not be written
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
