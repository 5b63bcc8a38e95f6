"""Socket transports for the wire protocol.

* :func:`serve_rpc` / :class:`Service` -- the trio server loop (metadata and storage servers),
  bounded by a :class:`ByteBudget` of payload bytes (BUSY past ``BUSY_AFTER`` seconds of
  waiting), a connection cap, and a per-client connection cap (:class:`ClientSlots`);
  :meth:`ServerConn.reply_from_thread` / :class:`ThreadReply` answer from a worker thread,
  :meth:`ServerConn.reply_in_thread` from the connection's own reply thread;
* :class:`Connection` -- a blocking, pipelined client connection with in-place receives;
* :class:`TrioConnection` -- a small trio client for server-to-server control calls;
* :class:`ConnectionPool` / :class:`TrioPool` -- connections by server (moves, breakage, fork).

Every one of them drives the sans-IO state machines of ``wire`` (``ClientConnection``,
``ServerConnection``); none speaks the protocol itself.
"""

from ._buffers import BufferPool, aligned
from ._pid import my_pid
from ._client import Connection, Reply, abandon, unavailable
from ._pool import ConnectionPool, TrioPool
from ._replies import ThreadReply
from ._settings import cannot_start, int_setting
from ._server import (
    BUSY_AFTER, MAX_CLIENT_CONNECTIONS, PAYLOAD_BUDGET, ByteBudget, ClientSlots, ReplayCache, ServerConn, Service,
    serve_rpc, tune_socket,
)
from ._trio_client import TrioConnection

__all__ = [
    "cannot_start", "int_setting", "BufferPool", "aligned", "my_pid", "Connection", "Reply", "abandon", "unavailable", "ConnectionPool", "TrioPool",
    "ThreadReply", "BUSY_AFTER", "MAX_CLIENT_CONNECTIONS", "PAYLOAD_BUDGET", "ByteBudget", "ClientSlots", "ReplayCache", "ServerConn", "Service", "serve_rpc", "tune_socket", "TrioConnection",
]
