"""Files opened as new whose name is made at their first ``fsync``/``close``.

``open(path, "wb")`` of a name the client does not know costs, on the plain path, a
create (a metadata commit) before the first byte and a length commit (another) after
the last: two requests and two log syncs in series for a small durable file. Here the
file is written first, under an inode number reserved ahead (``_wholefiles``' pool:
one ``ReserveFiles`` per many files), and its first ``fsync``/``close`` makes the name
with its length in one ``CommitFiles``, the create's request and its log sync gone.

The rules kept:

* **no length over bytes that are not durable**: the commit is sent after every write
  of the file was acknowledged (as the plain path's length commit);
* **what a process made is visible to it at once**: any other metadata request of the
  same client, and any lookup it answers from a leased cache, first makes every
  pending name (:meth:`PendingCreates.settle`): an empty file, as after ``open``;
* **a name that exists is written in place**: ``CommitFiles`` never puts a new inode
  under an old name (caches mapping the name to its inode would go stale); when the
  name turns out to exist, that file is opened with truncate (``CreatePath``, as the
  plain path) and the bytes written so far move to it (at most ``DEFER_BYTES``: a file
  that grows past it makes its name first, before its bytes leave the buffer);
* **a reservation never expires under an open file**: a file pending ``DEFER_AGE``
  seconds is made by a timer thread (reservations live for minutes).

Other clients see the file at its ``fsync``/``close`` (close-to-open; they saw its
length there before, and now its name too). What changes for the writer: an error
about the parent directory (removed meanwhile, a directory at the name) comes at
``fsync``/``close`` instead of at ``open``. ``STRIPEFS_DEFER_CREATE=0`` turns this off.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from typing import Any, Callable, Protocol

from stripefs.wire import Attr, ErrorCode, Message, StripefsError, messages as m

from ._wholefiles import Reservation

__all__ = ["DEFER", "DEFER_AGE", "DEFER_BYTES", "PendingCreate", "PendingCreates"]

DEFER = os.environ.get("STRIPEFS_DEFER_CREATE", "1") != "0"
DEFER_AGE = 10.0  # seconds a name stays pending at most (reservations live 300 s)
DEFER_BYTES = 1 << 20  # a pending file growing past this makes its name first
_making = threading.local()  # .on: this thread is making a name (its requests settle nothing)


class Caller(Protocol):
    def call(self, msg: Message[Any], *, timeout: float = 60.0) -> Any: ...


class PendingCreate:
    """One file opened as new whose name is not made yet (module docstring)."""

    __slots__ = ("table", "path", "parent_ino", "res", "mode", "uid", "gid", "lock", "born", "made", "dropped")

    def __init__(self, table: "PendingCreates", path: str, res: Reservation, mode: int, uid: int, gid: int,
                 parent_ino: int = 0) -> None:
        # ``path``: the file's path; with ``parent_ino`` (a mount's files), its name in that directory.
        self.table, self.path, self.res, self.mode, self.uid, self.gid = table, path, res, mode, uid, gid
        self.parent_ino = parent_ino
        self.lock = threading.Lock()
        self.born = time.monotonic()
        self.made: Attr | None = None  # the name's attributes once made (another inode: it existed)
        self.dropped = False  # its owner closed it without making it (its writes failed): never made

    def attr(self) -> Attr:
        """The attributes the file object starts with (what the commit will make)."""
        now = time.time_ns()
        return Attr(self.res.ino, stat.S_IFREG | self.mode, 1, self.uid, self.gid, 0, now, now, now, self.res.layout)

    def make(self, length: int, mtime_ns: int = 0) -> Attr:
        """Make the name (the caller holds :attr:`lock`; once): the reserved inode with
        ``length`` bytes, or, when the name exists, that file truncated (its attributes,
        another inode: the caller moves the bytes). Sets and returns :attr:`made`.

        Raises:
            StripefsError: the commit's error for this path (ENOENT/ENOTDIR for the
                parent, EISDIR, EACCES...); EIO when the reservation expired (the bytes
                written under it were dropped: they cannot be committed any more).
        """
        assert self.made is None
        _making.on = True
        try:
            return self._make(length, mtime_ns)
        finally:
            _making.on = False

    def _make(self, length: int, mtime_ns: int) -> Attr:
        client = self.table.client
        reply = client.call(m.CommitFiles(paths=[self.path], inos=[self.res.ino], ids=[self.res.id], lengths=[length],
                                          mode=self.mode, uid=self.uid, gid=self.gid, mtime_ns=mtime_ns,
                                          parent_ino=self.parent_ino))
        (got,) = reply.per_item([self.path], "CommitFiles")
        if not isinstance(got, StripefsError):
            self.made = got
            return got
        code = got.code
        if code == ErrorCode.STALE_FILE:
            raise StripefsError(ErrorCode.IO, "the file's reserved inode expired before it was committed: "
                                              "its bytes are lost", self.path)
        if code != ErrorCode.EXISTS:
            raise StripefsError(code, "cannot create the file", self.path)
        if self.parent_ino:
            self.made = client.call(m.Create(parent=self.parent_ino, name=self.path, mode=self.mode, uid=self.uid,
                                             gid=self.gid, exclusive=False, truncate=True)).attr
        else:
            self.made = client.call(m.CreatePath(path=self.path, mode=self.mode, uid=self.uid, gid=self.gid,
                                                 exclusive=False, truncate=True)).attr
        if not self.made.is_file:
            raise StripefsError(ErrorCode.IS_DIR if self.made.is_dir else ErrorCode.INVALID,
                                "not a regular file", self.path)
        return self.made


class PendingCreates:
    """The pending names of one client core: made before any other request observes the
    namespace (:meth:`settle`), or by a timer after ``DEFER_AGE``."""

    # Requests that cannot observe a pending name: the pool's reservations, the commits,
    # and what the data path asks on its own (a pending file's first write fetches routing).
    QUIET = (m.ReserveFiles, m.CommitFiles, m.GetRouting, m.ClusterStatus, m.Statfs)

    def __init__(self, client: Caller) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._files: dict[int, PendingCreate] = {}
        self._timer: threading.Thread | None = None

    def __bool__(self) -> bool:
        return bool(self._files)

    def new(self, path: str, res: Reservation, mode: int, uid: int, gid: int, parent_ino: int = 0) -> PendingCreate:
        """A pending file for ``path`` (or name ``path`` in directory ``parent_ino``) under
        reservation ``res``, in the table."""
        p = PendingCreate(self, path, res, mode, uid, gid, parent_ino)
        with self._lock:
            self._files[id(p)] = p
            if self._timer is None:
                self._timer = threading.Thread(target=self._age_out, daemon=True, name="stripefs-pending")
                self._timer.start()
        return p

    def drop(self, p: PendingCreate) -> None:
        """``p``'s owner closed it without making it: no name is made for it, ever."""
        with p.lock:
            p.dropped = True
        self.done(p)

    def done(self, p: PendingCreate) -> None:
        """``p`` leaves the table: made, or given up by its owner (closed after a failure)."""
        with self._lock:
            self._files.pop(id(p), None)

    def settle(self, older_than: float | None = None) -> None:
        """Make every pending name (or those older than ``older_than`` seconds) as an
        empty file, and return once each is made, by this thread or by whoever was making
        it; their owners move on from there. An error is left to the owner (its
        ``fsync``/``close`` makes the name again and reports it). Nothing while this
        thread is making a name itself (its own requests would wait for it)."""
        now = time.monotonic()
        self._settle(lambda p: older_than is None or now - p.born >= older_than)

    def settle_for(self, msg: Message[Any]) -> None:
        """:meth:`settle` the names that ``msg`` could observe (:meth:`_observed_by`)."""
        want = self._observed_by(msg)
        if want is not None:
            self._settle(want)

    def due(self, msg: Message[Any]) -> bool:
        """Would :meth:`settle_for` ``msg`` make a name (cheap: the caller avoids a thread hop)?"""
        if not self._files:
            return False
        want = self._observed_by(msg)
        if want is None:
            return False
        with self._lock:
            return any(want(p) for p in self._files.values())

    @staticmethod
    def _observed_by(msg: Message[Any]) -> Callable[[PendingCreate], bool] | None:
        """Which pending names ``msg`` could observe (None: none). A mount's ``Lookup`` of
        one name observes that name only, its ``GetAttr`` of an inode that inode (and, for a
        directory, the names made in it: its times and link count), a ``Readdir`` without
        attributes the names made in that directory; any other request (a
        listing, a rename, a removal...) observes them all. Names known by path (the native
        client's) are observed by every request: their directory inode is not known here."""
        if isinstance(msg, PendingCreates.QUIET):
            return None
        if isinstance(msg, m.Lookup):
            return lambda p: not p.parent_ino or (p.parent_ino, p.path) == (msg.parent, msg.name)
        if isinstance(msg, m.GetAttr):
            return lambda p: not p.parent_ino or msg.ino in (p.parent_ino, p.res.ino)
        if isinstance(msg, m.Readdir) and not msg.plus:  # names only: those of that directory
            return lambda p: not p.parent_ino or p.parent_ino == msg.ino
        return lambda p: True

    def _settle(self, want: Callable[[PendingCreate], bool]) -> None:
        if getattr(_making, "on", False):
            return
        with self._lock:
            due = [p for p in self._files.values() if want(p)]
        for p in due:
            with p.lock:
                if p.made is None and not p.dropped:
                    try:
                        p.make(0)
                    except StripefsError:
                        pass
            self.done(p)

    def _age_out(self) -> None:
        while True:
            time.sleep(DEFER_AGE / 4)
            self.settle(older_than=DEFER_AGE)
            with self._lock:
                if not self._files:
                    self._timer = None
                    return
