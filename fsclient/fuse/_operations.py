"""The FUSE face of stripefs: pyfuse3 ``Operations`` over the native client.

A thin adapter. Every call to the cluster runs on a worker thread (through
:class:`~fsclient.AsyncClient`), so the trio loop that pyfuse3 drives never
blocks; the data path underneath is the native client's parallel chunk I/O.
stripefs inode numbers are the FUSE inode numbers (root 1 == ``ROOT_INODE``).

Semantics (docs/fuse.md has the long form):

* Open files: one state per inode per mount (:class:`~fsclient.fuse._openfile.OpenFile`), shared by all
  handles, holding a :class:`~fsclient.StripeFile` (write-behind buffers,
  sequential readahead). Writes are acknowledged once buffered; errors surface
  at ``flush`` (every ``close``), ``fsync`` or the next write. The file length
  is committed at every ``flush``/``fsync`` (close-to-open consistency).
  A sequential write is copied into the write-behind buffer on the trio loop (no
  worker-thread hop); a full buffer is sent in the background, the mount's bytes in
  flight bounded by ``write_buffer_mb`` (:meth:`~fsclient.fuse._writebehind.WriteBudget.write_on_loop`).
* Unlinking (or renaming over) a file that is open in this mount links it
  into ``/.stripefs-orphans`` first ("silly rename", as NFS does); the last
  ``release`` removes it. Orphans of a crashed daemon are removed by the next
  mount on the same host (:class:`~fsclient.fuse._orphans.Orphans`).
* Page cache: ``keep_cache`` is granted at open only when the file's version
  (``stamp_of``: size, mtime, ctime and truncation count) is the one this mount last saw; otherwise the kernel drops
  the cached pages and attributes (close-to-open across mounts). A new open of a
  file already open here commits this mount's writes and, when the file changed
  elsewhere, starts its state over from fresh attributes.
* Directory attributes fetched less than ``attr_timeout`` ago answer the kernel's
  GETATTR (it asks again after every create and unlink), with this mount's own
  changes applied (:class:`~fsclient.fuse._dirattrs.DirAttrs`); never older than ``attr_timeout`` in all.
* Directory listings, and the names of directories made or listed here, are kept for
  the smaller of the two timeouts and served again (:class:`~fsclient.fuse._listings.Listings`):
  a listing, or the lookup before a create, needs no round trip within them; this
  mount's own changes drop or update what is kept.
* Attribute leases (:class:`~fsclient.fuse._kernelleases.KernelLeases`): lookups and
  ``getattr`` ask for one while the client's lease watch is live; the kernel keeps a
  leased answer for the lease's remaining lifetime, and another client's change to it
  is taken back from the kernel (on the watch thread) before that change returns. A
  directory's lookup lease covers its entry only (creates in it must not wait for every
  mount that walked through it); a whole listing's ``Readdir`` asks for a lease on the
  directory's attributes, which the kept listing and names of it rest on.
* ``O_APPEND`` handles are ``direct_io``, and the daemon writes each append at the
  committed length (asked at every write), not at the kernel's cached size.
* Stopping: :meth:`StripeOperations.drain` commits every open file before the
  daemon exits (signals, unmount).

Caveats:

* Permission checks are the kernel's (``default_permissions``); no ACLs.
* Extended attributes (``user.``, ``trusted.``, ``security.``) are stored by the
  metadata service; ``system.*`` (POSIX ACLs) is refused, since the kernel would
  not enforce ACLs under ``default_permissions``.
* Open-but-unlinked files survive only for handles of the mount that unlinked;
  another mount's handles lose the data (the metadata service cannot know them).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import logging
import math
import mmap
import os
import stat
import time
from typing import Any, Awaitable, Callable, TypeVar

import pyfuse3
import trio

from stripefs.rpc._metrics import Lazy
from stripefs.wire import MAX_NAME, Attr, ErrorCode, StripefsError, messages as m
from stripefs.wire._types import ListingPage

from ..core import AsyncClient, Client
from ..core._acall import _result
from ..core._core import REQUEST_TIMEOUT
from ..core._wholefiles import Reservation
from ._dirattrs import DirAttrs
from ._dirhandle import OFFSET_BITS, READDIR_PAGE, DirHandle
from ._kernelleases import KernelLeases
from ._leaseddirs import MAX_LISTING, LeasedDirs
from ._leaseddirs import PAGE as LEASED_PAGE
from ._listings import Listings, Page
from ._loopreads import LoopRead, LoopReads
from ._newfiles import NewFiles
from ._openfile import OpenFile, Stamp, stamp_of
from ._orphans import ORPHAN_DIR, Orphans
from ._writebehind import WriteBudget

# The page cache decision at each open (counted only while the daemon serves metrics).
_PAGE_CACHE = ("Counter", "stripefs_fuse_page_cache_opens",
               "Opens that kept the kernel's cached pages of the file (decision=keep) or dropped them", ("decision",))
PAGE_CACHE_KEPT = Lazy(*_PAGE_CACHE, values=("keep",))
PAGE_CACHE_DROPPED = Lazy(*_PAGE_CACHE, values=("drop",))

# Small files read whole (asked for at a read-only OPEN, or at the first READ), by the
# connection the request took: the loop's own (_loopreads), the client's, or none that
# answered (read again the plain way).
_WHOLE_READS = ("Counter", "stripefs_fuse_whole_reads",
                "Small files read whole, by connection (path=loop, client) or read again after that failed "
                "(path=reread)", ("path",))
WHOLE_READS_LOOP = Lazy(*_WHOLE_READS, values=("loop",))
WHOLE_READS_CLIENT = Lazy(*_WHOLE_READS, values=("client",))
WHOLE_READS_REREAD = Lazy(*_WHOLE_READS, values=("reread",))

__all__ = ["StripeOperations", "FuseConfig"]

log = logging.getLogger(__name__)

# A file up to this size is read whole at its first read, on the trio loop, and its later
# reads are answered from memory: a dataset's small files cost one request each. A read-only
# OPEN that drops the kernel's pages sends that request already (``_read_ahead``).
SMALL_FILE = 1 << 20

BLKSIZE = 1 << 20  # st_blksize: stdio, Python io and cp size their buffers by it
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
R = TypeVar("R")


class FuseConfig:
    """Mount tunables (``-o`` options of ``stripefs mount`` that are ours, not libfuse's).

    Args:
        attr_timeout: seconds the kernel may cache attributes.
        entry_timeout: seconds the kernel may cache a name -> inode lookup.
        direct_io: bypass the kernel page cache for file data.
        readahead_kb: kernel readahead window set on the mount's bdi (0 = leave it).
        write_buffer_mb: write-behind bytes the mount keeps in flight to the storage
            servers, all files together, before a write waits (on the loop) for room.
        qos: the traffic class of the mount's chunk writes (``Client(qos=...)``).
        read_only: mounted ``ro``: the kernel refuses every change, so a close has nothing
            to flush (the first FLUSH is answered ENOSYS: the kernel sends none after it).
    """

    def __init__(self, attr_timeout: float = 1.0, entry_timeout: float = 1.0,
                 direct_io: bool = False, readahead_kb: int = 16384, write_buffer_mb: int = 256,
                 qos: str = "interactive", read_only: bool = False):
        self.attr_timeout = attr_timeout
        self.entry_timeout = entry_timeout
        self.direct_io = direct_io
        self.readahead_kb = readahead_kb
        self.write_buffer_mb = write_buffer_mb
        self.qos = qos
        self.read_only = read_only


def _errors(fn: F) -> F:
    """Translate client errors into ``FUSEError(errno)`` once, for every handler."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from exc
        except Exception as exc:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from exc

    return wrapper  # type: ignore[return-value]


# What changes the file system; a read-only mount refuses them itself too (the kernel does
# first; this holds if it was remounted read-write, which would also leave it without FLUSH).
CHANGES = ("setattr", "mkdir", "rmdir", "symlink", "link", "unlink", "rename", "create", "mknod", "write",
           "setxattr", "removexattr")


def _reads_only(flags: int) -> bool:
    """An open with ``flags`` neither writes nor truncates."""
    return flags & (os.O_ACCMODE | os.O_TRUNC) == os.O_RDONLY


def _refuse_changes(ops: "StripeOperations") -> None:
    """Make ``ops`` answer every change with EROFS, and every open for writing."""

    async def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    for op in CHANGES:
        setattr(ops, op, refuse)
    opener = ops.open

    async def open_read_only(inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if not _reads_only(flags):
            raise pyfuse3.FUSEError(errno.EROFS)
        return await opener(inode, flags, ctx)

    ops.open = open_read_only  # type: ignore[method-assign]


def _name(raw: bytes) -> str:
    return os.fsdecode(raw)


class StripeOperations(pyfuse3.Operations):
    """pyfuse3 operations serving a stripefs cluster.

    Args:
        client: a connected native client (the daemon owns it).
        config: mount tunables.
    """

    enable_writeback_cache = False  # the kernel would then ignore sizes committed by other mounts

    def __init__(self, client: Client, config: FuseConfig | None = None):
        super().__init__()
        self.client = client
        self.aio = AsyncClient(client, limiter=trio.CapacityLimiter(64))
        core = client._core
        # Whole small files read at OPEN, on connections of the loop (the daemon attaches it).
        self.loop_reads = LoopReads(core.config.secret, core.client_id, core.config.role)
        self.nursery: trio.Nursery | None = None  # the daemon's (attach): background work
        self.config = config or FuseConfig()
        self.files: dict[int, OpenFile] = {}  # ino -> open state
        self.handles: dict[int, int] = {}  # fh -> ino
        self.appenders: set[int] = set()  # fhs opened with O_APPEND (see OpenFile.append)
        self.unprivileged: set[int] = set()  # fhs opened by a non-root user: their writes clear setuid/setgid
        self.dirs: dict[int, DirHandle] = {}
        self.dir_attrs = DirAttrs(self.config.attr_timeout)
        self.listings = Listings(min(self.config.attr_timeout, self.config.entry_timeout))
        self.leased_dirs = LeasedDirs()  # files' attributes under a listing lease: lookups answered here
        self.orphans = Orphans(self.aio, self.dir_attrs, self.listings)
        self.mount_id = self.orphans.mount_id  # the daemon writes it into the mount record too
        self.lookups: dict[int, int] = {}
        self.told: dict[int, Stamp] = {}  # ino -> the version (stamp_of) whose attributes the kernel was given last
        self.cached: dict[int, Stamp] = {}  # ino -> the version (stamp_of) of the kernel's page cache
        self.closing: dict[int, trio.Event] = {}
        self.writes = WriteBudget(self.config.write_buffer_mb << 20)
        self.new_files = NewFiles(client, self.aio)  # CREATEs whose name is made at fsync/close
        self._fh = itertools.count(1)
        self._rbufs: list[mmap.mmap] = []  # never closed: pyfuse3 may still hold a view
        self._wbufs: list[mmap.mmap] = []  # SMALL_FILE buffers for whole reads, back at release
        # (ino, name) -> when "no such attribute" stops being trusted. The kernel asks for
        # security.capability before every write(2) to a file; answering that from here
        # keeps a metadata round trip off each write (as stale as attributes may be).
        self._no_xattr: dict[tuple[int, bytes], float] = {}
        # Attribute leases (see _kernelleases.py): the client's lease watch, started now.
        core = client._core
        cache = core.lease_cache() if core.leases else None
        self.kernel_leases = KernelLeases(cache, self._forget_inos) if cache is not None else None
        # ino -> (attributes, lease expiry, cache state) of a leased LOOKUP or GETATTR answer:
        # the OPEN that follows a lookup takes them instead of asking again (_open_attr).
        self._fresh: dict[int, tuple[Attr, float, tuple[int, int]]] = {}
        if self.config.read_only:
            _refuse_changes(self)

    def attach(self, nursery: trio.Nursery) -> None:
        """Run background work in ``nursery`` (the daemon's, until its loop ends): the
        loop's storage connections, opened now (:meth:`_connect_storage`), listings fetched
        for lookups. Without one (operations driven by a test), that work is awaited where
        it starts, and reads go the client's way."""
        self.nursery = nursery
        self.loop_reads.attach(nursery)
        nursery.start_soon(self._connect_storage)

    async def _connect_storage(self) -> None:
        """Open the loop's connection to every serving storage server (the chain table
        fetched off the loop), so that the first files read through the mount do not go the
        client's way while their server's connection is being made (4.8-12.5 ms each, on
        connections of the client that were being made too). A server that cannot be
        reached now is tried again at its first read, as before."""
        try:
            routing = await trio.to_thread.run_sync(self.client.routing)
        except (StripefsError, OSError) as exc:
            log.info("storage connections are opened at first use (no chain table yet: %s)", exc)
            return
        for info in routing.servers.values():
            if info.state == "serving":
                self.loop_reads.connection(info.server_id, (info.host, info.port))

    # -- helpers ------------------------------------------------------------------------
    def _entry(self, attr: Attr, age: float = 0.0) -> pyfuse3.EntryAttributes:
        """The kernel's view of ``attr``, given ``age`` seconds after the service gave it:
        the timeouts are what is left of them."""
        size, nlink = attr.size, attr.nlink
        state = self.files.get(attr.ino)
        if state is not None:
            size = max(size, state.length())
            if state.orphan:  # an orphaned (silly-renamed) inode is unlinked as far as users can tell
                nlink -= 1
        self.told[attr.ino] = stamp_of(attr, size)
        return _attributes(attr, size, nlink, max(0.0, self.config.entry_timeout - age),
                           max(0.0, self.config.attr_timeout - age))

    def _looked_up(self, attr: Attr) -> pyfuse3.EntryAttributes:
        """An entry reply that raises the kernel's lookup count by one."""
        self.lookups[attr.ino] = self.lookups.get(attr.ino, 0) + 1
        return self._entry(attr)

    async def _named(self, parent: int, name: bytes, request: Awaitable[R]) -> R:
        """Await ``request``, which makes ``name`` in directory ``parent`` (or opens it):
        the parent's kept pages go, and its kept names gain ``name`` (or are forgotten
        when the outcome is unknown)."""
        try:
            reply = await request
        except BaseException:
            self.listings.forget_names(parent)
            raise
        else:
            self.listings.added(parent, _name(name))
            return reply
        finally:
            self.listings.drop(parent)

    def _forget_inos(self, inos: set[int]) -> None:
        """Another client changed these inodes (their leases were invalidated): what this
        daemon keeps of them goes (on the loop, before the kernel is told)."""
        for ino in inos:
            self._fresh.pop(ino, None)
            self.leased_dirs.drop(ino)
            self.dir_attrs.drop(ino)
            self.listings.drop(ino)
            self.listings.forget_names(ino)
        for key in [k for k in self._no_xattr if k[0] in inos]:
            del self._no_xattr[key]

    async def _leased(self, msg: Any, ino: int | None = None, parent: int = 0,
                      name: bytes = b"") -> tuple[Attr, float | None]:
        """A ``Lookup`` or ``GetAttr``, asking for a lease while the watch is live: its
        attributes, and the timeout the kernel may keep them for (None: the mount's own)."""
        kl = self.kernel_leases
        if kl is None or not kl.asking:
            return await self.aio.attr(msg), None
        token, sent = kl.token(), time.monotonic()
        reply = await self.aio.call(dataclasses.replace(msg, lease=True))
        return reply.attr, kl.timeout(token, reply.lease_id, reply.lease_ms, sent, reply.attr.ino, parent, name)

    async def _attr(self, ino: int) -> Attr:
        return await self.aio.attr(m.GetAttr(ino=ino))

    def _cache_state(self) -> tuple[int, int] | None:
        """What changes whenever a leased answer may have gone stale: this client's own
        mutations begun or ended and the invalidations it was told of (None while one of
        its mutations is unanswered, or without leases)."""
        kl = self.kernel_leases
        if kl is None or not kl.asking or kl.cache.inflight:
            return None
        return kl.cache.mutations, kl.cache.invalidations

    def _keep_fresh(self, attr: Attr, leased: float) -> None:
        """Remember a leased answer for the OPEN that usually follows it."""
        state = self._cache_state()
        if not attr.is_file or leased <= 0 or state is None:
            return
        if len(self._fresh) >= 65536:
            self._fresh.clear()
        self._fresh[attr.ino] = (attr, time.monotonic() + leased, state)

    async def _open_attr(self, ino: int, flags: int) -> Attr:
        """The attributes an OPEN starts from: fresh ones (close-to-open), which a read-only
        open takes from a leased LOOKUP or GETATTR answer when nothing could have changed
        them since -- another client's change would have invalidated the lease first, and
        this client changed nothing meanwhile -- and asks the service for otherwise."""
        hit = self._fresh.pop(ino, None)
        if (hit is not None and _reads_only(flags)
                and hit[1] > time.monotonic() and hit[2] == self._cache_state()):
            return hit[0]
        return await self._attr(ino)

    async def _locked(self, state: OpenFile, fn: Callable[..., Any], *args: Any) -> Any:
        async with state.lock:
            return await self.aio.run(fn, *args)

    # -- lookups ------------------------------------------------------------------------
    @_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        version, text = self.dir_attrs.version, _name(name)
        left = self.listings.absent(parent_inode, text)
        if left is None and self.listings.filling(parent_inode):
            await self._fetch_names(parent_inode)
            left = self.listings.absent(parent_inode, text)
        if left is not None:  # not among the names this mount knows of parent (see Listings)
            if len(name) > MAX_NAME:  # what the service would have said (the kernel checks no length)
                raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
            missing = pyfuse3.EntryAttributes()
            missing.st_ino = 0  # a negative entry: the kernel keeps "no such name" for the rest of the time
            # ... unless the names are leased: their invalidation could not take it back
            # from the kernel (it drops the names here, and each lookup asks this daemon).
            missing.entry_timeout = 0.0 if self.listings.leased(parent_inode) else left
            self.new_files.said_missing(parent_inode, name)
            return missing
        e = self._from_listing(parent_inode, name, text)
        if e is None and parent_inode in self.leased_dirs.pending:  # its listing is on its way
            await self.leased_dirs.wait(parent_inode)
            e = self._from_listing(parent_inode, name, text)
        if e is not None:
            return e
        try:
            attr, leased = await self._leased(m.Lookup(parent=parent_inode, name=text), parent=parent_inode, name=name)
        except StripefsError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                self.new_files.said_missing(parent_inode, name)
                self.listings.missed(parent_inode)
            raise
        self.dir_attrs.put(attr, version)
        e = self._looked_up(attr)
        if leased is not None:
            self._keep_fresh(attr, leased)
            e.entry_timeout = leased
            if not stat.S_ISDIR(attr.mode):  # a directory's lease covers its entry only
                e.attr_timeout = leased
            if leased > 0 and self.leased_dirs.looked_up(parent_inode, attr):
                # This lookup has its answer: it does not wait for the listing (a directory
                # of thousands of files takes tens of milliseconds to list); the lookups
                # that come meanwhile wait for its first page (LeasedDirs.wait).
                if self.nursery is not None:
                    self.nursery.start_soon(self._fetch_leased_quietly, parent_inode)
                else:
                    await self._fetch_leased(parent_inode)
        return e

    def _from_listing(self, parent: int, name: bytes, text: str) -> pyfuse3.EntryAttributes | None:
        """The answer to a lookup of a file in a directory whose listing is leased (see
        ``_leaseddirs.py``), told to the kernel under that lease; None: ask the service."""
        kl = self.kernel_leases
        if kl is None or not self.leased_dirs.dirs:
            return None
        hit = self.leased_dirs.get(parent, text, self._cache_state())
        if hit is None:
            return None
        attr, lease_id = hit
        left = kl.also(lease_id, parent, name, attr.ino)
        if left <= 0:  # the lease is being taken back: ask the service
            self.leased_dirs.drop(parent)
            return None
        e = self._looked_up(attr)
        e.entry_timeout = e.attr_timeout = left
        self._keep_fresh(attr, left)
        return e

    async def _fetch_leased(self, ino: int) -> None:
        """Fetch the files' attributes of directory ``ino``, whose files are being looked
        up one after another, page by page, each page under a lease (see
        ``_leaseddirs.py``). Nothing is kept after an error, without a lease, for a listing
        of more than ``MAX_LISTING`` entries, or when anything changed while it was asked
        (an invalidation, a mutation of this client: between the first page's request and
        the last page's answer)."""
        kl = self.kernel_leases
        pages: list[tuple[ListingPage, int]] | None = None
        expires, more, state = math.inf, False, self._cache_state()
        try:
            if kl is None or not kl.asking:
                return
            token, got, after, listed = kl.token(), [], "", 0
            while True:
                sent = time.monotonic()
                header = await self.aio.call_header(m.Readdir(ino=ino, after=after, limit=LEASED_PAGE, plus=True,
                                                              layouts=True, lease=True, lease_each_page=True))
                reply, page = m.ReaddirReply.with_page(header)  # checked; its entries made as looked up
                left = kl.timeout(token, reply.lease_id, reply.lease_ms, sent, ino)
                if not left:  # no lease, or an invalidation since the first page was asked
                    return
                expires = min(expires, time.monotonic() + left)
                got.append((page, reply.lease_id))
                if not reply.more or not len(page):
                    pages = got
                    return
                self.leased_dirs.first_page_in(ino)  # more pages: the lookups waiting ask the service
                listed += len(page)
                if listed >= MAX_LISTING:
                    more = True
                    return
                after = page.names[-1]
        except StripefsError:
            pass  # the lookups go to the service, as before
        finally:
            self.leased_dirs.put(ino, pages, expires - time.monotonic(),
                                 state if state == self._cache_state() else None, more=more)

    async def _fetch_leased_quietly(self, ino: int) -> None:
        """:meth:`_fetch_leased` as a task of its own: what fails is logged (the lookups
        go on asking the service)."""
        try:
            await self._fetch_leased(ino)
        except Exception:
            log.exception("fetching the listing of directory %d", ino)

    async def _fetch_names(self, ino: int) -> None:
        """Every name of directory ``ino``, which this mount is filling, fetched under a
        listing lease and kept while it lives (see Listings): the lookups of new names that
        follow are answered "no such name" without a round trip each. Nothing is kept
        without a lease, from a listing of more than one page, or after an error (the
        lookup asks the service as before)."""
        kl = self.kernel_leases
        if kl is None or not kl.asking:
            return
        self.listings.fetching(ino)
        names: set[str] | None = None
        asked, keep = trio.current_time(), 0.0
        try:
            token, sent = kl.token(), time.monotonic()
            reply = await self.aio.call(m.Readdir(ino=ino, limit=READDIR_PAGE, plus=False, lease=True))
            left = kl.timeout(token, reply.lease_id, reply.lease_ms, sent, ino)
            if reply.more:
                self.listings.too_big(ino)
            elif left:
                names, keep = {e.name for e in reply.entries}, trio.current_time() - asked + left
        except StripefsError:
            pass  # the lookup that follows meets the same error, and reports it
        finally:
            self.listings.put_fetched(ino, names, asked, keep)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            left = self.lookups.get(ino, 0) - n
            if left > 0:
                self.lookups[ino] = left
            else:  # the kernel dropped the inode and its pages
                self.lookups.pop(ino, None)
                self.told.pop(ino, None)
                self.cached.pop(ino, None)
                self._fresh.pop(ino, None)

    @_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        hit = self.dir_attrs.get(inode)
        if hit is not None:  # a directory fetched recently (see DirAttrs)
            e = self._entry(hit[0])
            e.attr_timeout = min(e.attr_timeout, hit[1])
            return e
        version = self.dir_attrs.version
        attr, leased = await self._leased(m.GetAttr(ino=inode))
        self.dir_attrs.put(attr, version)
        e = self._entry(attr)
        if leased is not None:
            self._keep_fresh(attr, leased)
            e.attr_timeout = leased
        return e

    @_errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            return await self._setattr(inode, attr, fields, ctx)
        finally:
            self.listings.clear()  # whichever listings show the inode (also after a partial change)

    async def _setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                       ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        state = self.files.get(inode)
        if state is not None:  # buffered writes land (and commit their mtime) before the change
            await self._locked(state, state.sync)
        if fields.update_size:
            if state is not None:
                await self._locked(state, state.truncate, attr.st_size)
            else:
                await self.aio.attr(m.SetAttr(ino=inode, size=attr.st_size))
        kw: dict[str, int] = {}
        if fields.update_mode:
            kw["mode"] = stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            kw["uid"] = attr.st_uid
        if fields.update_gid:
            kw["gid"] = attr.st_gid
        if fields.update_atime:
            kw["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            kw["mtime_ns"] = attr.st_mtime_ns
        new = await self.aio.attr(m.SetAttr(ino=inode, **kw)) if kw else await self._attr(inode)
        if fields.update_size and not fields.update_mode and ctx.uid != 0 and _killed(new.mode) != new.mode:
            # A truncate by an unprivileged user drops setuid/setgid, as a write does. The
            # kernel leaves that to us: libfuse asks for it (FUSE_CAP_HANDLE_KILLPRIV).
            new = await self.aio.attr(m.SetAttr(ino=inode, mode=stat.S_IMODE(_killed(new.mode))))
        if state is not None:
            state.mode = new.mode
        self.dir_attrs.drop(inode)
        return self._entry(new)

    @_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return os.fsencode((await self.aio.call(m.Readlink(ino=inode))).target)

    # -- directories ----------------------------------------------------------------------
    @_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        fh = next(self._fh)
        self.dirs[fh] = DirHandle(inode)
        return fh

    @_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        d = self.dirs[fh]
        after = d.resume(start_id)
        if after is None:  # not an offset this handle gave out (a bogus seekdir): end of listing
            return
        while True:
            i = d.find(after)
            if i is None:
                await self._load_page(d, after)
                i = 0
            page = d.page
            assert page is not None
            replies = page.replies if page.replies is not None else self._replies(page, d.ino)
            age = trio.current_time() - page.fetched
            entry_timeout = max(0.0, self.config.entry_timeout - age)
            attr_timeout = max(0.0, self.config.attr_timeout - age)
            entries, base = page.entries, page.serial << OFFSET_BITS
            files, told, lookups, reply_to = self.files, self.told, self.lookups, pyfuse3.readdir_reply
            k = i
            for k in range(i, len(entries)):
                reply = replies[k]
                if reply is None:  # hidden
                    continue
                raw, attrs, seen, ino = reply
                if ino in files:  # open here: this mount's size, maybe orphaned
                    attr = entries[k].attr
                    assert attr is not None
                    if d.kept and self._told_otherwise(attr):
                        break
                    attrs = self._entry(attr, age)
                else:
                    was = told.get(ino)
                    if was != seen:
                        if was is not None and d.kept:
                            break
                        told[ino] = seen
                    attrs.entry_timeout, attrs.attr_timeout = entry_timeout, attr_timeout
                if not reply_to(token, raw, attrs, base + k + 1):
                    return  # the kernel's buffer is full: it asks again from the last offset it took
                lookups[ino] = lookups.get(ino, 0) + 1
            else:
                if not page.more or not entries:
                    return
                after = entries[-1].name
                continue
            if k > i:
                after = entries[k - 1].name
            # The kernel was told other (newer) attributes of an entry since the kept page
            # was fetched: it must not go back to older ones. Fetch afresh from here.
            self.listings.drop(d.ino)
            d.set_page(after, None)

    def _replies(self, page: Page, ino: int) -> list[Any]:
        """Build, once per page, what each entry tells the kernel: (name, attributes, the
        (size, mtime) they carry, inode), or None for an entry not shown. Served again,
        only the timeouts change."""
        replies: list[Any] = []
        entry_timeout, attr_timeout = self.config.entry_timeout, self.config.attr_timeout
        for e in page.entries:
            attr = e.attr
            if attr is None or (ino == pyfuse3.ROOT_INODE and e.name == ORPHAN_DIR):
                replies.append(None)
            else:
                replies.append((os.fsencode(e.name), _attributes(attr, attr.size, attr.nlink, entry_timeout, attr_timeout),
                                stamp_of(attr), e.ino))
        page.replies = replies
        return replies

    async def _load_page(self, d: DirHandle, after: str) -> None:
        """Give handle ``d`` the page after ``after``: a kept one (see Listings), or one
        fetched from the metadata service now (and kept)."""
        page = self.listings.get(d.ino, after)
        if page is not None:
            d.set_page(after, page, kept=True)
            return
        version, kept_version = self.dir_attrs.version, self.listings.version
        asked = trio.current_time()  # the timeouts count from the question: the answer is no older
        msg = m.Readdir(ino=d.ino, after=after, limit=READDIR_PAGE, plus=True, layouts=False)
        kl, keep = self.kernel_leases, None
        if kl is not None and kl.asking and not after:  # a listing lease: only a whole listing gets one
            token, sent = kl.token(), time.monotonic()
            reply = await self.aio.call(dataclasses.replace(msg, lease=True))
            left = kl.timeout(token, reply.lease_id, reply.lease_ms, sent, d.ino)
            if left is not None:  # kept no longer than the lease that keeps it coherent
                keep = trio.current_time() - asked + left if left > 0 else 0.0
        else:
            reply = await self.aio.call(msg)
        for e in reply.entries:  # fresh (a page kept for the handle is not: put only now)
            if e.attr is not None:
                self.dir_attrs.put(e.attr, version)
        page = Page(reply.entries, reply.more, asked)
        self.listings.put(d.ino, after, page, kept_version, keep)
        if not after and not page.more:  # every name of the directory
            self.listings.put_names(d.ino, set(page.index), asked, kept_version, keep)
        d.set_page(after, page)

    def _told_otherwise(self, attr: Attr) -> bool:
        """Were the kernel's attributes of ``attr``'s inode set to something else last
        (a later lookup or getattr, or this mount's own change)?"""
        told = self.told.get(attr.ino)
        if told is None:
            return False
        state = self.files.get(attr.ino)
        size = attr.size if state is None else max(attr.size, state.length())
        return told != stamp_of(attr, size)

    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # metadata operations commit before they answer

    @_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        asked = trio.current_time()
        try:
            attr = await self._named(parent_inode, name, self.aio.attr(
                m.Mkdir(parent=parent_inode, name=_name(name), mode=stat.S_IMODE(mode), uid=ctx.uid, gid=ctx.gid)))
        finally:
            self.dir_attrs.drop(parent_inode)  # its link count changes too
        self.listings.put_names(attr.ino, set(), asked, self.listings.version)  # new: empty
        return self._looked_up(attr)

    @_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        try:
            await self.aio.call(m.Rmdir(parent=parent_inode, name=_name(name)))
        except BaseException:
            self.listings.forget_names(parent_inode)
            raise
        else:
            self.listings.removed(parent_inode, _name(name))
        finally:
            self.dir_attrs.clear()  # the parent's link count, and the removed directory
            self.listings.clear()

    # -- names ------------------------------------------------------------------------------
    @_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            return self._looked_up(await self._named(parent_inode, name, self.aio.attr(
                m.Symlink(parent=parent_inode, name=_name(name), target=os.fsdecode(target), uid=ctx.uid, gid=ctx.gid))))
        finally:
            self.dir_attrs.drop(parent_inode)

    @_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            return self._looked_up(await self._named(new_parent_inode, new_name, self.aio.attr(
                m.Link(ino=inode, new_parent=new_parent_inode, new_name=_name(new_name)))))
        finally:
            self.dir_attrs.drop(new_parent_inode)
            self.listings.clear()  # the inode's link count shows in every listing that holds it

    @_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if not self.files:  # nothing open on this mount, nothing to keep: one round trip
            await self._unlink(parent_inode, name)
            return
        victim = await self.aio.attr(m.Lookup(parent=parent_inode, name=_name(name)))
        linked = await self.orphans.keep_if_open(self.files.get(victim.ino), victim)
        try:
            await self._unlink(parent_inode, name)
        except BaseException:
            await self.orphans.unkeep(self.files.get(victim.ino), linked)
            raise

    async def _unlink(self, parent_inode: int, name: bytes) -> None:
        try:
            gone = await self.aio.attr(m.Unlink(parent=parent_inode, name=_name(name)))
        except BaseException:
            self.dir_attrs.drop(parent_inode)  # a reply lost after the unlink happened
            self.listings.forget_names(parent_inode)
            raise
        else:
            self.listings.removed(parent_inode, _name(name))
        finally:
            self.listings.drop(parent_inode)
        self.dir_attrs.touched(parent_inode, gone.ctime_ns)  # the service stamps the parent with the victim's ctime
        if gone.nlink:  # other names of it remain, in listings that show its old link count
            self.listings.clear()

    @_errors
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        linked = False
        victim: Attr | None = None
        if not flags:  # a plain rename may drop the target: keep it if it is open here
            try:
                victim = await self.aio.attr(m.Lookup(parent=parent_inode_new, name=_name(name_new)))
            except FileNotFoundError:
                victim = None
            if victim is not None:
                linked = await self.orphans.keep_if_open(self.files.get(victim.ino), victim)
        try:
            await self.aio.call(m.Rename(parent=parent_inode_old, name=_name(name_old), new_parent=parent_inode_new,
                                         new_name=_name(name_new), flags=flags))
        except BaseException:
            if victim is not None:
                await self.orphans.unkeep(self.files.get(victim.ino), linked)
            raise
        else:
            if self.kernel_leases is not None and self.kernel_leases.renamed(parent_inode_old, name_old):
                # The kernel keeps the entry, moved to its new name, for the old lease's time:
                # take it back once this reply is out (invalidating it from inside the rename
                # would wait for the rename itself).
                pyfuse3.invalidate_entry_async(parent_inode_new, name_new, ignore_enoent=True)
        finally:
            self.dir_attrs.clear()  # both parents, and a directory moved (its ".." and ctime)
            self.listings.clear()
            self.listings.forget_names(parent_inode_old)
            self.listings.forget_names(parent_inode_new)

    async def clean_orphans(self) -> int:
        """Remove orphans that dead daemons of this host left behind (:meth:`Orphans.clean`).
        Returns how many."""
        return await self.orphans.clean()

    # -- files ------------------------------------------------------------------------------
    async def _open_state(self, attr: Attr, flags: int, uid: int, file: Any = None) -> pyfuse3.FileInfo:
        """A new handle of ``attr``'s inode, opened with ``flags`` by user ``uid`` (``file``:
        the file object a new state starts with, else one on ``attr``)."""
        if not attr.is_file:
            raise pyfuse3.FUSEError(errno.EISDIR if attr.is_dir else errno.EINVAL)
        ino = attr.ino
        state = self.files.get(ino)
        shared = state is not None
        if state is None:
            state = self.files[ino] = OpenFile(self.client, file or self.client.open_inode(attr, readable=True,
                                                                                           writable=True))
        # Counted before any await: a release of the other handles meanwhile must not close it.
        state.handles += 1
        fh = next(self._fh)
        self.handles[fh] = ino
        if shared:
            # Close-to-open holds between handles of this mount too (`less f` keeps f open
            # while another node rewrites it; `cat f` must show the new bytes): this mount's
            # own writes are committed first, then fresh attributes say whether the file
            # changed since the state started; if so the state starts over from them.
            try:
                attr = await self._locked(state, state.revalidate) or attr
            except BaseException:
                await self.release(fh)
                raise
        stamp: Stamp | None = stamp_of(attr)
        if uid != 0:
            self.unprivileged.add(fh)
        if flags & os.O_TRUNC and (attr.size or state.length()):
            try:
                await self._locked(state, state.truncate, 0)
            finally:
                self.listings.clear()  # listings that show the file show its old size
            stamp = None
            if uid != 0:
                await self._kill_privs(state, ino)
        # The kernel's pages are kept only when they are of this very version (stamp_of).
        keep = stamp is not None and self.cached.get(ino) == stamp
        (PAGE_CACHE_KEPT if keep else PAGE_CACHE_DROPPED).inc()
        if not keep and self.told.get(ino) not in (None, stamp):
            # The kernel holds attributes (size) older than the file: drop them now.
            await trio.to_thread.run_sync(_invalidate, ino)
        self.cached[ino] = stamp  # type: ignore[assignment]
        direct = self.config.direct_io
        if flags & os.O_APPEND:
            # The kernel would place each append at its cached size (stale within
            # attr_timeout) and copy it into its page cache there; in direct_io mode the
            # daemon places it at the committed length instead (OpenFile.append).
            self.appenders.add(fh)
            direct = True
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=keep)

    async def _wait_closing(self, ino: int) -> None:
        ev = self.closing.get(ino)
        if ev is not None:
            await ev.wait()

    @_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        await self._wait_closing(inode)
        fi = await self._open_state(await self._open_attr(inode, flags), flags, ctx.uid)
        state = self.files.get(inode)
        if (state is not None and not (fi.keep_cache or fi.direct_io)
                and _reads_only(flags)):
            self._read_ahead(state)  # the kernel dropped the file's pages: its READ follows
        return fi

    def _read_ahead(self, state: OpenFile) -> None:
        """Send a small file's whole read now, at its read-only OPEN, from the loop; the
        first READ takes it (``_take_ahead``). The storage server answers while the reader
        gets its descriptor back and asks to read. The request goes on the loop's own
        connection to the server (``_loopreads``: the answer is received by a task of the
        loop, no thread), or, until that one is connected, on the client's (the answer
        lands on its reader thread with nobody waiting).

        Only a state opened just now (one handle) that nothing was read from or written
        through, of at most ``SMALL_FILE`` bytes in one chunk on an open connection."""
        if (state.handles != 1 or state.whole is not None or state.ahead is not None or state.written
                or state.read_from or state.dirty or state.lock.locked()):
            return
        f = state.file
        length = state.length()
        if not 0 < length <= SMALL_FILE:
            return
        buf = self._wbufs.pop() if self._wbufs else mmap.mmap(-1, SMALL_FILE)
        dest = memoryview(buf)[:length]
        core = self.client._core
        plan = core.plan_read(f.ino, f.layout, length, 0, dest)
        started: tuple[Any, Any] | None = None
        read: LoopRead | None = None
        if plan is not None:
            read = self.loop_reads.start(plan)  # on the loop's own connection (_loopreads)
            started = (read, plan.finish) if read is not None else core.submit_planned(plan)
        if started is None:  # more than one request (several chunks, a connection to open)
            if len(self._wbufs) < 64:
                self._wbufs.append(buf)
            return
        (WHOLE_READS_LOOP if read is not None else WHOLE_READS_CLIENT).inc()
        state.whole_buf = buf  # a fresh state has none yet
        state.ahead = (started[0], started[1], f, dest)

    async def _take_ahead(self, state: OpenFile) -> memoryview | None:
        """The whole file from the read sent at OPEN (``state.whole`` once taken), or None
        when it cannot serve: it failed, or the state was written or started over meanwhile."""
        ahead = state.ahead
        assert ahead is not None
        fut, finish, f, dest = ahead
        try:
            if isinstance(fut, LoopRead):
                await fut.wait(REQUEST_TIMEOUT)
            elif not fut.done():  # else: answered already, nothing to wait for
                await _result(fut, REQUEST_TIMEOUT)
            n = finish(fut.result())
        except BaseException as exc:
            # Failed (or cancelled while in flight): a failed request's answer may still be
            # landing, so its buffer is left to it; the plain path reads the file again
            # into another, with the client's retries, and reports what stays wrong.
            if state.ahead is ahead:
                state.ahead = state.whole_buf = None
            if isinstance(exc, (StripefsError, OSError)):
                WHOLE_READS_REREAD.inc()
                return None
            raise
        if state.ahead is not ahead:  # another READ took it meanwhile
            return state.whole if state.file is f else None
        state.ahead = None
        if state.dirty or state.written or state.file is not f:
            return None
        state.whole = dest[:n]
        return state.whole

    @_errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        if self.new_files.may_defer(parent_inode, name, flags):  # the name is made at fsync/close
            res = await self.new_files.reservation(parent_inode)
            if res is not None:
                return await self._create_new(parent_inode, name, mode, flags, ctx, res)
        # A new name, or an existing file opened (maybe truncated): the parent's pages go.
        reply = await self._named(parent_inode, name, self.aio.call(
            m.Create(parent=parent_inode, name=_name(name), mode=stat.S_IMODE(mode), uid=ctx.uid, gid=ctx.gid,
                     exclusive=bool(flags & os.O_EXCL), truncate=bool(flags & os.O_TRUNC))))
        attr = reply.attr
        if not reply.created and flags & os.O_TRUNC:
            self.listings.clear()  # a truncated file may have other names, in other listings
        if reply.created:  # the parent is stamped with the new inode's time
            self.dir_attrs.touched(parent_inode, attr.ctime_ns)
            # A new inode has no extended attributes: the security.capability the kernel
            # asks for before the first write is known absent (as stale as any "absent").
            self._absent_xattr(attr.ino, b"security.capability")
        await self._wait_closing(attr.ino)
        fi = await self._open_state(attr, flags & ~os.O_TRUNC, ctx.uid)
        return fi, self._looked_up(attr)

    async def _create_new(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext,
                          res: Reservation) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        """CREATE of a name just found absent, answered with a reserved inode (``_newfiles``)."""
        file = self.new_files.new_file(parent_inode, name, mode, ctx.uid, ctx.gid, res)
        attr = file.attr
        self.listings.added(parent_inode, _name(name))
        self.listings.drop(parent_inode)
        # The directory as this mount knows it shows the create now (this clock), and the
        # service's stamp once the name is made (_sync).
        self.dir_attrs.touched(parent_inode, attr.ctime_ns)
        self._absent_xattr(attr.ino, b"security.capability")
        fi = await self._open_state(attr, flags & ~os.O_TRUNC, ctx.uid, file=file)
        return fi, self._looked_up(attr)

    @_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        # The node is stored; the kernel gives fifos, sockets and devices their behaviour.
        try:
            reply = await self._named(parent_inode, name, self.aio.call(
                m.Mknod(parent=parent_inode, name=_name(name), mode=mode, rdev=rdev, uid=ctx.uid, gid=ctx.gid)))
        finally:
            self.dir_attrs.drop(parent_inode)
        return self._looked_up(reply.attr)

    def _state(self, fh: int) -> OpenFile:
        try:
            return self.files[self.handles[fh]]
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None

    @_errors
    async def read(self, fh: int, off: int, size: int) -> memoryview:
        state = self._state(fh)
        if state.file.pending:  # a new file read back through its handle: its name first, off the loop
            await self._sync(state, fh)
        if state.ahead is not None:  # the whole file, asked for at OPEN
            whole = await self._take_ahead(state)
            if whole is not None:
                return whole[off : off + size]
        if not state.dirty and not state.lock.locked():
            if state.whole is not None:  # a small file read whole at its first read
                return state.whole[off : off + size]
            view = state.read_cached(off, size)  # already in a readahead window: no thread hop
            if view is not None:
                return view
            if off == 0 and not state.written and state.length() <= SMALL_FILE:
                return (await self._read_whole(state))[:size]
        if state.dirty or off in (0, state.seq_end) or state.file.in_window(off):
            # Buffered writes must land first. Sequential reads use StripeFile's readahead
            # windows: one parallel fetch of a whole window (all servers at once, refilled in
            # the background) serves many kernel requests from memory, instead of one
            # round trip per 1 MiB request.
            return await self._locked(state, state.read, off, size)
        # Page-cache mode: the kernel's readahead sends many requests at once; serve
        # them in parallel, each straight into a reused page-aligned buffer.
        buf = self._rbufs.pop() if self._rbufs and len(self._rbufs[-1]) >= size else mmap.mmap(-1, max(size, 1 << 20))
        lent = []
        try:
            state.read_from = True
            f = state.file
            dest = memoryview(buf)[:size]
            # One chunk's range on the loop's connection (no thread), else the client's way.
            n = await self._loop_read(f, state.length(), off, dest, lambda: lent.append(True))
            if n is None:
                n = await self.aio.read_into(f.ino, f.layout, state.length(), off, dest)
        finally:
            # Safe to reuse at once: pyfuse3 replies from the view before any other task runs,
            # and nothing lands in it any more (unless a read on the loop was cancelled in flight).
            if len(self._rbufs) < 64 and not lent:
                self._rbufs.append(buf)
        return memoryview(buf)[:n]

    async def _loop_read(self, f: Any, file_size: int, off: int, dest: memoryview, lend: Callable[[], None],
                         whole: bool = False) -> int | None:
        """``dest``'s bytes at ``off`` of ``f`` over the loop's connection (``_loopreads``)
        when one request answers them: the bytes read, or None when it cannot or it failed
        (the caller reads the plain way; nothing lands in ``dest`` later). Cancelled in
        flight, it calls ``lend()`` first: the answer may land in ``dest`` yet, so its
        buffer must not be lent to anyone else. ``whole``: a small file read whole (counted)."""
        plan = self.client._core.plan_read(f.ino, f.layout, file_size, off, dest)
        read = self.loop_reads.start(plan) if plan is not None else None
        if read is None:
            if whole:
                WHOLE_READS_CLIENT.inc()
            return None
        assert plan is not None
        if whole:
            WHOLE_READS_LOOP.inc()
        try:
            await read.wait(REQUEST_TIMEOUT)
            return plan.finish(read.result())
        except (StripefsError, OSError):
            if whole:
                WHOLE_READS_REREAD.inc()
            return None  # nothing of it lands later: an error answer has no bytes, a timeout closed it
        except BaseException:
            lend()
            raise

    async def _read_whole(self, state: OpenFile) -> memoryview:
        """Read a small file whole, on the loop (one request to one server when it is one
        chunk, and no worker thread), into the state's buffer; the kernel's next reads of
        it are answered from there. Not through ``StripeFile``: nothing of it (readahead,
        buffers) needs closing, so the release runs on the loop too."""
        f = state.file
        length = state.length()
        if state.whole_buf is None or len(state.whole_buf) < length:
            # Apart from OpenFile.read's buffer: the kernel sends a file's reads at once,
            # and one of them may be read into that one meanwhile.
            state.whole_buf = self._wbufs.pop() if self._wbufs else mmap.mmap(-1, SMALL_FILE)
        dest = memoryview(state.whole_buf)[:length]
        def lend() -> None:
            state.whole_buf = None

        n = await self._loop_read(f, length, 0, dest, lend, whole=True)
        if n is None:  # not on the loop's connection: the client's, with its retries
            n = await self.aio.read_into(f.ino, f.layout, length, 0, dest)
        if state.dirty or state.written or state.file is not f:  # changed while we read
            return dest[:n]
        state.whole = dest[:n]
        return state.whole

    @_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        state = self._state(fh)
        if fh in self.unprivileged and _killed(state.mode) != state.mode:
            await self._kill_privs(state, self.handles[fh])
        if fh in self.appenders:  # O_APPEND: the kernel's offset is its (maybe stale) cached size
            n, at = await self._locked(state, state.append, buf)
            if at != off:  # the kernel's size is off by what other clients appended: refresh it
                await trio.to_thread.run_sync(_invalidate, self.handles[fh])
            return n
        n = await self.writes.write_on_loop(state, off, buf)
        if n is not None:
            return n
        return await self._locked(state, state.write, off, buf)

    async def _kill_privs(self, state: OpenFile, ino: int) -> None:
        """Drop setuid (and setgid, when group-executable) after an unprivileged write or truncate.

        Linux does this on every write by a user without CAP_FSETID; under
        FUSE_CAP_HANDLE_KILLPRIV (libfuse's default) the kernel leaves it to the file
        system, and in direct_io mode it does not do it at all. The writer is known by
        the uid that opened the handle (FUSE writes carry no caller).
        """
        if _killed(state.mode) == state.mode:
            return
        try:
            attr = await self.aio.attr(m.SetAttr(ino=ino, mode=stat.S_IMODE(_killed(state.mode))))
        finally:
            self.listings.clear()
        state.mode = attr.mode
        await trio.to_thread.run_sync(_invalidate, ino)  # the kernel's cached mode still shows the bits

    @_errors
    async def flush(self, fh: int) -> None:
        if self.config.read_only:
            # Nothing was written through a read-only mount: ENOSYS tells the kernel that
            # this file system needs no FLUSH, and it sends none for the rest of the mount
            # (one request fewer per file a dataloader opens).
            raise pyfuse3.FUSEError(errno.ENOSYS)
        state = self._state(fh)
        if state.settled:
            return  # nothing to send or commit (the close after an fsync): no thread hop
        await self._sync(state, fh)

    @_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        state = self._state(fh)
        if state.settled:
            return
        await self._sync(state, fh)

    async def _sync(self, state: OpenFile, fh: int) -> None:
        try:
            await self._locked(state, state.sync)
        finally:
            self.listings.clear()  # the committed length and mtime: listings holding the file show the old ones
        made = await self.new_files.made(self.handles.get(fh), state.file)
        if made is not None:  # a new file's name was made: its directory is stamped with the commit's time
            parent, ours = made
            if ours:
                self.dir_attrs.touched(parent, state.file.attr.ctime_ns)
            else:
                self.dir_attrs.drop(parent)

    async def release(self, fh: int) -> None:
        ino = self.handles.pop(fh, None)
        self.appenders.discard(fh)
        self.unprivileged.discard(fh)
        state = self.files.get(ino) if ino is not None else None
        if ino is None or state is None:
            return
        state.handles -= 1
        if state.handles > 0:
            return
        del self.files[ino]
        done = self.closing[ino] = trio.Event()
        try:
            if state.closes_at_once:  # `touch`, a stat-like open, the close after an fsync
                state.close()
            else:
                await self._locked(state, state.close)
            if state.orphan is not None:
                await self.orphans.remove(state.orphan)
                self.cached.pop(ino, None)
            elif state.written:  # the version the kernel's pages are of now
                self.listings.clear()  # closing committed the length
                # The service's answer to the last commit (or truncate), when nothing was
                # written after it, is that version; else ask (one round trip).
                attr = state.file.committed or await self._attr(ino)
                self.cached[ino] = stamp_of(attr)
            # Never written here: the pages are of the version recorded at the last
            # open, and a change made elsewhere since must not be taken for theirs.
        except Exception:  # release cannot report errors; flush already did
            log.exception("release of inode %d", ino)
            self.cached.pop(ino, None)
        finally:
            self.new_files.released(ino)
            ahead, state.ahead = state.ahead, None
            if ahead is not None and not (ahead[0].done() and ahead[0].exception() is None):
                # A read sent at OPEN that no READ took, in flight or failed: its answer may
                # land in the buffer yet, so the buffer is left to it (never lent again).
                state.whole_buf = None
            if state.whole_buf is not None:  # its reads are over: the buffer goes back to the pool
                if len(self._wbufs) < 64:
                    self._wbufs.append(state.whole_buf)
                state.whole = state.whole_buf = None
            del self.closing[ino]
            done.set()

    async def drain(self) -> int:
        """Commit every file still open in this mount; the daemon calls it before it exits.

        Each open state is closed (write-behind buffers sent, length committed), and the
        hidden names of open-but-unlinked files are removed: once the daemon is gone no
        handle can reach them. Errors are logged, not raised: every file gets its turn.
        Returns how many open files there were.
        """
        states = list(self.files.items())
        self.files.clear()
        self.handles.clear()
        self.appenders.clear()
        self.unprivileged.clear()
        for ino, state in states:
            try:
                await self._locked(state, state.close)
            except Exception:
                log.exception("drain: committing inode %d failed; its unwritten bytes are lost", ino)
            if state.orphan is not None:
                try:
                    await self.orphans.remove(state.orphan)
                except Exception:
                    log.exception("drain: removing orphan %s failed", state.orphan)
        return len(states)

    # -- file system ----------------------------------------------------------------------
    @_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = await self.aio.call(m.Statfs())  # already usable bytes (raw / replicas), see metadata
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLKSIZE
        s.f_frsize = 4096
        s.f_blocks = st.capacity // s.f_frsize
        s.f_bfree = s.f_bavail = st.free // s.f_frsize
        s.f_files = st.files + (1 << 32)
        s.f_ffree = s.f_favail = 1 << 32  # inodes are rows in the metadata store: no fixed table
        s.f_namemax = 255
        return s

    # -- extended attributes: stored by the metadata service. The kernel checks the
    # namespace rules (trusted.* needs CAP_SYS_ADMIN, user.* only on files and
    # directories, write permission for setting) before it asks us; pyfuse3 turns
    # XATTR_CREATE/XATTR_REPLACE into a getxattr first.
    @_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._no_xattr.pop((inode, name), None)
        try:
            await self.aio.call(m.SetXattr(ino=inode, name=name, value=value))
        finally:
            self.dir_attrs.drop(inode)  # its ctime changes
            self.listings.clear()

    @_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        key = (inode, name)
        if self._no_xattr.get(key, 0.0) > trio.current_time():
            raise pyfuse3.FUSEError(errno.ENODATA)
        try:
            return (await self.aio.call(m.GetXattr(ino=inode, name=name))).value
        except OSError as exc:
            if exc.errno == errno.ENODATA:
                self._absent_xattr(inode, name)
            raise

    def _absent_xattr(self, inode: int, name: bytes) -> None:
        """Remember for ``attr_timeout`` that ``inode`` has no attribute ``name``."""
        if len(self._no_xattr) > 100_000:  # bounded: forget everything rather than grow
            self._no_xattr.clear()
        self._no_xattr[(inode, name)] = trio.current_time() + self.config.attr_timeout

    @_errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return list((await self.aio.call(m.ListXattr(ino=inode))).names)

    @_errors
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._no_xattr.pop((inode, name), None)
        try:
            await self.aio.call(m.RemoveXattr(ino=inode, name=name))
        finally:
            self.dir_attrs.drop(inode)
            self.listings.clear()


def _attributes(attr: Attr, size: int, nlink: int, entry_timeout: float, attr_timeout: float) -> pyfuse3.EntryAttributes:
    """What the kernel is told of ``attr`` (``size`` and ``nlink`` as this mount sees them)."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = attr.ino
    e.generation = 0
    e.entry_timeout = entry_timeout
    e.attr_timeout = attr_timeout
    e.st_mode = attr.mode
    e.st_nlink = nlink
    e.st_uid, e.st_gid, e.st_rdev = attr.uid, attr.gid, attr.rdev
    e.st_size = size
    e.st_blksize = BLKSIZE
    e.st_blocks = (size + 511) // 512
    e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = attr.atime_ns, attr.mtime_ns, attr.ctime_ns
    return e


def _killed(mode: int) -> int:
    """``mode`` after an unprivileged write: no setuid; no setgid if group-executable
    (setgid without group execute marks mandatory locking and stays, as on Linux)."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode


def _invalidate(ino: int) -> None:
    try:
        pyfuse3.invalidate_inode(ino, attr_only=True)
    except OSError:  # the kernel forgot the inode meanwhile: nothing to drop
        pass
