"""See the memory: attribute an allocator snapshot to pools, named tensors and stale originals.

The caching allocator's snapshot (``torch.cuda.memory._snapshot()``, ``torch_npu``'s twin) says
which blocks are in use; flatpool knows which of them is a fused pool, which a parameter, and
which an original that a fusion step should have freed. :func:`attribute` joins the two into
a typed :class:`MemoryAttribution` with a table (``render()``) and, with the ``viz`` extra, a
picture (:func:`draw`). :func:`capture` does it all in one call per rank; a :class:`Manifest`
written to JSON lets ``python -m flatpool.memory SNAPSHOT.pickle --manifest M.json`` do it on
another machine. On CPU, :func:`cpu_snapshot` stands in for the allocator.

Nothing here imports matplotlib, ``torch_npu`` or ``flatpool.integrations`` at import time.
"""

from ._attribution import Progress, attribute, attribute_manifest
from ._live import capture
from ._collect import Watches, build_manifest
from ._cpu import cpu_snapshot
from ._device import device_snapshot
from ._errors import ManifestError, MissingExtraError, PictureError, SnapshotError
from ._mpl import load as load_matplotlib
from ._manifest import Gap, Manifest, OriginalEntry, PoolEntry, SliceEntry, StorageEntry
from ._result import (
    KINDS,
    BlockView,
    ClassTotal,
    Item,
    Kind,
    MemoryAttribution,
    Piece,
    SegmentView,
)
from ._snapshot import (
    MAX_BLOCKS,
    Block,
    Segment,
    Snapshot,
    SnapshotSource,
    load_snapshot,
    parse_snapshot,
)
from ._units import fmt_bytes
from ._viz import draw, draw_comparison, figure, render_png
from ._walk import Found, Walked, walk_roots
from ._watch import StorageWatch, WatchedStorages

__all__ = [
    "KINDS",
    "MAX_BLOCKS",
    "Block",
    "BlockView",
    "ClassTotal",
    "Found",
    "Gap",
    "Item",
    "Kind",
    "Manifest",
    "ManifestError",
    "MemoryAttribution",
    "MissingExtraError",
    "PictureError",
    "OriginalEntry",
    "Piece",
    "PoolEntry",
    "Progress",
    "Segment",
    "SegmentView",
    "SliceEntry",
    "Snapshot",
    "SnapshotError",
    "SnapshotSource",
    "StorageEntry",
    "StorageWatch",
    "Walked",
    "WatchedStorages",
    "Watches",
    "attribute",
    "attribute_manifest",
    "build_manifest",
    "capture",
    "cpu_snapshot",
    "device_snapshot",
    "draw",
    "draw_comparison",
    "figure",
    "fmt_bytes",
    "load_matplotlib",
    "load_snapshot",
    "parse_snapshot",
    "render_png",
    "walk_roots",
]
