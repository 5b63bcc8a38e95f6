"""Checkpoint staging: save without stalling the training loop, a background mover, fast load.

    >>> import staging
    >>> h = staging.save(model.state_dict(), "stripefs://ckpt/run1/step-000100")   # blocks for the snapshot only
    >>> h.wait()                                                                 # globally durable
    >>> state = staging.load(staging.latest("stripefs://ckpt/run1"))

See ``docs/checkpoint-format.md`` for the on-disk format and the guarantees.
"""

from ._format import CheckpointConflict, ChecksumError
from ._load import latest, load, read_manifest, verify
from ._mover import MoverOptions
from ._ranks import CheckpointAborted
from ._replicas import Durability
from ._save import SaveHandle, default_staging_dir, release_buffers, save
from ._service import Mover

__all__ = [
    "save", "load", "latest", "verify", "read_manifest", "SaveHandle", "Durability", "Mover", "MoverOptions",
    "ChecksumError", "CheckpointConflict", "CheckpointAborted", "StagedStorageWriter", "StagedStorageReader", "default_staging_dir",
    "release_buffers",
]


def __getattr__(name: str):  # the DCP bridge imports torch.distributed lazily
    if name in ("StagedStorageWriter", "StagedStorageReader"):
        from . import _dcp

        return getattr(_dcp, name)
    raise AttributeError(name)
