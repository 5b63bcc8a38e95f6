"""Client-side faces of every route: one small file API the workloads run against.

A route (``bench._routes``) is started once in the benchmark process and described by a
picklable *spec*; each client process turns the spec into a :class:`Session` with
:func:`open_session`. Workloads only call the methods below, so every route is measured the
same way: ``native`` (fsclient.Client), ``fsspec`` and ``s3fs`` (an fsspec filesystem),
``fuse``, ``local_disk``, ``glusterfs`` and ``moosefs`` (POSIX calls under a directory), and
``zerocopy`` (batch reads into a registered buffer, native writes).

``open_read(path, direct=True)`` asks for reads that no client-side cache serves: ``O_DIRECT``
on POSIX routes (our FUSE mount, the peers' mounts, the local disk), falling back to buffered
reads followed by ``posix_fadvise(DONTNEED)`` of the range where a file system refuses
``O_DIRECT``; ``cache_type="none"`` on fsspec filesystems (s3fs would otherwise fetch 50 MB
blocks and serve later reads from them). The native client keeps no cache across reads
except its sequential readahead window, which random workloads never engage.

Caveats:
    * fsspec files are write-once streams: :meth:`Session.open_update` returns None (shared-
      file writes are skipped) and ``fsync`` only flushes what the filesystem buffers.
"""

from __future__ import annotations

import errno
import os
import posixpath
from typing import Any, Protocol, runtime_checkable

__all__ = ["Session", "BatchedSession", "Writer", "Reader", "open_session"]


class Writer(Protocol):
    def write(self, view: memoryview) -> None: ...
    def pwrite(self, view: memoryview, offset: int) -> None: ...
    def fsync(self) -> None: ...
    def close(self) -> None: ...


class Reader(Protocol):
    def pread_into(self, view: memoryview, offset: int) -> int: ...
    def close(self) -> None: ...


class Session(Protocol):
    """Paths are relative to the route's benchmark directory. ``datasets`` is the session
    the dataset workloads read through: the session itself, or one on a read-only mount of
    the same file system (a training job mounts its dataset read-only)."""

    datasets: "Session"

    def makedirs(self, path: str) -> None: ...
    def create(self, path: str) -> Writer: ...
    def open_update(self, path: str) -> Writer | None: ...
    def open_read(self, path: str, direct: bool = False) -> Reader: ...
    def evict(self, path: str) -> None: ...
    def size(self, path: str) -> int: ...
    def listdir(self, path: str) -> list[str]: ...
    def touch(self, path: str) -> None: ...
    def unlink(self, path: str) -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def read_batch(self, paths: list[str], views: list[memoryview]) -> list[int]:
        """Read each whole file ``paths[i]`` into ``views[i]`` (its exact size), by the
        route's best way to read many files at once; bytes read per file."""
        ...
    def save_state(self, path: str, state: dict[str, Any]) -> None:
        """Save a model state (tensors) durably at ``path``, the route's own way."""
        ...
    def load_state(self, path: str) -> dict[str, Any]:
        """The state saved at ``path``, loaded whole into fresh memory."""
        ...
    def remove_state(self, path: str) -> None: ...
    def close(self) -> None: ...


BATCH_THREADS = 64  # a route without a batch call reads a batch with this many threads


class _Threads:
    """``read_batch`` for routes without a batch call: one thread per file of the batch,
    each opening, reading and closing (what a dataloader with threads does)."""

    _pool: Any = None

    def _threads(self) -> Any:
        """The session's pool of ``BATCH_THREADS`` threads, made at its first batch."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(BATCH_THREADS, thread_name_prefix="bench-batch")
        return self._pool

    def read_batch(self, paths: list[str], views: list[memoryview]) -> list[int]:
        def one(path: str, view: memoryview) -> int:
            r = self.open_read(path, direct=True)  # type: ignore[attr-defined]
            try:
                return int(r.pread_into(view, 0))
            finally:
                r.close()

        return list(self._threads().map(one, paths, views))

    def _close_threads(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


# --- native ----------------------------------------------------------------------------------

@runtime_checkable
class BatchedSession(Session, Protocol):
    """What a route with batched metadata calls adds (``native``, ``zerocopy``): many files
    per round trip. Each raises on the first path that failed."""

    def create_many(self, paths: list[str]) -> None: ...
    def sizes(self, paths: list[str]) -> list[int]: ...
    def unlink_many(self, paths: list[str]) -> None: ...


def _all_done(results: list[Any]) -> list[Any]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class NativeSession(_Threads):
    """fsclient.Client; its StripeFile already has write/pwrite/fsync/pread_into. A batch:
    one ``stat_many``, then every file read at once (``Client.read_into`` on threads)."""

    def __init__(self, cluster: str, root: str):
        from stripefs.fsclient import Client

        self.client = Client(cluster)
        self.datasets = self
        self.cluster = cluster
        self.root = root
        self.client.makedirs(root)

    def _p(self, path: str) -> str:
        return posixpath.join(self.root, path)

    def makedirs(self, path: str) -> None:
        self.client.makedirs(self._p(path))

    def create(self, path: str) -> Writer:
        return self.client.open(self._p(path), "wb")

    def open_update(self, path: str) -> Writer | None:
        return self.client.open(self._p(path), "r+b")

    def open_read(self, path: str, direct: bool = False) -> Reader:
        return self.client.open(self._p(path), "rb")

    def evict(self, path: str) -> None:
        pass  # nothing of a closed file stays in the client

    def size(self, path: str) -> int:
        return self.client.stat(self._p(path)).size

    def listdir(self, path: str) -> list[str]:
        return self.client.listdir(self._p(path))

    def touch(self, path: str) -> None:
        self.client.open(self._p(path), "wb").close()

    def unlink(self, path: str) -> None:
        self.client.remove(self._p(path))

    def rename(self, src: str, dst: str) -> None:
        self.client.rename(self._p(src), self._p(dst))

    def _url(self, path: str) -> str:
        return "stripefs://" + self._p(path).lstrip("/")

    def save_state(self, path: str, state: dict[str, Any]) -> None:
        """``staging.save`` streamed from memory to the store (no local copy: a load can
        only come from the store). The save's snapshot buffers are given back after it, as
        a restore runs in a process that holds none (a restart), not beside a pooled copy of
        the state's size."""
        import shutil
        import tempfile

        from stripefs import staging

        sdir = tempfile.mkdtemp(prefix="stripefs-bench-staging-")
        try:
            staging.save(state, self._url(path), staging_dir=sdir, cluster=self.cluster, keep_local=0,
                         background_mover=False).wait()
            staging.release_buffers()
        finally:
            shutil.rmtree(sdir, ignore_errors=True)

    def load_state(self, path: str) -> dict[str, Any]:
        from stripefs import staging

        return staging.load(self._url(path), cluster=self.cluster, prefer_local=False)  # type: ignore[no-any-return]

    def remove_state(self, path: str) -> None:
        from stripefs.staging._mover import remove_tree

        remove_tree(self.client, self._p(path))

    def create_many(self, paths: list[str]) -> None:
        _all_done(self.client.create_many([self._p(p) for p in paths]))

    def sizes(self, paths: list[str]) -> list[int]:
        return [a.size for a in _all_done(self.client.stat_many([self._p(p) for p in paths]))]

    def unlink_many(self, paths: list[str]) -> None:
        _all_done(self.client.unlink_many([self._p(p) for p in paths]))

    def read_batch(self, paths: list[str], views: list[memoryview]) -> list[int]:
        attrs = _all_done(self.client.stat_many([self._p(p) for p in paths]))
        return list(self._threads().map(lambda a, v: self.client.read_into(a.ino, a.layout, a.size, 0, v),
                                        attrs, views))

    def close(self) -> None:
        self._close_threads()
        self.client.close()


class _RingReader:
    """One registered file read through a ReadRing (the USRBIO-style path)."""

    def __init__(self, ring: Any, regfile: Any):
        self.ring, self.file = ring, regfile

    def pread_into(self, view: memoryview, offset: int) -> int:
        return int(self.ring.read([(view, self.file, offset, len(view))])[0])

    def close(self) -> None:
        pass


class ZerocopySession(NativeSession):
    """Native writes and metadata; reads land in the caller's buffer via fsclient.batchread."""

    def __init__(self, cluster: str, root: str):
        super().__init__(cluster, root)
        from stripefs.fsclient.batchread import ReadRing

        self.ring = ReadRing(self.client, entries=64)

    def open_read(self, path: str, direct: bool = False) -> Reader:
        return _RingReader(self.ring, self.ring.open(self._p(path)))

    def save_state(self, path: str, state: dict[str, Any]) -> None:
        raise NotImplementedError("restore: the ring has no state loader of its own (staging.load is the native route's)")

    def read_batch(self, paths: list[str], views: list[memoryview]) -> list[int]:
        """The USRBIO-style batch: register the files in one ``StatMany`` (``open_many``),
        then one ring submission reads them all into the caller's buffers."""
        files = self.ring.open_many([self._p(p) for p in paths])
        return [int(n) for n in self.ring.read([(v, f, 0, len(v)) for v, f in zip(views, files)])]

    def close(self) -> None:
        self.ring.close()
        super().close()


# --- POSIX (local disk, FUSE mounts) -------------------------------------------------------

class _FdWriter:
    def __init__(self, fd: int):
        self.fd = fd

    def write(self, view: memoryview) -> None:
        done = 0
        while done < len(view):  # write may be short
            done += os.write(self.fd, view[done:])

    def pwrite(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class _FdReader:
    """``evict``: drop the pages of every range read (buffered stand-in for ``O_DIRECT``)."""

    def __init__(self, fd: int, evict: bool = False):
        self.fd, self.evict = fd, evict

    def pread_into(self, view: memoryview, offset: int) -> int:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        if self.evict:
            os.posix_fadvise(self.fd, offset, done, os.POSIX_FADV_DONTNEED)
        return done

    def close(self) -> None:
        os.close(self.fd)


class PosixSession(_Threads):
    """Plain system calls under ``root`` (a local directory or a mount point); a batch is
    read by ``BATCH_THREADS`` threads."""

    def __init__(self, root: str, dataset_root: str | None = None):
        self.root = root
        os.makedirs(root, exist_ok=True)
        # the dataset's reads through another (read-only) mount; made here by its writers
        self.datasets: Session = self if dataset_root is None else PosixSession._reading(dataset_root)

    @classmethod
    def _reading(cls, root: str) -> "PosixSession":
        """A session that only reads under ``root`` (which may be read-only)."""
        s = cls.__new__(cls)
        s.root, s.datasets = root, s
        return s

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path)

    def makedirs(self, path: str) -> None:
        os.makedirs(self._p(path), exist_ok=True)

    def create(self, path: str) -> Writer:
        return _FdWriter(os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))

    def open_update(self, path: str) -> Writer | None:
        return _FdWriter(os.open(self._p(path), os.O_WRONLY))

    def open_read(self, path: str, direct: bool = False) -> Reader:
        if direct:
            try:
                return _FdReader(os.open(self._p(path), os.O_RDONLY | os.O_DIRECT))
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this file system refuses O_DIRECT
                    raise
            return _FdReader(os.open(self._p(path), os.O_RDONLY), evict=True)
        return _FdReader(os.open(self._p(path), os.O_RDONLY))

    def evict(self, path: str) -> None:
        fd = os.open(self._p(path), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        return os.stat(self._p(path)).st_size

    def listdir(self, path: str) -> list[str]:
        return os.listdir(self._p(path))

    def touch(self, path: str) -> None:
        os.close(os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))

    def unlink(self, path: str) -> None:
        os.unlink(self._p(path))

    def rename(self, src: str, dst: str) -> None:
        os.rename(self._p(src), self._p(dst))

    def save_state(self, path: str, state: dict[str, Any]) -> None:
        """``torch.save`` into one file, then ``fsync``."""
        import torch

        with open(self._p(path), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def load_state(self, path: str) -> dict[str, Any]:
        import torch

        return torch.load(self._p(path), weights_only=True)  # type: ignore[no-any-return]

    def remove_state(self, path: str) -> None:
        os.unlink(self._p(path))

    def close(self) -> None:
        self._close_threads()
        if self.datasets is not self:
            self.datasets.close()


# --- fsspec (our filesystem, s3fs) ---------------------------------------------------------

class _FsspecWriter:
    def __init__(self, f: Any):
        self.f = f

    def write(self, view: memoryview) -> None:
        self.f.write(view)

    def pwrite(self, view: memoryview, offset: int) -> None:
        raise OSError("fsspec files cannot write at an offset")

    def fsync(self) -> None:
        sync = getattr(self.f, "fsync", None)  # ours has it; object stores commit at close
        if sync is not None:
            sync()
        else:
            self.f.flush()

    def close(self) -> None:
        self.f.close()


class _FsspecReader:
    def __init__(self, f: Any):
        self.f = f

    def pread_into(self, view: memoryview, offset: int) -> int:
        self.f.seek(offset)
        done = 0
        while done < len(view):
            n = self.f.readinto(view[done:])
            if not n:
                break
            done += n
        return done

    def close(self) -> None:
        self.f.close()


class FsspecSession:
    """Any fsspec filesystem: class ``"module:Name"`` called with ``options``; ``root`` is the base."""

    def __init__(self, cls: str, options: dict[str, Any], root: str):
        import importlib

        module, _, name = cls.partition(":")
        self.fs = getattr(importlib.import_module(module), name)(skip_instance_cache=True,
                                                                 **options)
        self.root = root
        self.fs.makedirs(root, exist_ok=True)
        self.datasets = self

    def _p(self, path: str) -> str:
        return posixpath.join(self.root, path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self._p(path), exist_ok=True)

    def create(self, path: str) -> Writer:
        return _FsspecWriter(self.fs.open(self._p(path), "wb"))

    def open_update(self, path: str) -> Writer | None:
        return None

    def open_read(self, path: str, direct: bool = False) -> Reader:
        if direct:
            return _FsspecReader(self.fs.open(self._p(path), "rb", cache_type="none"))
        return _FsspecReader(self.fs.open(self._p(path), "rb"))

    def evict(self, path: str) -> None:
        pass  # a closed fsspec file leaves nothing behind (listings are invalidated per call)

    def size(self, path: str) -> int:
        self.fs.invalidate_cache()
        return int(self.fs.info(self._p(path))["size"])

    def listdir(self, path: str) -> list[str]:
        self.fs.invalidate_cache()  # a cached listing would measure nothing
        try:
            found = self.fs.ls(self._p(path), detail=False)
        except FileNotFoundError:  # object stores: a directory with no objects does not exist
            return []
        return [posixpath.basename(p.rstrip("/")) for p in found]

    def touch(self, path: str) -> None:
        self.fs.pipe_file(self._p(path), b"")

    def unlink(self, path: str) -> None:
        self.fs.rm_file(self._p(path))

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(self._p(src), self._p(dst))

    def save_state(self, path: str, state: dict[str, Any]) -> None:
        """``torch.save`` into one file of the filesystem."""
        import torch

        with self.fs.open(self._p(path), "wb") as f:
            torch.save(state, f)

    def load_state(self, path: str) -> dict[str, Any]:
        import torch

        with self.fs.open(self._p(path), "rb") as f:
            return torch.load(f, weights_only=True)  # type: ignore[no-any-return]

    def remove_state(self, path: str) -> None:
        self.fs.rm_file(self._p(path))

    def read_batch(self, paths: list[str], views: list[memoryview]) -> list[int]:
        """fsspec's batch call: ``cat`` of every path (ours: one StatMany, reads in flight
        together); the bytes are copied into the views."""
        full = [self._p(p) for p in paths]
        got = self.fs.cat(full)
        out = []
        for path, view in zip(full, views):
            data = got[path] if path in got else got[self.fs._strip_protocol(path)]
            n = min(len(data), len(view))
            view[:n] = data[:n]
            out.append(n)
        return out

    def close(self) -> None:
        pass


def open_session(spec: dict[str, Any]) -> Session:
    """Build the session a route's ``spec`` describes (in the client process)."""
    kind = spec["kind"]
    if kind == "native":
        return NativeSession(spec["cluster"], spec["root"])
    if kind == "zerocopy":
        return ZerocopySession(spec["cluster"], spec["root"])
    if kind == "posix":
        return PosixSession(spec["root"], spec.get("dataset_root"))
    if kind == "fsspec":
        return FsspecSession(spec["cls"], spec["options"], spec["root"])
    raise ValueError(f"unknown session kind {kind!r}")
