"""The HSDP / FSDP2 fusion layer: adopt a param group's shards into one pool per dtype."""

from flatpool.errors import UnfusedGroupWarning

from ._allgather import fused_all_gather, per_param_all_gather
from .failsafe import keep_fused
from .fsdp2 import FusedModule, flat_optimizer, fsdp_param_groups, fuse_fully_sharded, lazy_init
from .group import GroupBuffers, adopt_group, adopt_spec
from ._hyperparallel import BucketLines, V1Lines, cast_buffer, flat_buffer, fuse, is_fused
from ._kept import KeptAlive, KeptOriginal
from .layout import Bucket, MemberLayout
from ._meta import materialize_group
from ._protocol import ShardedParam
from .torchtitan import TorchtitanRecipe
from .validity import is_valid, member_problems, needs_replan, problems, readopt_group

__all__ = [
    "Bucket", "BucketLines", "FusedModule", "GroupBuffers", "KeptAlive", "KeptOriginal",
    "MemberLayout", "ShardedParam", "TorchtitanRecipe", "UnfusedGroupWarning", "V1Lines", "adopt_group",
    "adopt_spec", "cast_buffer", "flat_buffer", "flat_optimizer", "fsdp_param_groups",
    "fuse_fully_sharded", "fuse", "fused_all_gather", "is_fused", "is_valid", "keep_fused",
    "lazy_init", "materialize_group", "member_problems", "needs_replan",
    "per_param_all_gather", "problems", "readopt_group",
]
