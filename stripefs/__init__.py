"""stripefs: a parallel file system client and checkpoint I/O toolkit.

The one import name of the distribution. Its layers live in folders of their own at the
top of the repository and install beneath this package, in the order they may import
each other (tests/test_layout.py pins it)::

    stripefs.wire < stripefs.rpc < {stripefs.metadata, stripefs.storage, stripefs.fsclient}
        < stripefs.staging < stripefs.bench < stripefs.cli, stripefs.demo

What a training script needs is one import away, loaded on first use (``import stripefs``
alone loads nothing else, so ``stripefs.staging``, which imports torch, costs nothing
until it is asked for)::

    from stripefs import Client                # the native client (stripefs.fsclient)
    import stripefs.staging as staging         # checkpoints: save, load, latest, DCP
    fs = fsspec.filesystem("stripefs")         # the fsspec filesystem, by its protocol

* :mod:`stripefs.cli` -- the ``stripefs`` console script; it dispatches to every layer,
  so nothing below may import it;
* :mod:`stripefs.demo` -- ``make demo``: a local cluster, striped I/O, a FUSE mount,
  a checkpoint through the mover.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stripefs.fsclient import AsyncClient, Client, ClusterConfig, StripeFile, find_cluster

__all__ = ["AsyncClient", "Client", "ClusterConfig", "StripeFile", "find_cluster"]

_FROM_FSCLIENT = frozenset(__all__)
_LAYERS = frozenset({"wire", "rpc", "metadata", "storage", "fsclient", "staging", "bench"})


def __getattr__(name: str) -> Any:
    """``stripefs.Client`` and friends, and ``stripefs.staging`` & co. without an explicit
    import of the layer: each is imported the first time it is named."""
    if name in _FROM_FSCLIENT:
        value = getattr(importlib.import_module("stripefs.fsclient"), name)
    elif name in _LAYERS:
        value = importlib.import_module(f"stripefs.{name}")
    else:
        raise AttributeError(f"module 'stripefs' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FROM_FSCLIENT | _LAYERS)
