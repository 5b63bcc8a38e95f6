"""What holds the ``kvcache`` workload's pages on each route (``bench._kvcache_workload``).

* ``native``, ``zerocopy``, ``fsspec``: the real :class:`~stripefs.kvcache.PageStore`
  (``batch_get_into``, ``batch_put``, ``exists``) over the route's stripefs client (the
  session's; ``StripeFileSystem.client``), one namespace per task under the route's
  directory (``kvcache/TAG``), its capacity shared by all clients.
* POSIX routes that are not stripefs (``local_disk``, the peers' mounts): one file per page
  (``kvcache/TAG/KEY``), published by write + fsync + rename (as durable as a store put),
  read back with ``O_DIRECT`` by ``BATCH_THREADS`` threads per batch (a missing file is a
  miss); each client keeps ``capacity / clients`` of the pages it wrote and unlinks its
  least recently used ones to make room, before writing (as the store does).
* ``fuse`` and other fsspec filesystems (``s3fs``): none; :func:`open_pages` says why.

Keys are ints (``0 .. keys-1``); the store gets them as 8 little-endian bytes.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ._pattern import VerifyError
from ._sessions import BATCH_THREADS, NativeSession, PosixSession, Session
from ._workloads import ClientContext

__all__ = ["Pages", "open_pages", "remove_pages"]


class Pages(Protocol):
    """What holds the pages: the page store, or one file per page."""

    def exists(self, keys: list[int]) -> list[bool]: ...
    def get_into(self, keys: list[int], views: list[memoryview]) -> list[bool]: ...
    def put(self, keys: list[int], views: list[memoryview]) -> None: ...
    def counts(self) -> dict[str, int]: ...
    def close(self) -> None: ...


def _key(k: int) -> bytes:
    return k.to_bytes(8, "little")


class _Store:
    """The real page store; counters from ``PageStore.stats()``."""

    def __init__(self, client: Any, root: str, tag: str, page: int, capacity: int, ctx: ClientContext):
        from stripefs.kvcache import PageStore

        if ctx.index:  # the first client makes the namespace, the others open it
            ctx.wait()
        self.store = PageStore(client, tag, page, capacity, root=root)
        if not ctx.index:
            ctx.wait()

    def exists(self, keys: list[int]) -> list[bool]:
        return self.store.exists([_key(k) for k in keys])

    def get_into(self, keys: list[int], views: list[memoryview]) -> list[bool]:
        return self.store.batch_get_into([_key(k) for k in keys], views)

    def put(self, keys: list[int], views: list[memoryview]) -> None:
        self.store.batch_put([_key(k) for k in keys], views)

    def counts(self) -> dict[str, int]:
        st = self.store.stats()
        return {"checksum_failures": st.checksum_failures, "read_errors": st.read_errors,
                "evictions": st.evictions}

    def close(self) -> None:
        self.store.close()


class _Files:
    """One file per page under the session; each client keeps ``capacity / clients`` of the
    pages it wrote, unlinking its least recently used first."""

    def __init__(self, s: PosixSession, tag: str, page: int, capacity: int, ctx: ClientContext):
        self.s, self.page, self.index = s, page, ctx.index
        self.dir = f"kvcache/{tag}"
        s.makedirs(self.dir)
        self.room = capacity // ctx.clients // page
        self.mine: OrderedDict[int, None] = OrderedDict()  # pages this client wrote, oldest first
        self.evictions = 0
        self.pool = ThreadPoolExecutor(BATCH_THREADS, thread_name_prefix="bench-kvcache")

    def _path(self, k: int) -> str:
        return f"{self.dir}/{k:07d}"

    def exists(self, keys: list[int]) -> list[bool]:
        def one(k: int) -> bool:
            try:
                return self.s.size(self._path(k)) == self.page
            except FileNotFoundError:
                return False

        return list(self.pool.map(one, keys))

    def get_into(self, keys: list[int], views: list[memoryview]) -> list[bool]:
        def one(k: int, view: memoryview) -> bool:
            try:
                r = self.s.open_read(self._path(k), direct=True)
            except FileNotFoundError:
                return False
            try:
                n = r.pread_into(view, 0)
            finally:
                r.close()
            if n != self.page:  # pages are published whole (rename): a short one is a bug
                raise VerifyError(f"{self._path(k)}: read {n} of {self.page} bytes")
            return True

        hits = list(self.pool.map(one, keys, views))
        for k, hit in zip(keys, hits):
            if hit and k in self.mine:
                self.mine.move_to_end(k)
        return hits

    def put(self, keys: list[int], views: list[memoryview]) -> None:
        for k in keys:  # a page this client holds but another client's eviction took: rewritten
            self.mine.pop(k, None)
        gone = []
        while self.mine and len(self.mine) + len(keys) > self.room:
            gone.append(self.mine.popitem(last=False)[0])
        self.evictions += len(gone)
        list(self.pool.map(self._unlink, gone))
        list(self.pool.map(self._write, keys, views))
        self.mine.update(dict.fromkeys(keys))

    def _unlink(self, k: int) -> None:
        try:
            self.s.unlink(self._path(k))
        except FileNotFoundError:  # another client wrote the same key and evicted it first
            pass

    def _write(self, k: int, view: memoryview) -> None:
        tmp = f"{self.dir}/.{k:07d}.c{self.index}"
        w = self.s.create(tmp)
        try:
            w.write(view)
            w.fsync()
        finally:
            w.close()
        self.s.rename(tmp, self._path(k))  # readers see the whole page or none

    def counts(self) -> dict[str, int]:
        return {"checksum_failures": 0, "read_errors": 0, "evictions": self.evictions}

    def close(self) -> None:
        self.pool.shutdown()


def _stripefs_client(s: Session) -> Any:
    """The stripefs client behind a session (native, zerocopy, fsspec's ``StripeFileSystem``),
    or None (POSIX routes, other fsspec filesystems)."""
    from stripefs.fsclient import Client

    client = s.client if isinstance(s, NativeSession) else getattr(getattr(s, "fs", None), "client", None)
    return client if isinstance(client, Client) else None


def open_pages(s: Session, route: str, tag: str, page: int, capacity: int, ctx: ClientContext) -> Pages:
    """The page holder of task ``tag`` on ``route`` (``capacity`` bytes for all clients).

    Raises:
        NotImplementedError: the route has neither (the run reports it as skipped, with this).
    """
    client = _stripefs_client(s)
    if client is not None:  # one store, whichever way in: its gets use the zero-copy ring on every route
        return _Store(client, posixpath.join(s.root, "kvcache"), tag, page, capacity, ctx)  # type: ignore[attr-defined]
    if isinstance(s, PosixSession) and route != "fuse":
        return _Files(s, tag, page, capacity, ctx)
    if isinstance(s, PosixSession):
        raise NotImplementedError("kvcache: the page store is a library over the native client, which this "
                                  "route's mount does not expose; pages as files through the mount would not be "
                                  "the store")
    raise NotImplementedError("kvcache: no page store and no POSIX files on this route (an object store); "
                              "the one-file-per-page baseline runs on local_disk and the peers' mounts")


def remove_pages(s: Session, tag: str) -> None:
    """Remove task ``tag``'s namespace or files (after every client closed its holder)."""
    client = _stripefs_client(s)
    if client is not None:
        _remove_tree(client, posixpath.join(s.root, "kvcache", tag))  # type: ignore[attr-defined]
    elif isinstance(s, PosixSession):
        shutil.rmtree(os.path.join(s.root, "kvcache", tag), ignore_errors=True)


def _remove_tree(client: Any, path: str) -> None:
    for e in list(client.scandir(path)):
        child = f"{path}/{e.name}"
        if e.attr is not None and e.attr.is_dir:
            _remove_tree(client, child)
        else:
            client.remove(child)
    client.rmdir(path)
