"""stripefs client: native API, cluster discovery, and the ways in (fsspec, FUSE, zero-copy reads).

    >>> import fsclient
    >>> fs = fsclient.Client()               # cluster of the last `stripefs up`
    >>> with fs.open("/data/x.bin", "wb") as f:
    ...     f.write(b"hello")
"""

from ._client import ROOT_INO, AsyncClient, Client, normpath
from ._config import ClusterConfig, find_cluster
from ._file import StripeFile

__all__ = ["AsyncClient", "Client", "ClusterConfig", "StripeFile", "find_cluster", "normpath", "ROOT_INO"]
