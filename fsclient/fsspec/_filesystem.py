"""fsspec filesystem ``stripefs://``: a thin adapter over the native :class:`~fsclient.Client`.

    >>> import fsspec, pandas as pd
    >>> df = pd.read_parquet("stripefs://datasets/train.parquet")
    >>> fs = fsspec.filesystem("stripefs", cluster="/srv/stripefs/cluster.json")
    >>> blobs = fs.cat_ranges(paths, starts, ends)   # concurrent across servers

Registered through the ``fsspec.specs`` entry point, so ``fsspec.open``,
``fsspec.url_to_fs`` and every library built on them (pandas, pyarrow,
datasets, torch DCP's ``FsspecWriter``) accept ``stripefs://dir/file``.
The cluster is found as everywhere else: the ``cluster=`` storage option,
``STRIPEFS_CLUSTER``, then the cluster of the last ``stripefs up``.

Paths inside the filesystem are absolute: ``stripefs://a/b`` is ``/a/b``.

Caveats:
    * Consistency is close-to-open, as in the native client: a file's new
      length is visible to other clients once the writer closes it.
    * ``ls`` results are cached (fsspec's ``DirCache``). Every write made
      through this filesystem object (open for write, pipe, put, cp, mv, rm,
      mkdir, transaction commit) drops the affected listings at once, so this
      client never sees stale sizes of its own writes; writes of *other*
      clients show up after ``listings_expiry_time`` (default 10 s),
      ``ls(..., refresh=True)`` or ``invalidate_cache()``. ``info``/``size``/
      ``exists`` never use the cache (one metadata round trip each).
    * A transaction commits file by file (each file appears atomically, by
      rename); it is not one atomic step over all files.
    * ``created`` is the inode change time (stripefs keeps no birth time).
    * Writes create missing parent directories (``auto_mkdir=True``, as object
      stores behave); pass ``auto_mkdir=False`` for POSIX behaviour.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import os
import posixpath
from typing import Any, Callable, Iterator

from fsspec import AbstractFileSystem
from fsspec.callbacks import DEFAULT_CALLBACK, Callback
from fsspec.utils import stringify_path

from stripefs.wire import Attr, ErrorCode, StripefsError

from ..core import Client, fill_bytes
from ._file import StripeFsFile
from ._ranges import clamp, read_ranges

__all__ = ["StripeFileSystem", "StripeFsFile"]

PROTOCOL = "stripefs"
STEP = 16 << 20  # put/get step: big enough that every server gets several chunks at once


class StripeFileSystem(AbstractFileSystem):
    """``stripefs://`` for fsspec.

    Args:
        cluster: a ``cluster.json`` path or ``host:port``; None: ``STRIPEFS_CLUSTER``,
            then the last ``stripefs up``.
        secret: the client credential (cluster.json's ``client_secret``) when ``cluster`` is ``host:port``.
        conns_per_server, max_inflight: passed to :class:`fsclient.Client`.
        auto_mkdir: writes create missing parent directories (default True).
        max_gap: ``cat_ranges`` merges ranges of one file closer than this (bytes).
        max_span: ``cat_ranges`` never merges ranges into a read longer than this.
        max_workers: ``cat_ranges`` reads this many merged ranges at once.
        **storage_options: fsspec's (``use_listings_cache``, ``listings_expiry_time``,
            ``skip_instance_cache``...).

    Raises:
        FileNotFoundError: no cluster could be found (at construction).
    """

    protocol = PROTOCOL
    root_marker = "/"
    blocksize = STEP

    def __init__(self, cluster: str | None = None, *, secret: str | None = None, conns_per_server: int = 2,
                 max_inflight: int = 32, auto_mkdir: bool = True, max_gap: int = 64 << 10,
                 max_span: int = 32 << 20, max_workers: int = 16, **storage_options: Any):
        storage_options.setdefault("listings_expiry_time", 10.0)
        super().__init__(**storage_options)
        self.client = Client(cluster, secret=secret, conns_per_server=conns_per_server, max_inflight=max_inflight)
        self.auto_mkdir = auto_mkdir
        self.max_gap, self.max_span, self.max_workers = max_gap, max_span, max_workers

    # -- paths ------------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = stringify_path(path)
        for prefix in (PROTOCOL + "://", PROTOCOL + "::"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        return "/" + path.strip("/")

    def unstrip_protocol(self, name: str) -> str:
        return name if name.startswith(PROTOCOL + "://") else PROTOCOL + "://" + name.lstrip("/")

    @property
    def fsid(self) -> str:
        return f"{PROTOCOL}-{self.client.config.cluster_id or '%s:%d' % self.client.config.metadata}"

    # -- listing and metadata ---------------------------------------------------------------
    def _entry(self, path: str, attr: Attr) -> dict[str, Any]:
        if attr.is_symlink:
            # Follow links, as the local filesystem does; a dangling link stays "other".
            try:
                out = self._entry(path, self.client.stat(path))
            except FileNotFoundError:
                out = self._entry_of(path, attr)
            out.update(islink=True, destination=attr.target)
            return out
        return self._entry_of(path, attr)

    @staticmethod
    def _entry_of(path: str, attr: Attr) -> dict[str, Any]:
        kind = "directory" if attr.is_dir else "file" if attr.is_file else "other"
        return {
            "name": path, "size": attr.size if attr.is_file else 0, "type": kind, "mode": attr.mode,
            "mtime": attr.mtime_ns / 1e9, "created": attr.ctime_ns / 1e9, "ino": attr.ino,
            "nlink": attr.nlink, "uid": attr.uid, "gid": attr.gid, "islink": False,
        }

    def ls(self, path: str, detail: bool = True, refresh: bool = False, **kwargs: Any) -> list[Any]:
        """Entries of a directory (``[info(path)]`` for a file); cached, see the module caveats."""
        p = self._strip_protocol(path)
        entries = None if refresh else self.dircache.get(p)
        if entries is None:
            base = p.rstrip("/")
            try:
                entries = [self._entry(f"{base}/{e.name}", e.attr or self.client.lstat(f"{base}/{e.name}"))
                           for e in self.client.scandir(p, attrs=True)]
            except NotADirectoryError:
                return [self.info(p)] if detail else [p]
            self.dircache[p] = entries
        return [dict(e) for e in entries] if detail else [e["name"] for e in entries]

    def walk(self, path: str, maxdepth: int | None = None, topdown: bool = True, on_error: Any = "omit",
             **kwargs: Any) -> Iterator[tuple[str, Any, Any]]:
        """``os.walk`` over stripefs, never descending through a symlink.

        Listings follow links (a link to a directory lists as ``type: directory``
        with ``islink``), but a walk reports every link among the files, as
        ``os.walk(followlinks=False)`` and fsspec's own contract do. Everything
        recursive is built on this (``find``, ``du``, ``expand_path``, so ``rm``,
        ``copy``, ``get`` with ``recursive=True``): removing ``run1`` whose
        ``latest`` links to ``run0`` removes the link, never ``run0``'s files.

        Args: as ``AbstractFileSystem.walk`` (``detail`` in kwargs; ``dirs`` may be
        pruned in place when ``topdown``).
        """
        if maxdepth is not None and maxdepth < 1:
            raise ValueError("maxdepth must be at least 1")
        detail = kwargs.pop("detail", False)
        top = self._strip_protocol(path).rstrip("/") or "/"
        try:
            listing = self.ls(top, detail=True, **kwargs)
        except OSError as exc:  # FileNotFoundError included
            if on_error == "raise":
                raise
            if callable(on_error):
                on_error(exc)
            return
        dirs: dict[str, Any] = {}
        files: dict[str, Any] = {}
        for info in listing:
            full = info["name"].rstrip("/") or "/"
            if full == top:  # `top` is a file: fsspec names its entry ""
                files[""] = info
            elif info["type"] == "directory" and not info.get("islink"):
                dirs[posixpath.basename(full)] = info
            else:
                files[posixpath.basename(full)] = info
        shown_dirs: Any = dirs if detail else list(dirs)
        shown_files: Any = files if detail else list(files)
        if topdown:
            yield top, shown_dirs, shown_files
        deeper = None if maxdepth is None else maxdepth - 1
        if deeper is None or deeper >= 1:
            for name in list(shown_dirs):  # what the caller left after pruning
                yield from self.walk(posixpath.join(top, name), maxdepth=deeper, topdown=topdown,
                                     on_error=on_error, detail=detail, **kwargs)
        if not topdown:
            yield top, shown_dirs, shown_files

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """One metadata round trip (no parent listing, no cache)."""
        p = self._strip_protocol(path)
        return self._entry(p, self.client.lstat(p))

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.client.exists(self._strip_protocol(path))

    def created(self, path: str) -> _dt.datetime:
        return _dt.datetime.fromtimestamp(self.client.stat(self._strip_protocol(path)).ctime_ns / 1e9, _dt.timezone.utc)

    def modified(self, path: str) -> _dt.datetime:
        return _dt.datetime.fromtimestamp(self.client.stat(self._strip_protocol(path)).mtime_ns / 1e9, _dt.timezone.utc)

    def ukey(self, path: str) -> str:
        """Changes whenever the file's inode, size or times change."""
        a = self.client.stat(self._strip_protocol(path))
        return hashlib.sha256(f"{a.ino}:{a.size}:{a.mtime_ns}:{a.ctime_ns}".encode()).hexdigest()

    def checksum(self, path: str) -> int:
        return int(self.ukey(path)[:16], 16)

    def invalidate_cache(self, path: str | None = None) -> None:
        """Drop cached listings of ``path``, its parent and everything below it (all if None)."""
        if path is None:
            self.dircache.clear()
        else:
            p = self._strip_protocol(path)
            for key in [k for k in list(self.dircache) if k == p or k.startswith(p.rstrip("/") + "/")]:
                self.dircache.pop(key, None)
            self.dircache.pop(self._parent(p), None)
        super().invalidate_cache(path)

    # -- directories ------------------------------------------------------------------------
    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        p = self._strip_protocol(path)
        if create_parents:
            if self.client.exists(p):
                raise StripefsError(ErrorCode.EXISTS, "already exists", p)
            self.client.makedirs(p, kwargs.get("mode", 0o777), exist_ok=True)
        else:
            self.client.mkdir(p, kwargs.get("mode", 0o777))
        self.invalidate_cache(p)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        p = self._strip_protocol(path)
        self.client.makedirs(p, exist_ok=exist_ok)
        self.invalidate_cache(p)

    def rmdir(self, path: str) -> None:
        p = self._strip_protocol(path)
        self.client.rmdir(p)
        self.invalidate_cache(p)

    def rm_file(self, path: str) -> None:
        p = self._strip_protocol(path)
        self.client.remove(p)
        self.invalidate_cache(p)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        """Delete files; directories too with ``recursive`` (deepest first). With
        ``recursive``, every non-directory goes first, 200 per round trip
        (:meth:`Client.unlink_many`), then the directories.

        Raises:
            IsADirectoryError: a directory without ``recursive``.
        """
        paths = list(reversed(self.expand_path(path, recursive=recursive, maxdepth=maxdepth)))
        if recursive:
            for p, got in zip(paths, self.client.unlink_many(paths)):
                if isinstance(got, IsADirectoryError):
                    self.client.rmdir(p)  # its entries went before it
                elif isinstance(got, BaseException):
                    raise got
                self.invalidate_cache(p)
            return
        for p in paths:
            self.client.remove(p)  # IsADirectoryError for a directory
            self.invalidate_cache(p)

    # -- whole-file operations --------------------------------------------------------------
    def _ensure_parent(self, path: str) -> None:
        if self.auto_mkdir:
            self.client.makedirs(self._parent(path), exist_ok=True)

    def _retry_with_parent(self, path: str, op: Callable[[], Any]) -> Any:
        """Run ``op``; if ``path``'s parent is missing and ``auto_mkdir`` is on, create it and rerun.

        Costs nothing on the common path (the parent exists).
        """
        try:
            return op()
        except FileNotFoundError:
            if not self.auto_mkdir or self.client.exists(self._parent(path)):
                raise
        self.client.makedirs(self._parent(path), exist_ok=True)
        return op()

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        """Bytes ``[start, end)`` (negative: from the end), read in parallel straight into the result."""
        p = self._strip_protocol(path)
        attr = self.client.stat(p)
        if attr.is_dir or attr.layout is None:
            raise StripefsError(ErrorCode.IS_DIR, "is a directory", p)
        s, e = clamp(start, end, attr.size)
        layout, ino, size = attr.layout, attr.ino, attr.size
        return fill_bytes(e - s, lambda view, pos: self.client.read_into(ino, layout, size, s + pos, view))

    def cat_ranges(self, paths: list[str], starts: Any, ends: Any, max_gap: int | None = None,
                   on_error: str = "return", **kwargs: Any) -> list[Any]:
        """Many ranges of many files, all in flight at once; near ranges of a file are merged.

        Args:
            paths, starts, ends: as fsspec's (``starts``/``ends`` may be one int or None).
            max_gap: merge ranges of one file separated by at most this many bytes.
            on_error: ``"return"`` puts the exception in the result list, else raise.
        """
        if not isinstance(paths, list):
            raise TypeError("paths must be a list")
        starts = starts if isinstance(starts, list) else [starts] * len(paths)
        ends = ends if isinstance(ends, list) else [ends] * len(paths)
        if len(starts) != len(paths) or len(ends) != len(paths):
            raise ValueError("paths, starts and ends must have the same length")
        out = read_ranges(self.client, [self._strip_protocol(p) for p in paths], starts, ends,
                          max_gap=self.max_gap if max_gap is None else max_gap, max_span=self.max_span,
                          max_workers=self.max_workers)
        if on_error != "return":
            for item in out:
                if isinstance(item, BaseException):
                    raise item
        return out

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        """Write ``value``; ``mode="create"`` is an exclusive create (FileExistsError if present)."""
        if mode not in ("overwrite", "create"):
            raise ValueError(f"pipe_file mode must be 'overwrite' or 'create', got {mode!r}")
        if self._intrans:  # written under a hidden name, renamed at the commit
            with self.open(path, "xb" if mode == "create" else "wb", **kwargs) as f:
                f.write(value)
            return
        # Bytes first, then name and length in one commit (Client.write_bytes): whole or absent.
        p = self._strip_protocol(path)
        self._retry_with_parent(p, lambda: self.client.write_bytes(p, value, exclusive=mode == "create"))
        self.invalidate_cache(p)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """Copy through one reused aligned buffer inside the client (no bytes per chunk)."""
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        attr = self.client.stat(p1)
        if attr.is_dir:
            self.client.makedirs(p2, exist_ok=True)
        else:
            self._retry_with_parent(p2, lambda: self.client.copy(p1, p2))
        self.invalidate_cache(p2)

    def mv(self, path1: Any, path2: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> None:
        """One atomic rename for a single path (file or whole directory); into ``path2`` if it is a directory.

        Lists and globs fall back to fsspec's copy-then-delete.
        """
        if not (isinstance(path1, str) and isinstance(path2, str)) or any(c in path1 for c in "*?["):
            return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        if p1 == p2:
            return None
        if self.client.isdir(p2):
            p2 = posixpath.join(p2, posixpath.basename(p1))
        else:
            self.client.lstat(p1)  # a missing source must not create the target's parents
        self._retry_with_parent(p2, lambda: self.client.rename(p1, p2))
        self.invalidate_cache(p1)
        self.invalidate_cache(p2)
        return None

    def put_file(self, lpath: str, rpath: str, callback: Callback = DEFAULT_CALLBACK, mode: str = "overwrite",
                 **kwargs: Any) -> None:
        """Upload one local file (a local directory becomes a remote one), reporting bytes to ``callback``."""
        import os

        if os.path.isdir(lpath):
            self.makedirs(rpath, exist_ok=True)
            return
        self._upload(lpath, lambda: self.open(rpath, "xb" if mode == "create" else "wb"), callback)

    def _upload(self, lpath: str, open_dst: Callable[[], Any], callback: Callback) -> None:
        """Copy the local file ``lpath`` into the file ``open_dst()`` opens (after the local one opened)."""
        with open(lpath, "rb") as src, open_dst() as dst:
            callback.set_size(os.fstat(src.fileno()).st_size)
            for view in _blocks(self.client, src.readinto):
                dst.write(view)
                callback.relative_update(len(view))

    def put(self, lpath: Any, rpath: Any, recursive: bool = False, callback: Callback = DEFAULT_CALLBACK,
            maxdepth: int | None = None, **kwargs: Any) -> None:
        """Upload files (fsspec's ``put``). With ``recursive``, the target files are created
        in batches first (one round trip per 200 files, :meth:`Client.create_many`), then
        filled; a target that exists already is overwritten file by file as ``put_file`` does.

        Caveats:
            * Inside a transaction every file goes through ``put_file`` (a hidden name each).
            * A failure part way (a local read error) leaves the targets not yet written
              empty: they were all created up front.
        """
        if not recursive or self._intrans:
            return super().put(lpath, rpath, recursive=recursive, callback=callback, maxdepth=maxdepth, **kwargs)
        plan = _PutPlan(self)  # fsspec's own expansion of sources and targets, nothing written
        AbstractFileSystem.put(plan, lpath, rpath, recursive=True, maxdepth=maxdepth, **kwargs)  # type: ignore[arg-type]
        files = [r for lp, r in plan.pairs if not os.path.isdir(lp)]
        for lp, r in plan.pairs:  # directories first, as fsspec orders them; parents before children
            if os.path.isdir(lp):
                self.makedirs(r, exist_ok=True)
        created = dict(zip(files, self._create_files(files)))
        callback.set_size(len(plan.pairs))
        for lp, r in callback.wrap(plan.pairs):
            with callback.branched(lp, r) as child:
                got = created.get(r)
                if got is None:  # a directory, made above
                    continue
                if isinstance(got, Attr):
                    attr, name = got, r
                    self._upload(lp, lambda: self.client.open_inode(attr, name=name, readable=False, writable=True),
                                 child)
                elif isinstance(got, FileExistsError) and kwargs.get("mode", "overwrite") != "create":
                    self.put_file(lp, r, callback=child, **kwargs)  # open "wb" truncates it
                else:
                    raise got
        return None

    def _create_files(self, paths: list[str]) -> list[Attr | StripefsError]:
        """:meth:`Client.create_many` (exclusive); with ``auto_mkdir``, the missing parents
        are made and their paths tried again."""
        found = self.client.create_many(paths, 0o666, exclusive=True)
        missing = [i for i, got in enumerate(found) if isinstance(got, FileNotFoundError)]
        if missing and self.auto_mkdir:
            for parent in sorted({self._parent(paths[i]) for i in missing}):
                self.client.makedirs(parent, exist_ok=True)
            for i, got in zip(missing, self.client.create_many([paths[i] for i in missing], 0o666, exclusive=True)):
                found[i] = got
        for parent in {self._parent(p) for p in paths}:
            self.invalidate_cache(parent)
        return found

    def get_file(self, rpath: str, lpath: Any, callback: Callback = DEFAULT_CALLBACK, outfile: Any = None,
                 **kwargs: Any) -> None:
        """Download one file (a remote directory becomes a local one), reporting bytes to ``callback``."""
        import os

        p = self._strip_protocol(rpath)
        if outfile is None and hasattr(lpath, "write"):
            outfile = lpath
        if outfile is None and self.client.isdir(p):
            os.makedirs(lpath, exist_ok=True)
            return
        with self.client.open(p, "rb") as src:
            callback.set_size(src.size)
            if outfile is not None:
                _download(self.client, src, outfile, callback)
                return
            os.makedirs(os.path.dirname(os.path.abspath(lpath)), exist_ok=True)
            with open(lpath, "wb") as dst:
                _download(self.client, src, dst, callback)

    # -- files ------------------------------------------------------------------------------
    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, autocommit: bool = True,
              cache_options: dict | None = None, **kwargs: Any) -> StripeFsFile:
        return StripeFsFile(self, self._strip_protocol(path), mode, autocommit=autocommit)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        p = self._strip_protocol(path)
        if truncate or not self.client.exists(p):
            with self.open(p, "wb"):
                pass
        else:
            self.client.utime(p)
            self.invalidate_cache(p)


class _PutPlan:
    """Stands in for the filesystem while fsspec's ``put`` expands its arguments: it records
    the (local, remote) pairs that ``put_file`` would get, and writes nothing."""

    def __init__(self, fs: StripeFileSystem):
        self._fs = fs
        self.pairs: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        self.pairs.append((lpath, rpath))


def _blocks(client: Client, readinto: Callable[[memoryview], int]) -> Iterator[memoryview]:
    """Fill one reused page-aligned buffer from ``readinto`` and yield its filled part, until EOF."""
    buf = client.buffers.get(STEP)
    view = memoryview(buf)
    try:
        while True:
            n = readinto(view)
            if not n:
                return
            yield view[:n]
    finally:
        view.release()
        client.buffers.put(buf)


def _download(client: Client, src: io.RawIOBase, dst: Any, callback: Callback) -> None:
    for view in _blocks(client, src.readinto):
        dst.write(view)
        callback.relative_update(len(view))
