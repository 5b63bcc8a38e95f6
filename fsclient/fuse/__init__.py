"""The FUSE mount: ``stripefs mount`` / ``stripefs umount`` and the daemon behind them.

* :mod:`._operations` -- pyfuse3 ``Operations`` over the native client
  (:class:`StripeOperations`, :class:`FuseConfig`); the state they keep is in
  :mod:`._openfile` (an open file), :mod:`._writebehind` (the mount's write-behind
  budget), :mod:`._dirhandle` (an open directory), :mod:`._orphans` (open-but-unlinked
  files), :mod:`._dirattrs`, :mod:`._listings` and :mod:`._kernelleases` (what is
  answered without a round trip); docs/fuse.md "Modules" has one line each;
* :mod:`._daemon` -- mount preflight, the detached daemon, unmount;
* :mod:`._mounts` -- the records a running daemon leaves for ``umount`` and for the
  batch reader (which maps a mounted path to its cluster and inode).

``pyfuse3`` is imported only when a daemon starts, so the records and the
commands can be used on machines without the FUSE library.
"""

from __future__ import annotations

from typing import Any

from ._daemon import MountError, main, mount, umount
from ._mounts import MOUNT_STATE_DIR, mount_record, mount_state_path, mounted_fstype

__all__ = [
    "MountError", "main", "mount", "umount",
    "MOUNT_STATE_DIR", "mount_record", "mount_state_path", "mounted_fstype",
    "StripeOperations", "FuseConfig",
]


def __getattr__(name: str) -> Any:
    if name in ("StripeOperations", "FuseConfig"):
        from . import _operations

        return getattr(_operations, name)
    if name == "ORPHAN_DIR":
        from . import _orphans

        return _orphans.ORPHAN_DIR
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
