"""See the memory: attribute an allocator snapshot to pools, named tensors and stale originals.

:func:`attribute` joins an allocator snapshot with what flatpool knows (a :class:`Manifest`)
into a :class:`MemoryAttribution`; :func:`capture` does it in one call per rank, and
``python -m flatpool.memory`` on another machine. Nothing here imports matplotlib,
``torch_npu`` or ``flatpool.integrations`` at import time.
"""

from ._attribution import Progress, attribute, attribute_manifest
from ._live import capture
from ._collect import Watches, build_manifest
from ._device import cpu_snapshot, device_snapshot
from ._errors import ManifestError, MissingExtraError, PictureError, SnapshotError
from ._mpl import load as load_matplotlib
from ._manifest import Gap, Manifest, OriginalEntry, PoolEntry, SliceEntry, StorageEntry
from ._result import KINDS, BlockView, ClassTotal, Item, Kind, MemoryAttribution, Piece
from ._result import SegmentView
from ._snapshot import MAX_BLOCKS, Block, Segment, Snapshot, SnapshotSource, load_snapshot
from ._snapshot import parse_snapshot
from ._table import fmt_bytes
from ._viz import draw, draw_comparison, figure, render_png
from ._walk import Found, Walked, walk_roots
from ._watch import StorageWatch, WatchedStorages

__all__ = [
    "KINDS", "MAX_BLOCKS", "Block", "BlockView", "ClassTotal", "Found", "Gap", "Item", "Kind",
    "Manifest", "ManifestError", "MemoryAttribution", "MissingExtraError", "PictureError",
    "OriginalEntry", "Piece", "PoolEntry", "Progress", "Segment", "SegmentView", "SliceEntry",
    "Snapshot", "SnapshotError", "SnapshotSource", "StorageEntry", "StorageWatch", "Walked",
    "WatchedStorages", "Watches", "attribute", "attribute_manifest", "build_manifest",
    "capture", "cpu_snapshot", "device_snapshot", "draw", "draw_comparison", "figure",
    "fmt_bytes", "load_matplotlib", "load_snapshot", "parse_snapshot", "render_png",
    "walk_roots",
]
