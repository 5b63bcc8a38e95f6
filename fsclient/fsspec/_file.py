"""The file class of ``stripefs://``: fsspec's file protocol over a native :class:`StripeFile`.

No readahead cache sits in front: reads and writes go to the native file,
whose large reads land straight in the caller's buffer from all servers at
once (its own small-read window and write-behind buffers stay).

Inside ``with fs.transaction:`` a file opened for writing is written under a
hidden temporary name in the same directory and renamed onto its final name
at ``commit()`` (``discard()`` removes it), so readers never see a partial file.
"""

from __future__ import annotations

import io
import posixpath
import uuid
from typing import TYPE_CHECKING, Any, Callable, Protocol

from stripefs.wire import ErrorCode, StripefsError

from ..core import Client, fill_bytes

if TYPE_CHECKING:
    from ..core import StripeFile

__all__ = ["StripeFsFile", "fill_bytes"]


class _FileSystem(Protocol):
    """What a file needs of its filesystem (``StripeFileSystem``; kept abstract so the
    file module does not import the filesystem module that imports it)."""

    client: Client

    def _ensure_parent(self, path: str) -> None: ...
    def _retry_with_parent(self, path: str, fn: Callable[[], Any]) -> Any: ...
    def invalidate_cache(self, path: str | None = None) -> None: ...
    def info(self, path: str, **kwargs: Any) -> dict[str, Any]: ...

MODES = ("rb", "wb", "ab", "xb")


class StripeFsFile(io.RawIOBase):
    """A ``stripefs://`` file: ``rb``, ``wb``, ``ab`` or ``xb``.

    Attributes fsspec code relies on: ``fs``, ``path``, ``mode``, ``size``,
    ``loc``, ``autocommit``, ``commit()``/``discard()``, ``info()``.

    Raises:
        ValueError: another mode.
        FileNotFoundError, IsADirectoryError, FileExistsError: as the native ``open``.
    """

    def __init__(self, fs: _FileSystem, path: str, mode: str = "rb", *, autocommit: bool = True):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"stripefs files open as {', '.join(MODES)}; got {mode!r}")
        self.fs, self.path, self.mode, self.autocommit = fs, path, mode, autocommit
        self._tmp: str | None = None
        client = fs.client
        if mode != "rb" and not autocommit:
            self._tmp = posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}.stripefs-tx-{uuid.uuid4().hex}")
            if mode == "xb" and client.exists(path):
                raise StripefsError(ErrorCode.EXISTS, "already exists", path)
            fs._ensure_parent(path)
            if mode == "ab" and client.isfile(path):
                client.copy(path, self._tmp)  # append to a private copy; the rename publishes it
            self.raw: "StripeFile" = client.open(self._tmp, "ab" if mode == "ab" else "wb")
        elif mode == "rb":
            self.raw = client.open(path, "rb")
        else:
            self.raw = fs._retry_with_parent(path, lambda: client.open(path, mode))
            fs.invalidate_cache(path)  # the entry exists (and may be truncated) from now on

    # -- io protocol: everything goes to the native file --------------------------------------
    def readable(self) -> bool:
        return self.raw.readable()

    def writable(self) -> bool:
        return self.raw.writable()

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        return self.raw.readinto(b)

    def read(self, size: int | None = -1) -> bytes:
        if not self.raw.readable():
            raise io.UnsupportedOperation("file not open for reading")
        return self.raw.read(size)

    def readall(self) -> bytes:
        return self.read(-1)

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        if not self.closed:
            self.raw.flush()

    def truncate(self, size: int | None = None) -> int:
        return self.raw.truncate(size)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("stripefs files have no OS file descriptor")

    def pread(self, size: int, offset: int) -> bytes:
        """Read at ``offset`` without moving the position (parallel over the chunks)."""
        return self.raw.pread(size, offset)

    @property
    def size(self) -> int:
        return self.raw.size

    @property
    def loc(self) -> int:
        return self.raw.tell()

    def info(self) -> dict[str, Any]:
        return self.fs.info(self.path)

    # -- closing and transactions -------------------------------------------------------------
    def close(self) -> None:
        raw = getattr(self, "raw", None)  # None when __init__ failed (io calls close() at GC)
        if self.closed or raw is None:
            return
        try:
            raw.close()
        finally:
            super().close()
            if self.mode != "rb" and self._tmp is None:
                self.fs.invalidate_cache(self.path)

    def commit(self) -> None:
        """Publish a transaction's file: close it, then rename it onto its final name.

        The new version takes the mode and owner of the file it replaces (an
        in-place rewrite keeps them; a rename would otherwise publish the
        temporary's). If closing or publishing fails, the temporary is removed
        and the error raised.
        """
        if self._tmp is None:
            self.close()
            return
        tmp, self._tmp = self._tmp, None
        try:
            self.close()
            self._take_identity_of_target(tmp)
            self.fs.client.rename(tmp, self.path, noreplace=self.mode == "xb")
        except BaseException:
            try:
                self.fs.client.remove(tmp)
            except FileNotFoundError:
                pass
            raise
        finally:
            self.fs.invalidate_cache(self.path)

    def _take_identity_of_target(self, tmp: str) -> None:
        """Give ``tmp`` the permission bits and owner of the regular file at ``self.path``, if any."""
        client = self.fs.client
        try:
            old = client.lstat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return
        if not old.is_file:  # a link or special file is replaced, not rewritten: nothing to keep
            return
        new = client.lstat(tmp)
        if (new.uid, new.gid) != (old.uid, old.gid):
            try:
                client.chown(tmp, old.uid, old.gid)
            except PermissionError:
                pass  # as `cp -p`: the owner is kept where the caller may set it
        if new.mode & 0o7777 != old.mode & 0o7777:
            client.chmod(tmp, old.mode & 0o7777)  # after chown, which may clear set-id bits

    def discard(self) -> None:
        """Drop a transaction's file: nothing appears under its name.

        A failure to close the file is not raised for a transaction's file: its
        bytes are being thrown away, and raising would replace the exception
        that aborted the transaction. Its temporary is removed in any case.
        """
        tmp, self._tmp = self._tmp, None
        try:
            self.close()
        except Exception:
            if tmp is None:
                raise
        finally:
            if tmp is not None:
                try:
                    self.fs.client.remove(tmp)
                except FileNotFoundError:
                    pass
                self.fs.invalidate_cache(tmp)

    def __repr__(self) -> str:
        return f"<StripeFsFile stripefs://{self.path.lstrip('/')} mode={self.mode!r}>"
