"""stripefs client: the native API, cluster discovery, and one subpackage per way in.

* :mod:`fsclient.core` -- the client library (config, discovery, placement, file objects);
* :mod:`fsclient.fuse` -- the FUSE mount (``stripefs mount``);
* :mod:`fsclient.fsspec` -- the ``stripefs://`` fsspec filesystem;
* :mod:`fsclient.batchread` -- zero-copy batch reads and datasets for dataloaders;
* :mod:`fsclient.testing` -- local clusters on 127.0.0.1 (``stripefs up``, tests, benchmarks).

    >>> import fsclient
    >>> fs = fsclient.Client()               # cluster of the last `stripefs up`
    >>> with fs.open("/data/x.bin", "wb") as f:
    ...     f.write(b"hello")
"""

from .core import ROOT_INO, AsyncClient, Client, ClusterConfig, StripeFile, find_cluster, normpath

__all__ = ["AsyncClient", "Client", "ClusterConfig", "StripeFile", "find_cluster", "normpath", "ROOT_INO"]
