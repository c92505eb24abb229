"""The NPU storage-format guard (:mod:`flatpool._npu_format`), on CPU with a stand-in for
``torch_npu.get_npu_format``.

A tensor in one of torch_npu's private formats (FRACTAL_NZ, NC1HWC0, ...) is refused with
``NpuFormatError`` naming the format and the conversion, on the lean path and the general one,
leaving everything as it was; tensors in the plain formats (ND, and NCHW / NCDHW, what torch_npu
gives 4-D and 5-D tensors) are adopted; a pool whose new storage is not ND is refused. Not a
test on an NPU: the real query is looked up by name only (the last tests).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

import flatpool
from flatpool import AdoptSpec, DeviceError, FlatPool, NpuFormatError
from flatpool import _npu_format

from .npu_stand_in import Format, npu_formats
from .scenarios import ShardedMember, ints
from .state import Snapshot, check_layout


def _refused(pool: FlatPool, targets: Any, tensors: dict[str, torch.Tensor],
             stand_in_formats: dict[torch.Tensor, int]) -> NpuFormatError:
    snap = Snapshot([pool], tensors, {})
    with npu_formats(stand_in_formats) as stand_in:
        with pytest.raises(NpuFormatError) as info:
            pool.adopt(targets)
    assert stand_in.asked >= 1
    snap.assert_unchanged()
    check_layout(pool)
    return info.value


def test_a_private_format_is_refused_naming_it_and_the_conversion() -> None:
    pool = FlatPool(name="npu-like")
    a, nz = ints(4), ints(3, start=5)
    exc = _refused(pool, [a, nz], {"a": a, "nz": nz}, {nz: Format.FRACTAL_NZ})
    message = str(exc)
    assert "#1 Tensor(3,) float32" in message  # the general path's label: the lean one declined
    assert "FRACTAL_NZ (29)" in message and "torch_npu.npu_format_cast(t, 2)" in message
    assert exc.npu_format == "FRACTAL_NZ (29)"
    assert isinstance(exc, ValueError) and isinstance(exc, flatpool.FlatPoolError)
    assert pool.slices() == () and not pool.owns(a)


@pytest.mark.parametrize("code", [Format.NC1HWC0, Format.FRACTAL_Z, Format.NHWC, 33, 99],
                         ids=lambda c: str(int(c)))
def test_every_other_format_is_refused(code: int) -> None:
    pool = FlatPool()
    t = ints(2, 3, 4, 5)
    exc = _refused(pool, t, {"t": t}, {t: code})
    assert exc.npu_format == _npu_format.format_name(int(code))
    assert f"({int(code)})" in str(exc)


def test_general_path_refuses_a_view_of_a_private_storage() -> None:
    """A view and its holder (AdoptSpec with views) go through validate(), not the lean path;
    the format belongs to the storage, so the view reports it too."""
    pool = FlatPool()
    base = ints(8)
    view = base[2:6]
    exc = _refused(pool, [AdoptSpec(base, views=(view,))], {"base": base, "view": view},
                   {base: Format.FRACTAL_NZ})
    assert "FRACTAL_NZ" in str(exc)


def test_the_local_tensor_of_a_wrapper_is_checked(hp_wrap: Any) -> None:
    pool = FlatPool()
    local = ints(4)
    wrapped = hp_wrap(local)
    exc = _refused(pool, [wrapped], {"local": local}, {local: Format.NC1HWC0})
    assert "NC1HWC0 (3)" in str(exc)


def test_fsdp2_shards_on_the_sharded_path_are_checked_too(single_rank_mesh: Any) -> None:
    """FSDP2-shaped members (a shard, its DTensor parameter, its holder) take the sharded lean
    path: a shard in a private format sends the batch to the general path, which refuses it."""
    members = [ShardedMember(3, 3, 4, 100.0, mesh=single_rank_mesh),
               ShardedMember(5, 6, 2, 200.0, mesh=single_rank_mesh)]
    shard = members[1]._sharded_param_data
    tensors = {f"data{i}": m._sharded_param_data for i, m in enumerate(members)}
    tensors.update({f"local{i}": m.sharded_param._local_tensor for i, m in enumerate(members)})
    pool = FlatPool(alignment=1)
    exc = _refused(pool, [m.spec() for m in members], tensors, {shard: Format.FRACTAL_NZ})
    assert "#1 Tensor(12,) float32" in str(exc) and "FRACTAL_NZ (29)" in str(exc)
    with npu_formats({}):  # converted: the sharded path adopts them
        assert pool.adopt([m.spec() for m in members]).all_released


def test_module_parameters_refused_then_adopted_after_conversion() -> None:
    """The advice works: 'convert, then adopt' (here the stand-in's conversion is forgetting the
    format, as npu_format_cast(t, 2) returns an ND tensor)."""
    lin = nn.Linear(4, 3)
    pool = FlatPool()
    params = list(lin.parameters())
    formats: dict[torch.Tensor, int] = {lin.weight: Format.FRACTAL_NZ}
    _refused(pool, params, {"weight": lin.weight, "bias": lin.bias}, formats)
    with npu_formats({}):  # converted: every storage ND
        report = pool.adopt(params)
    assert report.all_released and pool.owns(lin.weight) and pool.owns(lin.bias)


@pytest.mark.parametrize("code,shape", [(Format.ND, (6,)), (Format.NCHW, (1, 2, 3, 1)),
                                        (Format.NCDHW, (1, 2, 1, 3, 1))], ids=["ND", "NCHW", "NCDHW"])
def test_plain_formats_are_adopted(code: int, shape: tuple[int, ...]) -> None:
    pool = FlatPool()
    t = ints(*shape)
    before = t.clone()
    with npu_formats({t: code}, default=Format.ND) as stand_in:
        report = pool.adopt([t, ints(3)])
    assert stand_in.asked >= 2  # the pool's storage and the batch were asked about
    assert report.all_released and pool.owns(t) and torch.equal(t, before)


def test_a_pool_storage_that_is_not_nd_is_refused_and_the_pool_stays_planned() -> None:
    pool = FlatPool(name="bucket")
    s = pool.allocate(16, torch.float32)
    with npu_formats(default=Format.FRACTAL_NZ):
        with pytest.raises(NpuFormatError, match=r"storage of pool 'bucket'.*FRACTAL_NZ \(29\)"):
            pool.materialize()
    assert not pool.is_materialized and pool.slices() == (s,)
    pool.materialize()  # a plain storage: fine
    assert pool.is_materialized


def test_a_pool_storage_in_nchw_is_refused_too() -> None:
    """The pool's storage must be ND exactly (a 1-D byte tensor never is anything else)."""
    pool = FlatPool(capacity=1024)
    with npu_formats(default=Format.NCHW), pytest.raises(NpuFormatError, match="NCHW"):
        pool.materialize()


class _Untouchable(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"torch_npu.{name} was looked up for a tensor not on an NPU")


def test_off_npu_torch_npu_is_never_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", _Untouchable("torch_npu"))
    assert _npu_format._format_query(torch.device("cpu")) is None
    assert _npu_format._format_query(torch.device("cuda", 0)) is None  # a CUDA pool too
    assert _npu_format.private_format(ints(3)) is None
    pool = FlatPool()
    lin = nn.Linear(3, 2)
    assert pool.adopt(list(lin.parameters())).all_released  # the lean path
    base = ints(4)
    assert FlatPool().adopt([AdoptSpec(base, views=(base[1:],))]).all_released  # general path


def _npu_device() -> Any:
    """Something with ``type == "npu"``: torch.device("npu") needs torch_npu registered."""
    return types.SimpleNamespace(type="npu", index=0)


def test_on_npu_the_query_is_torch_npus_public_get_npu_format(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def get_npu_format(t: object) -> int:
        calls.append(t)
        return 29

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(get_npu_format=get_npu_format))
    query = _npu_format._format_query(_npu_device())
    assert query is get_npu_format
    t = ints(2)
    assert _npu_format.private_format(t, _npu_device()) == "FRACTAL_NZ (29)" and calls == [t]


def test_a_torch_npu_without_the_query_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace())
    with pytest.raises(DeviceError, match="get_npu_format"):
        _npu_format._format_query(_npu_device())
