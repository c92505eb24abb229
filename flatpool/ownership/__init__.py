"""Ownership transfer: adopt tensors into slices, prove the originals died, roll back on failure.

[Note: flatpool terms]
The engine's modules use these words, each for one thing only:

* **pool**: a :class:`~flatpool.FlatPool`, one ``uint8`` storage on one device plus the layout
  of its slices and the registry of what was adopted into them.
* **slice**: a :class:`~flatpool.Slice`, a typed byte range ``[offset, end)`` of a pool; the
  handle holds no tensor.
* **original**: a storage that adoption moves out of: the storage of the tensor an
  :class:`~flatpool.AdoptSpec` names (its *primary*), or a pool's old storage during
  ``grow``/``compact``. The transaction holds it until the release proof, then keeps only a
  weak reference that tells whether it died.
* **member**: one tensor *object* that moves with an original onto the pool, keeping its
  identity: the primary, a view or wrapper on the same storage, what a holder holds, what
  ``discover`` finds; also a bound object that re-adoption or relocation moves. How it moves
  is a :class:`~flatpool.ownership._moves.Move`; its journal record is a
  :class:`~flatpool.ownership._moves.Member`.
* **holder**: a :class:`~flatpool.Holder`, a *place* (``getattr(owner, key)`` or
  ``owner[key]``) that holds a member; re-adoption looks there for a replacement object.
* **wrapper**: a tensor subclass object that stands for another tensor: torch's DTensor (no
  memory of its own) or HyperParallel's ``_make_subclass`` DTensor (shares its local tensor's
  storage; meta after deferred init).
* **local tensor**: a wrapper's ``_local_tensor``, the plain tensor that holds the data.
* **binding**: what the registry keeps of a member after adoption
  (:class:`~flatpool._registry.Binding`): how to find it again and where it must sit.
* **in place**: a bound member sits exactly where its binding says, by its TensorImpl
  (:func:`~flatpool.ownership._validity.in_place`); *moved* is its negation.

The layers, each importing only what lies below it: operations (``_adopt``, ``_readopt``,
``_relocate``, ``_meta``) -> ``_release`` (pins, release proof) -> ``_transaction``
(journal, rollback) -> ``_moves`` (the only place bytes and tensors move) -> :mod:`flatpool._state`
and the guards below the engine (:mod:`flatpool._interrupts`, :mod:`flatpool._gcpause`). The
engine never imports :mod:`flatpool.pool`; ``census`` (:mod:`flatpool._census`) reads pools and
stands above it. Layers above (``flatpool.optim``, ``integrations``) use only the names below.
"""

from .._interrupts import RollbackError
from ._adopt import adopt_many
from ._spec import AdoptedItem, AdoptionReport, AdoptSpec, OnPinned, check_policy

__all__ = ["AdoptSpec", "AdoptedItem", "AdoptionReport", "OnPinned", "RollbackError",
           "adopt_many", "check_policy"]
