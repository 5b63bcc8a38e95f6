"""The client library core: cluster discovery, placement, parallel chunk I/O, file objects.

* :mod:`._config` -- :class:`ClusterConfig` and :func:`find_cluster` (explicit argument,
  ``STRIPEFS_CLUSTER``, then the last ``stripefs up``);
* :mod:`._core` -- ``ClientCore`` (private to this package): connections, routing,
  chunk placement (:func:`split`), read and write scheduling, retries;
* :mod:`._client` -- :class:`Client` (paths, namespace calls, and the by-inode interface
  the front ends use) and :class:`AsyncClient`;
* :mod:`._file` -- :class:`StripeFile`, the buffered file object.

The front ends (``fsclient.fuse``, ``fsclient.fsspec``, ``fsclient.batchread``) and
``staging`` build on what this package exports.
"""

from ._client import PREFIX, ROOT_INO, AsyncClient, Client, normpath
from ._config import ClusterConfig, default_state_file, find_cluster, remember_cluster
from ._core import split
from ._file import StripeFile, mode_flags
from ._lease import Lease
from ._proc import mounts, pid_alive
from ._rawbytes import fill_bytes

__all__ = [
    "PREFIX", "ROOT_INO", "AsyncClient", "Client", "normpath",
    "ClusterConfig", "default_state_file", "find_cluster", "remember_cluster",
    "split", "StripeFile", "Lease", "mode_flags", "mounts", "pid_alive", "fill_bytes",
]
