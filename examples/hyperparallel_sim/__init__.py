"""A simulation of HyperParallel's torch HSDP group, for tests and the demo. Not HyperParallel.

HyperParallel (``mindspore-ai/hyper-parallel``) cannot be installed here, so the repository keeps
a *hostile* rebuild of the parts its comm fusion touches, modelled on its public sources
(HP-NOTES.md at the repository root lists every file and version read; no code is copied):

* :mod:`.dtensor`: its ``_make_subclass`` DTensor: the wrapper *shares* the local shard's
  storage, answers ``shape``/``size()``/``numel()`` globally and ``data_ptr()`` with the local's
  address, and routes every op through a layout dispatcher that raises for ops without a rule
  (``Tensor.data_ptr(w)``, ``w.untyped_storage()``, ``TensorBase.size(w)``). Two generations:
  the ``.data`` setter routed to the local tensor (the bug report's) and the newest rebinding
  one (traceable: ``__tensor_flatten__``, pass-through ``__torch_dispatch__``).
* :mod:`.param`: ``TorchHSDPParamV2``: even-only members (no ``padded_sharded_param_size``) and
  padded ones, with each generation's ``reset_sharded_param``.
* :mod:`.group`: ``HSDPParamGroup`` in its three flat-buffer shapes: V1
  (``_init_flat_param_buffer`` / ``_is_flat_buffer_valid``, member-0 pointer check, the
  ``param_dtype`` cast buffer), the ``enable_zero_copy`` flag, and the newest
  ``AllGatherBucket.init_flat_param_buffer`` per (shard group, dtype). The flat-buffer methods
  are replaceable, which is how flatpool's drop-in lines (docs/integration.md) are plugged in.
* :mod:`.unit`: one fully_shard unit (``HSDPState``): build eagerly or on meta, materialize,
  ``lazy_init``, train; :mod:`.measure`: live storages, surviving originals, wrapper views.

Collectives are real (``torch.distributed``); the group adds one ``all_gather_object`` after
each flat-buffer call so an error on one rank raises on every rank instead of hanging.
"""

from .dtensor import (
    HPDTensorBase,
    HPDTensorRebind,
    HPDTensorRouted,
    LayoutInferError,
    ShardLayout,
    dtensor_class,
    skip_dtensor_dispatch,
    wrapper_local_geometry,
    wrapper_own_values,
    wrapper_storage_key,
)
from .group import AllGatherBucket, HSDPParamGroupBucketed, HSDPParamGroupV1, PeerRankError, agreed
from .measure import MiB, Originals, census, digest, live_storages, member_holders
from .param import HSDPParam, MixedPrecisionPolicy, ShardMesh
from .unit import Config, FullyShardUnit, TwoWeights, measure, run

__all__ = [
    "AllGatherBucket", "Config", "FullyShardUnit", "HPDTensorBase", "HPDTensorRebind",
    "HPDTensorRouted", "HSDPParam", "HSDPParamGroupBucketed", "HSDPParamGroupV1",
    "LayoutInferError", "MiB", "MixedPrecisionPolicy", "Originals", "PeerRankError",
    "ShardLayout", "ShardMesh", "TwoWeights", "agreed", "census", "digest", "dtensor_class",
    "live_storages", "measure", "member_holders", "run", "skip_dtensor_dispatch",
    "wrapper_local_geometry", "wrapper_own_values", "wrapper_storage_key",
]
