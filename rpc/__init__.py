"""Socket transports for the wire protocol.

* :func:`serve_rpc` / :class:`Service` -- the trio server loop (metadata and storage servers);
* :class:`Connection` -- a blocking, pipelined client connection with in-place receives;
* :class:`TrioConnection` -- a small trio client for server-to-server control calls.
"""

from ._buffers import BufferPool, aligned
from ._client import Connection, Reply, abandon, unavailable
from ._server import ReplayCache, ServerConn, Service, serve_rpc, tune_socket
from ._trio_client import TrioConnection

__all__ = ["BufferPool", "aligned", "Connection", "Reply", "abandon", "unavailable", "ReplayCache", "ServerConn", "Service", "serve_rpc", "tune_socket", "TrioConnection"]
