"""Whole files in two steps: the bytes first, then one metadata transaction.

A file written through ``open``/``write``/``close`` costs three requests in series: the
create (a metadata commit), the chunk writes, the length commit (another metadata
commit). When the caller hands over a whole file at once (``write_bytes``,
``write_files``, fsspec ``pipe``, ``stripefs put -r``), the client can do better:

1. **reserve** inode numbers with their layouts (``ReserveFiles``: one request for up to
   200, or none when the client's pool for that directory has some left);
2. **write** each file's chunks under its reserved number, in parallel, durably;
3. **commit** the files (``CommitFiles``): name, inode and length in one transaction per
   200 files, so each new file appears whole or not at all.

The rule of the write path holds: no length is committed over bytes that are not on the
storage servers (the commit is sent only after every chunk write was acknowledged). A
reservation nobody commits (the client died) is garbage: the metadata service drops its
chunks after ``RESERVE_GRACE`` and never hands its number out again. A name that exists
already is not replaced by a new inode (every cache that maps the name to its inode, a
mount's dentries first, would go stale): that file is written in place instead, as
``open(path, "wb")`` does (truncate, write, commit at close), and its reservation expires.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import posixpath
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Protocol, Sequence

from stripefs.wire import Attr, ErrorCode, Layout, Message, StripefsError, messages as m


class Client(Protocol):
    """What this module uses of :class:`~fsclient.core._client.Client` (which imports it)."""

    def call(self, msg: Message[Any], *, timeout: float = 60.0) -> Any: ...

    def submit_write(self, ino: int, layout: Layout, offset: int, data: memoryview) -> "Future[None]": ...

    def open(self, path: str, mode: str = "rb", *, defer: bool = True) -> Any: ...

__all__ = ["Reservation", "Reservations", "reserve", "write_files"]

BATCH = 200  # files per ReserveFiles / CommitFiles (the service's limit)
POOL_MAX = 64  # reservations a client keeps ahead per directory, at most
POOL_AGE = 60.0  # seconds a pooled reservation is used; older ones are left to expire
IN_FLIGHT = 256 << 20  # bytes of file data being written at once by one write_files call


class Reservation:
    __slots__ = ("ino", "id", "layout", "taken")

    def __init__(self, ino: int, rid: int, layout: Layout, taken: float) -> None:
        self.ino, self.id, self.layout, self.taken = ino, rid, layout, taken


class Reservations:
    """Inode numbers reserved ahead, per directory, for files written one at a time
    (``write_bytes``): a pool that grows while it is used (4, 8, ... ``POOL_MAX``), so a
    client writing many small files pays one ``ReserveFiles`` per many files."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str | int, collections.deque[Reservation]] = {}
        self._sizes: dict[str | int, int] = {}

    def take(self, client: Client, parent: str | int) -> Reservation:
        """One reservation for a file in ``parent`` (a path, or a directory inode), from the
        pool when it has a fresh one."""
        got = self.take_now(parent)
        if got is not None:
            return got
        fresh = reserve(client, parent, self.refill_size(parent))
        self.add(parent, fresh[1:])
        return fresh[0]

    def take_now(self, parent: str | int) -> Reservation | None:
        """A fresh reservation from ``parent``'s pool, or None (it must be refilled)."""
        now = time.monotonic()
        with self._lock:
            pool = self._pools.setdefault(parent, collections.deque())
            while pool and now - pool[0].taken > POOL_AGE:
                pool.popleft()  # left to expire: the service collects it
            return pool.popleft() if pool else None

    def refill_size(self, parent: str | int) -> int:
        """How many to reserve for ``parent``'s next refill (it grows while it is used)."""
        with self._lock:
            size = self._sizes[parent] = min(POOL_MAX, max(4, 2 * self._sizes.get(parent, 2)))
            return size

    def add(self, parent: str | int, fresh: Sequence[Reservation]) -> None:
        """Put fresh reservations of ``parent`` into its pool."""
        with self._lock:
            self._pools.setdefault(parent, collections.deque()).extend(fresh)

    def forget(self, path: str) -> None:
        """Drop the pools of directory ``path`` and of every directory below it (this
        client removed or moved it: a name made from such a pool would fail at its
        commit, where ``open`` must fail at once; the reservations are left to expire)."""
        below = path.rstrip("/") + "/"
        with self._lock:
            for key in [k for k in self._pools if k == path or isinstance(k, str) and k.startswith(below)]:
                del self._pools[key]


def reserve(client: Client, parent: str | int, count: int) -> list[Reservation]:
    """``count`` fresh reservations in ``parent`` (a path or a directory inode; one
    request per ``BATCH``)."""
    out: list[Reservation] = []
    while len(out) < count:
        n = min(BATCH, count - len(out))
        out.extend(reservations(client.call(reserve_request(parent, n)), n))
    return out


def reserve_request(parent: str | int, count: int) -> m.ReserveFiles:
    """The ``ReserveFiles`` of ``count`` files in ``parent`` (a path or a directory inode)."""
    if isinstance(parent, int):
        return m.ReserveFiles(parent="", count=count, parent_ino=parent)
    return m.ReserveFiles(parent=parent, count=count)


def reservations(reply: m.ReserveFilesReply, count: int) -> list[Reservation]:
    """The reservations a ``ReserveFiles`` of ``count`` answered, checked."""
    if not len(reply.inos) == len(reply.ids) == len(reply.chunk_sizes) == len(reply.chains) == count:
        raise StripefsError(ErrorCode.PROTOCOL, "ReserveFiles: answer does not match the count asked")
    now = time.monotonic()
    return [Reservation(ino, rid, Layout(cs, tuple(chains)).validate(), now)
            for ino, rid, cs, chains in zip(reply.inos, reply.ids, reply.chunk_sizes, reply.chains)]


def write_files(client: Client, files: Sequence[tuple[str, "bytes | bytearray | memoryview"]], *,
                mode: int, exclusive: bool, mtime_ns: int = 0, pool: Reservations | None = None,
                known: Callable[[str], bool] | None = None) -> list[Attr | StripefsError]:
    """Write whole files: reserve, write every file's chunks, commit (module docstring).

    Args:
        files: ``(normalized path, bytes)`` pairs; each path at most once.
        mode: permission bits, umask already applied.
        pool: take reservations from it (one file at a time) instead of reserving them.
        known: says a path is an existing file (the client's cache; a hint: a wrong one
            costs the usual path). Those are written in place at once, without spending a
            reservation and a refused commit on them (not with ``exclusive``).

    Returns:
        Per file, in order: its attributes, or the error that file met (a failed write:
        the storage error; the commit's per-path error). Nothing is raised for one file.
    """
    uid, gid = os.getuid(), os.getgid()
    out: list[Attr | StripefsError | None] = [None] * len(files)
    reserved: list[Reservation | None] = [None] * len(files)
    by_parent: dict[str, list[int]] = collections.defaultdict(list)
    for i, (path, data) in enumerate(files):
        if known is not None and not exclusive and known(path):
            out[i] = _in_place(client, path, data)
        else:
            by_parent[posixpath.dirname(path) or "/"].append(i)
    for parent, idx in by_parent.items():
        try:
            got = [pool.take(client, parent) for _ in idx] if pool is not None else reserve(client, parent, len(idx))
        except StripefsError as exc:
            for i in idx:
                out[i] = StripefsError(exc.code, exc.message, files[i][0])
            continue
        for i, r in zip(idx, got):
            reserved[i] = r
    _write_all(client, files, reserved, out)
    ready = [i for i in range(len(files)) if out[i] is None and reserved[i] is not None]
    for start in range(0, len(ready), BATCH):
        part = ready[start:start + BATCH]
        msg = m.CommitFiles(paths=[files[i][0] for i in part], inos=[reserved[i].ino for i in part],  # type: ignore[union-attr]
                            ids=[reserved[i].id for i in part], lengths=[len(files[i][1]) for i in part],  # type: ignore[union-attr]
                            mode=mode, uid=uid, gid=gid, mtime_ns=mtime_ns, exclusive=exclusive)
        try:
            reply = client.call(msg)
        except StripefsError as exc:
            for i in part:
                out[i] = StripefsError(exc.code, exc.message, files[i][0])
            continue
        for i, got in zip(part, reply.per_item([files[i][0] for i in part], "CommitFiles")):
            out[i] = got
    if not exclusive:  # names that exist: those files are written in place
        for i, r in enumerate(out):
            if isinstance(r, StripefsError) and r.code == ErrorCode.EXISTS:
                out[i] = _in_place(client, *files[i])
    return out  # type: ignore[return-value]  # every index was answered


def _in_place(client: Client, path: str, data: "bytes | bytearray | memoryview") -> Attr | StripefsError:
    """Write an existing file as ``open(path, "wb")`` does; its attributes, or the error."""
    try:
        with client.open(path, "wb", defer=False) as f:  # the name exists: nothing to make
            f.write(data)
        return dataclasses.replace(f.attr, size=f.size)  # as opened; the size as committed
    except StripefsError as exc:
        return exc


def _write_all(client: Client, files: Sequence[tuple[str, "bytes | bytearray | memoryview"]],
               reserved: list[Reservation | None], out: list[Attr | StripefsError | None]) -> None:
    """Write every reserved file's bytes, at most ``IN_FLIGHT`` bytes at once; a file whose
    write failed gets its error in ``out`` (its reservation is left to expire)."""
    inflight: collections.deque[tuple[int, Future[None], int]] = collections.deque()
    held = 0

    def settle_one() -> None:
        nonlocal held
        i, done, n = inflight.popleft()
        held -= n
        try:
            done.result()
        except StripefsError as exc:
            out[i] = StripefsError(exc.code, exc.message, files[i][0])

    for i, (_path, data) in enumerate(files):
        r = reserved[i]
        if r is None or not len(data):
            continue
        view = memoryview(data).cast("B")
        while inflight and held + len(view) > IN_FLIGHT:
            settle_one()
        inflight.append((i, client.submit_write(r.ino, r.layout, 0, view), len(view)))
        held += len(view)
    while inflight:
        settle_one()
