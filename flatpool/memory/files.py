"""Write output files atomically: a reader (or a crash) never sees half a manifest or picture."""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``.

    The rename is atomic on POSIX and Windows; on failure the temporary file is removed and
    ``path`` is left as it was.
    """
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["write_atomic"]
