"""One call per rank: name this process's memory, snapshot it, attribute it, draw it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from .. import DeviceLike, FlatPool
from ._attribution import attribute_manifest
from ._collect import Watches, build_manifest
from ._device import device_snapshot
from ._manifest import Manifest
from ._mpl import load
from ._result import MemoryAttribution
from ._snapshot import parse_snapshot
from ._viz import draw


def _device_of(manifest: Manifest) -> str:
    for device in [p.device for p in manifest.pools] + [
            s.device for s in (*manifest.flats, *manifest.tensors)]:
        if not device.startswith("cpu"):
            return device
    return "cpu"


def capture(
    out: str | os.PathLike[str] | None = None,
    *,
    roots: object = None,
    pools: Iterable[FlatPool] | None = None,
    flats: Sequence[torch.Tensor] = (),
    watch: Watches = (),
    device: DeviceLike | None = None,
    scan: bool = True,
    title: str | None = None,
    pool: str | None = None,
    manifest_out: str | os.PathLike[str] | None = None,
) -> MemoryAttribution:
    """Attribute ``device``'s memory now and, with ``out``, write its picture (PNG).

    Args:
        out: PNG path, or ``None``; a missing ``viz`` extra fails before any work.
        roots, pools, flats, watch: what to name (:func:`build_manifest`).
        device: whose memory; default: the first accelerator the manifest names, else CPU.
        scan: on CPU, also list every other live CPU storage (shown as unattributed).
        title, pool: the picture's title and the pool laid out under it (default: largest).
        manifest_out: also write the manifest as JSON there (for ``python -m flatpool.memory``).
    """
    if out is not None:
        load()
    manifest = build_manifest(roots, pools=pools, flats=flats, watch=watch)
    snap = parse_snapshot(device_snapshot(device if device is not None else _device_of(manifest),
                                          manifest, scan=scan))
    result = attribute_manifest(snap, manifest)
    if manifest_out is not None:
        manifest.write(manifest_out)
    if out is not None:
        draw(result, out, title=title, pool=pool)
    return result
