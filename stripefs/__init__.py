"""The ``stripefs`` command: the top of the package order.

It dispatches to every layer below it (``fsclient`` for file tools and the
local cluster, ``fsclient.fuse`` for mounts, ``staging`` for the mover,
``bench`` for benchmarks), so nothing below may import it.

* :mod:`stripefs.cli` -- the ``stripefs`` console script;
* :mod:`stripefs.demo` -- ``make demo``: a local cluster, striped I/O, a FUSE mount,
  a checkpoint through the mover.
"""

__all__: list[str] = []
