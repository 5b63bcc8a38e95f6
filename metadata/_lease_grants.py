"""Attribute leases, the service's side: which reads get a lease on which keys, and the watch.

The lease table (``_leasetable.py``) keeps the leases, invalidates them and tells their
holders; this module decides what a read asking for one (``lease=True`` on ``Resolve``,
``Lookup``, ``GetAttr``, ``StatMany``, ``ListNames``, ``Readdir``) is granted: the keys its
answer depends on (collected by its read plan, ``_reads.LEASED``), less those a directory's
walkers should not hold (:meth:`LeaseGrants._grant_attr`), and only for a whole listing.
A read answered on the trio loop reads and registers in one step; one that went to the
reader thread is granted only if no invalidation at all happened meanwhile.

It also serves a client's watch (``WatchLeases``, where its invalidations reach it) and
ends a client's leases when its watch connection closes cleanly.
"""

from __future__ import annotations

import stat
from typing import Any

from stripefs.rpc import ServerConn
from stripefs.wire import Attr, DirEntry, ErrorCode, ReplyMessage, StripefsError
from stripefs.wire import messages as m
from stripefs.wire._types import ListingPage

from ._commit import CommitPath
from ._leasetable import LeaseTable
from ._reads import LEASED, many_reply

__all__ = ["LeaseGrants"]


class LeaseGrants:
    """The attribute leases one metadata service grants.

    Args:
        table: the service's lease table (disabled, TTL 0, when it grants none).
        commit: where the leased reads run.
    """

    def __init__(self, table: LeaseTable, commit: CommitPath) -> None:
        self.table = table
        self.commit = commit
        self._watchers: dict[ServerConn, bytes] = {}  # watch connections (connection_ended)

    async def reply(self, conn: ServerConn, msg: Any) -> ReplyMessage:
        """The answer to a read asking for a lease (one of ``_reads.LEASED``), not answered
        on the loop: granted only if no invalidation happened while it was read (it may
        have read before a commit)."""
        since = self.table.changes
        keys: list[Any] = []
        fn, args, cost = LEASED[type(msg)](msg, keys)
        return self._answer(conn, msg, await self.commit.read(fn, *args, cost=cost), keys, since)

    def reply_now(self, conn: ServerConn, msg: Any) -> ReplyMessage | None:
        """The same answer read here on the loop, or None when the read is too long for it
        (``CommitPath.read_now``). Read and registered in one step on the loop: no
        commit's invalidation between."""
        keys: list[Any] = []
        fn, args, cost = LEASED[type(msg)](msg, keys)
        done, result = self.commit.read_now(fn, args, cost)
        return self._answer(conn, msg, result, keys, None) if done else None

    def _answer(self, conn: ServerConn, msg: Any, result: Any, keys: list[Any], since: int | None) -> ReplyMessage:
        """The reply to ``msg`` made of what its read returned, with the lease it gets."""
        if type(msg) is m.StatMany:
            return self._many_leased(conn, result, keys, since)
        if type(msg) is m.ListNames:
            return self._names_leased(conn, result, keys if not msg.after else [], since)
        if type(msg) is m.Readdir:
            return self._listing_leased(conn, msg, result, since)
        return m.AttrReply(result, *self._grant_attr(conn, msg, result, keys, since))

    def _many_leased(self, conn: ServerConn, found: list[Attr | StripefsError], keys: list[list[Any]],
                     since: int | None) -> m.StatManyReply:
        """A ``StatMany`` answer with a lease on each attribute (``LeaseTable.grant``)."""
        reply = many_reply(found)
        ids = [self.table.grant(conn.client_id, k, since)[0] for a, k in zip(found, keys)
               if not isinstance(a, StripefsError)]
        return m.StatManyReply(reply.attrs, reply.failed, reply.codes, ids,
                               int(self.table.ttl * 1000) if any(ids) else 0)

    def _names_leased(self, conn: ServerConn, page: tuple[list[str], bool], keys: list[Any],
                      since: int | None) -> m.NamesReply:
        """A ``ListNames`` page, with a lease when it is a whole listing (a first page with
        no more after it; ``keys`` empty otherwise): a directory's entries change only
        with its inode, one of the walk's keys."""
        names, more = page
        if more or not keys:
            return m.NamesReply(list(names), bool(more))
        return m.NamesReply(list(names), False, *self.table.grant(conn.client_id, keys, since))

    def _grant_attr(self, conn: ServerConn, msg: Any, attr: Attr, keys: list[Any],
                    since: int | None) -> tuple[int, int]:
        """The lease on a ``Resolve``, ``Lookup`` or ``GetAttr`` answer. A directory's
        ``Lookup`` or ``GetAttr`` (a FUSE mount walking through it) leaves out its attributes:
        every create or unlink in it changes them, and would wait for every mount that merely
        walked through it. Those who keep what depends on them hold a listing lease
        (:meth:`_listing_leased`); a ``Resolve`` (a native ``stat``) asked for them."""
        if type(msg) is not m.Resolve and stat.S_ISDIR(attr.mode):
            keys = [k for k in keys if k != attr.ino]
        if not keys:
            return 0, 0
        return self.table.grant(conn.client_id, keys, since)

    def _listing_leased(self, conn: ServerConn, msg: m.Readdir, page: tuple[list[DirEntry], bool],
                        since: int | None) -> m.ReaddirReply:
        """A ``Readdir`` page, with a lease on the directory's attributes when it is a whole
        listing (a first page with no more after it), or any page when the client asked
        for each (``lease_each_page``: it keeps the pages only if no invalidation came
        between them): its entries change only with them. A listing with attributes and
        layouts (``plus``, ``layouts``) is leased on its files' attributes too: a client
        may answer lookups of its names from it (a FUSE daemon,
        ``fsclient/fuse/_leaseddirs.py``). Its subdirectories' attributes are not leased
        (they change with every name made in them), nor meant to be relied on."""
        entries, more = page
        if type(entries) is not ListingPage:
            entries = list(entries)
        if (more or msg.after) and not msg.lease_each_page:
            return m.ReaddirReply(entries, bool(more))
        keys: list[Any] = [msg.ino]
        if msg.plus and msg.layouts:
            keys.extend(entries.file_inos() if type(entries) is ListingPage else
                        (e.ino for e in entries if e.attr is not None and not stat.S_ISDIR(e.attr.mode)))
        return m.ReaddirReply(entries, bool(more), *self.table.grant(conn.client_id, keys, since))

    async def watch(self, conn: ServerConn, msg: m.WatchLeases) -> m.WatchLeasesReply:
        """A client's long poll for its invalidations (``LeaseTable.watch``).

        Raises:
            StripefsError: NOT_SUPPORTED when this service grants no leases.
        """
        if not self.table.enabled:
            raise StripefsError(ErrorCode.NOT_SUPPORTED, "this metadata service grants no leases")
        self._watchers[conn] = conn.client_id
        seq, ids, reset = await self.table.watch(conn.client_id, msg.after, msg.wait_ms / 1000,
                                                 session=msg.session, done=msg.done)
        session_ms = int(self.table.session * 1000) if msg.session else 0
        return m.WatchLeasesReply(seq, ids, reset, session_ms)

    def connection_ended(self, conn: ServerConn, clean: bool) -> None:
        """A client's watch connection closed by the client itself -- its close, or its
        process's exit or death, the kernel closing the socket -- ends its leases at once:
        its watch drops every leased entry before it closes the connection, and a dead
        process caches nothing. A reset or an error (a network fault: the client may live
        on, unaware yet) leaves them to run out."""
        client = self._watchers.pop(conn, None)
        if client is not None and clean:
            self.table.release(client)
