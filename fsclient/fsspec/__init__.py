"""The ``stripefs://`` fsspec filesystem (registered through the ``fsspec.specs`` entry point).

* :mod:`._filesystem` -- :class:`StripeFileSystem`, a thin adapter over the native client;
* :mod:`._file` -- :class:`StripeFsFile`, fsspec's file protocol over a native file,
  with transactions (write to a temporary name, publish by rename);
* :mod:`._ranges` -- ``cat_ranges``: many ranges of many files fetched concurrently.

    >>> import fsspec
    >>> fs = fsspec.filesystem("stripefs", cluster="/tmp/sfs/cluster.json")
"""

from ._file import StripeFsFile
from ._filesystem import StripeFileSystem

__all__ = ["StripeFileSystem", "StripeFsFile"]
