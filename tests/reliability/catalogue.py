"""The catalogue of bad inputs: each row is a call flatpool must refuse with a typed error,
changing nothing.

Every row builds fresh fixtures through a :class:`Ctx` (pools, tensors and holder places it
registers are snapshotted before the call and compared after) and returns the bad call.
``test_bad_inputs.py`` runs every row; ``docs/bad-inputs.md`` holds the table rendered from
these rows, regenerated with ``python -m tests.reliability.catalogue``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from attrs import define
from torch import nn

import flatpool
from flatpool import AdoptSpec, FlatPool, Holder, Slice

from .scenarios import Box, Wrapper, ints

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"
START, END = "<!-- catalogue:start -->", "<!-- catalogue:end -->"

NOTHING = "nothing changed"


class Ctx:
    """Fresh fixtures for one row; everything registered here is checked for changes."""

    def __init__(self) -> None:
        self.pools: list[FlatPool] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.places: dict[str, tuple[Any, Any, bool]] = {}
        self.keep: list[Any] = []

    def pool(self, **kw: Any) -> FlatPool:
        kw.setdefault("alignment", 64)
        kw.setdefault("capacity", 4096)
        p = FlatPool(name=f"p{len(self.pools)}", **kw)
        self.pools.append(p)
        return p

    def tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.tensors[name] = t
        return t

    def adopted(self, pool: FlatPool, name: str, t: torch.Tensor) -> torch.Tensor:
        pool.adopt(t)
        return self.tensor(name, t)

    def slice(self, pool: FlatPool, shape: Any = (4,), dtype: torch.dtype = torch.float32,
              fill: float = 9.0) -> Slice:
        s = pool.allocate(shape, dtype)
        s.tensor().fill_(fill)
        return s

    def dtensor(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, _mesh(), [Shard(0)], run_check=False)


def _mesh() -> Any:
    """A 1-rank gloo mesh (reusing the default group when one exists, as conftest does)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


Call = Callable[[], object]


@define(frozen=True)
class Row:
    id: str
    input: str
    arrange: Callable[[Ctx], Call]
    error: type[BaseException]
    match: str
    """A regex the message must contain (what makes it helpful: the cause or the way out)."""
    guarantee: str = NOTHING
    xfail: str | None = None
    """A known flatpool bug this row exposes (the test is a strict xfail until fixed)."""


# -- row bodies ----------------------------------------------------------------------------


def _other_device(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", torch.ones(4, device="meta"))
    return lambda: p.adopt(t)


def _meta_readopt(c: Ctx) -> Call:
    p = c.pool()
    box = Box(data=ints(4))
    p.adopt(AdoptSpec(box.data, holders=(Holder(box, "data"),)))
    box.data = torch.empty(4, device="meta")  # what a framework's re-init left there
    c.tensor("meta", box.data)
    c.places["box.data"] = (box, "data", False)
    return lambda: p.readopt()


def _materialize_real(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    return lambda: p.materialize_into(t)


def _transposed_view(c: Ctx) -> Call:
    p = c.pool()
    base = c.tensor("base", ints(3, 4))
    t = c.tensor("t", base.t())
    return lambda: p.adopt(t)


def _expanded(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(1).expand(4))
    return lambda: p.adopt(t)


def _overlapping_strides(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", torch.empty_strided((3, 2), (1, 1)).fill_(1.0))
    return lambda: p.adopt(t)


def _noncontig_into_slice(c: Ctx) -> Call:
    p = c.pool()
    s = c.slice(p, (3, 4))  # 12 float32 elements
    bad = c.tensor("bad", torch.empty_strided((3, 4), (1, 5)).fill_(2.0))  # spans 18 elements
    return lambda: p.adopt(AdoptSpec(bad, slice=s))


def _zero_size_alloc(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate((4, 0), torch.float32)


def _zero_size_adopt(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", torch.empty(0))
    return lambda: p.adopt(t)


def _adopted_twice(c: Ctx) -> Call:
    p = c.pool()
    t = c.adopted(p, "t", ints(4))
    return lambda: p.adopt(t)


def _two_pools(c: Ctx) -> Call:
    p, q = c.pool(), c.pool()
    t = c.adopted(p, "t", ints(4))
    return lambda: q.adopt(t)


def _twice_in_batch(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    return lambda: p.adopt([t, t])


def _overlapping_primaries(c: Ctx) -> Call:
    p = c.pool()
    base = c.tensor("base", ints(8))
    part = c.tensor("part", base[2:6])
    return lambda: p.adopt([base, part])


def _foreign_free(c: Ctx) -> Call:
    p, q = c.pool(), c.pool()
    s = c.slice(q)
    return lambda: p.free(s)


def _foreign_target_slice(c: Ctx) -> Call:
    p, q = c.pool(), c.pool()
    s = c.slice(q)
    t = c.tensor("t", ints(4))
    return lambda: p.adopt(AdoptSpec(t, slice=s))


def _freed_free(c: Ctx) -> Call:
    p = c.pool()
    c.slice(p)
    s = p.allocate(4, torch.float32)
    p.free(s)
    return lambda: p.free(s)


def _freed_tensor(c: Ctx) -> Call:
    p = c.pool()
    s = p.allocate(4, torch.float32)
    p.free(s)
    c.slice(p)  # the range now belongs to another slice
    return lambda: s.tensor()


def _compacted_handle(c: Ctx) -> Call:
    p = c.pool()
    gap = p.allocate(4, torch.float32)
    s = c.slice(p)
    p.free(gap)
    p.compact()  # s moves to offset 0 under a new handle
    return lambda: s.bytes()


def _freed_target_slice(c: Ctx) -> Call:
    p = c.pool()
    s = p.allocate(4, torch.float32)
    c.slice(p, (8,))
    p.free(s)
    t = c.tensor("t", ints(4))
    return lambda: p.adopt(AdoptSpec(t, slice=s))


def _overflow_shape(c: Ctx) -> Call:
    p = c.pool(capacity=None)
    return lambda: p.allocate((1 << 40, 1 << 40), torch.float32)


def _overflow_capacity(c: Ctx) -> Call:
    return lambda: FlatPool(capacity=1 << 70)


def _overflow_grow(c: Ctx) -> Call:
    p = c.pool(capacity=256)
    c.slice(p)
    return lambda: p.grow(1 << 70)


def _unallocatable(c: Ctx) -> Call:
    p = c.pool(capacity=None)
    p.allocate((1 << 58,), torch.uint8)  # planned: fine; no device has 256 PiB
    return lambda: p.materialize()


def _negative_dim(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate((4, -1), torch.float32)


def _bool_dim(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate((True, 4), torch.float32)


def _str_dtype(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate(4, "float32")  # type: ignore[arg-type]


def _dtype_mismatch(c: Ctx) -> Call:
    p = c.pool()
    s = c.slice(p, (4,), torch.float32)
    t = c.tensor("t", torch.arange(4, dtype=torch.int32))
    return lambda: p.adopt(AdoptSpec(t, slice=s))


def _size_mismatch(c: Ctx) -> Call:
    p = c.pool()
    s = c.slice(p, (4,), torch.float32)
    t = c.tensor("t", ints(5))
    return lambda: p.adopt(AdoptSpec(t, slice=s))


def _meta_slice_mismatch(c: Ctx) -> Call:
    p = c.pool()
    s = p.allocate((4,), torch.float16)
    t = c.tensor("t", torch.empty(4, device="meta"))
    return lambda: p.materialize_into(t, [s])


def _backward_hook(c: Ctx) -> Call:
    p = c.pool()
    x = c.tensor("x", torch.ones(3, requires_grad=True))
    victim = c.tensor("victim", ints(4))

    def hook(g: torch.Tensor) -> torch.Tensor:
        p.adopt(victim)
        return g

    x.register_hook(hook)
    return lambda: (x * 2).sum().backward()


def _saved_for_backward(c: Ctx) -> Call:
    p = c.pool()
    w = c.tensor("w", nn.Parameter(ints(4)))
    loss = (w[1:] * w[1:]).sum()  # autograd saved views of w: a pending backward pins it
    c.keep.append(loss)
    return lambda: p.adopt(w)


def _dtensor_local_not_shard(c: Ctx) -> Call:
    p = c.pool()
    shard = ints(4)
    c.tensor("shard", shard)
    w = c.tensor("w", Wrapper(shard))
    w._local_tensor = c.tensor("other", ints(4, start=10))  # no longer the wrapper's shard
    return lambda: p.adopt(w)


def _dtensor_padded_narrow(c: Ctx) -> Call:
    p = c.pool()
    padded = c.tensor("padded", ints(6))
    holder = Box(data=padded)
    dt = c.tensor("dt", c.dtensor(padded.narrow(0, 0, 5)))
    c.places["holder.data"] = (holder, "data", False)
    c.keep.append(holder)
    return lambda: p.adopt(dt)


def _pinned_by_view(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(8))
    v = c.tensor("v", t[2:4])
    c.keep.append(v)
    return lambda: p.adopt(t)


def _view_elsewhere(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    other = c.tensor("other", ints(4))
    return lambda: p.adopt(AdoptSpec(t, views=(other,)))


def _view_outside(c: Ctx) -> Call:
    p = c.pool()
    base = c.tensor("base", ints(8))
    inner = c.tensor("inner", base[0:4])
    whole = c.tensor("whole", base[0:8])
    return lambda: p.adopt(AdoptSpec(inner, views=(whole,)))


def _bad_holder(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    box = Box(other=ints(4))
    c.places["box.other"] = (box, "other", False)
    return lambda: p.adopt(AdoptSpec(t, holders=(Holder(box, "other"),)))


def _missing_holder(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    return lambda: p.adopt(AdoptSpec(t, holders=(Holder(Box(), "nothing"),)))


def _free_adopted(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    s = p.adopt(t).slices[0]
    return lambda: p.free(s)


def _grow_smaller(c: Ctx) -> Call:
    p = c.pool(capacity=1024)
    c.slice(p)
    return lambda: p.grow(512)


def _grow_pinned(c: Ctx) -> Call:
    p = c.pool(capacity=1024)
    s = c.slice(p)
    c.adopted(p, "t", ints(4))
    kept = c.tensor("kept", s.tensor())  # a view the pool does not know pins its storage
    c.keep.append(kept)
    return lambda: p.grow(2048)


def _flat_mixed(c: Ctx) -> Call:
    p = c.pool()
    c.slice(p, (4,), torch.float32)
    c.slice(p, (4,), torch.int64)
    return lambda: p.flat(torch.float32)


def _on_pinned_typo(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    return lambda: p.adopt(t, on_pinned="ignore")  # type: ignore[arg-type]


def _not_a_tensor(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.adopt({"w": ints(4)})  # type: ignore[arg-type]


def _empty_batch(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.adopt([])


def _readopt_reshaped(c: Ctx) -> Call:
    p = c.pool()
    t = c.adopted(p, "t", ints(4))
    t.data = ints(2, 2)
    return lambda: p.readopt()


def _meta_held_by_graph(c: Ctx) -> Call:
    p = c.pool()
    with torch.device("meta"):
        lin = nn.Linear(4, 3)
        loss = lin(torch.randn(2, 4)).sum()  # a meta forward: the graph holds the bias's impl
    c.keep += [lin, loss]
    c.tensors.update(weight=lin.weight, bias=lin.bias)
    return lambda: p.materialize_into([lin.weight, lin.bias])


def _bad_alignment(c: Ctx) -> Call:
    return lambda: FlatPool(alignment=48)


ROWS: tuple[Row, ...] = (
    Row("other-device", "tensor on another device than the pool (a meta tensor into a CPU "
        "pool; a CUDA tensor into a CPU pool takes the same device check)", _other_device,
        flatpool.InvalidRequestError, r"meta tensor|is on .* but pool"),
    Row("meta-readopt", "re-adoption of a tensor a framework turned into a meta tensor",
        _meta_readopt, flatpool.InvalidRequestError, r"meta device.*materialize_into"),
    Row("real-into-materialize", "materialize_into() of a tensor that already has data",
        _materialize_real, flatpool.InvalidRequestError, r"takes meta tensors.*adopt"),
    Row("transposed-view", "a non-contiguous autograd view (t.t()) whose base someone else "
        "holds", _transposed_view, flatpool.PinnedStorageError, r"tensors\['base'\]"),
    Row("expanded", "an expanded/broadcast tensor (overlaps itself, stride 0)", _expanded,
        flatpool.InvalidRequestError, r"overlaps itself"),
    Row("self-overlapping", "an as_strided/empty_strided tensor whose elements overlap",
        _overlapping_strides, flatpool.InvalidRequestError, r"overlaps itself"),
    Row("strided-into-slice", "a strided tensor whose extent does not fit the given slice",
        _noncontig_into_slice, flatpool.InvalidRequestError, r"needs \d+ bytes.*slice \d+ has"),
    Row("zero-size-allocate", "allocate() of a shape with a zero dimension", _zero_size_alloc,
        flatpool.InvalidRequestError, r"holds no bytes"),
    Row("zero-size-adopt", "adopt() of a zero-size tensor", _zero_size_adopt,
        flatpool.InvalidRequestError, r"zero-size"),
    Row("adopted-twice", "adopting a tensor that already lives in this pool", _adopted_twice,
        flatpool.InvalidRequestError, r"already lives in this pool.*readopt"),
    Row("two-pools", "adopting a tensor that lives in another pool", _two_pools,
        flatpool.InvalidRequestError, r"already lives in pool 'p0'"),
    Row("twice-in-batch", "the same tensor twice in one batch", _twice_in_batch,
        flatpool.InvalidRequestError, r"given twice"),
    Row("overlapping-batch", "two overlapping tensors of one storage as separate targets",
        _overlapping_primaries, flatpool.AliasingError, r"share bytes.*views"),
    Row("foreign-free", "free() of a slice of another pool", _foreign_free,
        flatpool.ForeignSliceError, r"belongs to pool 'p1'"),
    Row("foreign-target", "AdoptSpec(slice=...) naming a slice of another pool",
        _foreign_target_slice, flatpool.ForeignSliceError, r"belongs to pool"),
    Row("double-free", "free() of an already freed slice", _freed_free,
        flatpool.FreedSliceError, r"was freed or relocated"),
    Row("freed-tensor", "tensor() of a freed slice whose range was reused", _freed_tensor,
        flatpool.FreedSliceError, r"was freed"),
    Row("compacted-handle", "a handle from before compact()", _compacted_handle,
        flatpool.FreedSliceError, r"relocated; use the handle returned"),
    Row("freed-target", "AdoptSpec(slice=...) naming a freed slice", _freed_target_slice,
        flatpool.FreedSliceError, r"was freed"),
    Row("overflow-shape", "a shape whose byte size overflows int64", _overflow_shape,
        flatpool.InvalidRequestError, r"past \d+ bytes"),
    Row("overflow-capacity", "FlatPool(capacity=2**70)", _overflow_capacity,
        flatpool.InvalidRequestError, r"exceeds"),
    Row("overflow-grow", "grow() to 2**70 bytes", _overflow_grow,
        flatpool.InvalidRequestError, r"exceeds"),
    Row("unallocatable", "materialize() of a plan larger than the device's memory",
        _unallocatable, flatpool.PoolExhaustedError, r"cannot allocate \d+ bytes",
        "pool stays planned, nothing changed"),
    Row("negative-dim", "a negative dimension", _negative_dim,
        flatpool.InvalidRequestError, r"negative dimension"),
    Row("bool-dim", "a bool as a dimension", _bool_dim,
        flatpool.InvalidTypeError, r"bool"),
    Row("str-dtype", "a string where a torch.dtype is needed", _str_dtype,
        flatpool.InvalidTypeError, r"torch\.dtype"),
    Row("dtype-mismatch", "adopting an int32 tensor into an existing float32 slice",
        _dtype_mismatch, flatpool.InvalidRequestError, r"int32.*float32"),
    Row("size-mismatch", "adopting 5 elements into an existing 4-element slice",
        _size_mismatch, flatpool.InvalidRequestError, r"needs 20 bytes"),
    Row("meta-slice-mismatch", "materialize_into() with a slice of another dtype",
        _meta_slice_mismatch, flatpool.InvalidRequestError, r"float32.*float16"),
    Row("during-backward", "adopt() from a backward hook (backward running)", _backward_hook,
        flatpool.AdoptionError, r"backward pass is running"),
    Row("pending-backward", "adopt() of a parameter whose views autograd saved for a pending "
        "backward", _saved_for_backward, flatpool.PinnedStorageError, r"C\+\+",
        "nothing changed; the backward still runs on the original"),
    Row("local-not-shard", "a DTensor-style wrapper whose _local_tensor is not the storage it "
        "wraps", _dtensor_local_not_shard, flatpool.InvalidRequestError,
        r"not its _local_tensor's"),
    Row("padded-local", "a DTensor whose local tensor is a narrow of a padded shard held "
        "elsewhere", _dtensor_padded_narrow, flatpool.PinnedStorageError,
        r"Box.data|autograd view", "nothing changed; the holder is named"),
    Row("pinned-view", "a tensor with a live view nobody named", _pinned_by_view,
        flatpool.PinnedStorageError, r"local variable|autograd view|held",
        "nothing changed; the holder is named"),
    Row("view-elsewhere", "AdoptSpec.views naming a tensor on another storage",
        _view_elsewhere, flatpool.InvalidRequestError, r"does not share its storage"),
    Row("view-outside", "AdoptSpec.views naming a view reaching past the primary",
        _view_outside, flatpool.InvalidRequestError, r"reaches bytes outside"),
    Row("holder-elsewhere", "a Holder whose tensor is on another storage", _bad_holder,
        flatpool.InvalidRequestError, r"does not hold a tensor on its storage"),
    Row("holder-missing", "a Holder naming a missing attribute", _missing_holder,
        flatpool.InvalidRequestError, r"holder Box.nothing"),
    Row("free-adopted", "free() of a slice that backs adopted tensors", _free_adopted,
        flatpool.InvalidRequestError, r"disown"),
    Row("grow-smaller", "grow() below the current capacity", _grow_smaller,
        flatpool.InvalidRequestError, r"compact"),
    Row("grow-pinned", "grow() while a slice.tensor() view is kept", _grow_pinned,
        flatpool.PinnedStorageError, r"old storage", "nothing changed; the holder is named"),
    Row("flat-mixed", "flat(torch.float32) over slices of several dtypes", _flat_mixed,
        flatpool.InvalidRequestError, r"reinterpret"),
    Row("on-pinned-typo", "on_pinned='ignore'", _on_pinned_typo,
        flatpool.InvalidRequestError, r"'raise', 'warn' or 'force'"),
    Row("not-a-tensor", "adopt() of a dict", _not_a_tensor, flatpool.InvalidTypeError,
        r"dict"),
    Row("empty-batch", "adopt([])", _empty_batch, flatpool.InvalidRequestError,
        r"nothing to adopt"),
    Row("readopt-reshaped", "re-adoption of a tensor whose shape changed", _readopt_reshaped,
        flatpool.InvalidRequestError, r"disown\(slice\) and pool.free\(slice\), then adopt"),
    Row("meta-held-by-graph", "materialize_into() of meta parameters a meta forward's graph "
        "still holds", _meta_held_by_graph, flatpool.AdoptionError, r"held outside Python"),
    Row("bad-alignment", "alignment that is not a power of two", _bad_alignment,
        flatpool.InvalidRequestError, r"power of two"),
)


# -- the documentation table -------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The markdown table of the catalogue, as it appears in ``docs/bad-inputs.md``."""
    lines = ["| id | input | error | guarantee |", "| --- | --- | --- | --- |"]
    for r in ROWS:
        guarantee = r.guarantee + (f" (**known bug**: {r.xfail})" if r.xfail else "")
        lines.append(
            f"| `{r.id}` | {_cell(r.input)} | `{r.error.__name__}` | {_cell(guarantee)} |"
        )
    return "\n".join(lines)


def _section(text: str) -> re.Match[str]:
    m = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
    if m is None:
        raise ValueError(f"{DOC} has no {START} ... {END} section")
    return m


def doc_table(text: str) -> str:
    """The table currently in the doc (between the markers)."""
    return _section(text).group(1).rstrip("\n")


def write_doc(path: Path = DOC) -> None:
    text = path.read_text()
    m = _section(text)
    path.write_text(text[: m.start(1)] + render() + "\n" + text[m.end(1):])


if __name__ == "__main__":
    write_doc()
    print(f"wrote {len(ROWS)} rows to {DOC}", file=sys.stderr)
