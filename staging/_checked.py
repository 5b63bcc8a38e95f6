"""A checkpoint's files read where they lie, each checksum chunk checked as it is first read.

The DCP reader gives torch's ``FileSystemReader`` these instead of local files: a rank reads
only the byte ranges its load plan names, straight from the store (or from the local staged
copy), and never trusts a byte whose 4 MiB checksum chunk (the manifest's ``chunk_crc32c``)
has not been checked. A read that covers whole chunks lands in the caller's buffer and is
checked there; a read inside a chunk is served from the last chunk read, checked once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

import crc32c

from ._fill import fill_exact
from ._format import ChecksumError

log = logging.getLogger("stripefs.staging")

__all__ = ["CheckedFile", "CheckedFiles"]

HELD_CHUNKS = 4  # per open file: 16 MiB of 4 MiB chunks


class CheckedFile(io.RawIOBase):
    """A read-only, seekable view of one manifest file; :class:`ChecksumError` on a bad chunk.

    ``pread_into(dest, offset)`` reads the stored bytes (the store's ``StripeFile.pread_into``,
    with its readahead, or ``os.preadv`` of a local file); ``shared`` is a read that may run on
    several threads at once (:meth:`read_checked`; ``pread_into`` when not given); ``fallback``
    gives a thread-safe read of a good copy (the store, for a local one)."""

    def __init__(self, name: str, rec: dict[str, Any], pread_into: Callable[[memoryview, int], int],
                 close: Callable[[], None] = lambda: None,
                 fallback: Callable[[], Callable[[memoryview, int], int]] | None = None,
                 shared: Callable[[memoryview, int], int] | None = None):
        super().__init__()
        self.name_in_step = name
        self.size, self.chunk, self.crcs = rec["size"], rec["chunk"], rec["chunk_crc32c"]
        self._pread_into, self._close, self._fallback = pread_into, close, fallback
        self._shared = shared or pread_into  # the thread-safe read (pread_into may keep a readahead)
        self._pos = 0
        # Chunks read for reads inside a chunk, checked, the last used last: a torch.save
        # record is parsed from its start and its end before its bytes are read.
        self._held: OrderedDict[int, bytearray] = OrderedDict()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        """Fill ``b`` up to the end of the file (never a short read before it: torch's loader
        takes a short ``read`` for the end)."""
        dest = memoryview(b).cast("B")
        want = max(0, min(len(dest), self.size - self._pos))
        done = 0
        while done < want:
            done += self._read_some(dest[done:want])
        return done

    def _read_some(self, dest: memoryview) -> int:
        pos, want, k = self._pos, len(dest), self._pos // self.chunk
        whole = want // self.chunk if pos % self.chunk == 0 else 0
        if whole == 0 and pos % self.chunk == 0 and pos + want == self.size:
            whole = 1  # the file's short last chunk, wanted whole
        if whole:  # whole chunks: into the caller's memory, each checked there
            n = min(want, whole * self.chunk)
            self._checked(dest[:n], pos)
        else:  # inside one chunk: from the chunk held, read and checked once
            start, end = k * self.chunk, min((k + 1) * self.chunk, self.size)
            buf = self._held.pop(k, None)
            if buf is None:
                buf = self._held.popitem(last=False)[1] if len(self._held) >= HELD_CHUNKS else bytearray(self.chunk)
                self._checked(memoryview(buf)[: end - start], start)
            self._held[k] = buf
            n = min(want, end - pos)
            dest[:n] = memoryview(buf)[pos - start : pos - start + n]
        self._pos += n
        return n

    def read_split(self, dest: memoryview, offset: int, most: int) -> list[tuple[memoryview, int]]:
        """Read ``[offset, offset + len(dest))`` into ``dest``: the parts in a partial chunk at
        either end now, and return the whole chunks between as ``(view, offset)`` pieces of at
        most ``most`` bytes (whole chunks), for :meth:`read_checked` -- which, unlike the rest
        of this class, may run on several threads at once."""
        end = offset + len(dest)
        if end > self.size:
            raise ChecksumError(f"{self.name_in_step} is shorter than its manifest says", self.name_in_step)
        first = -(-offset // self.chunk) * self.chunk
        last = max(first, end // self.chunk * self.chunk if end != self.size else end)
        if first >= end or last <= first:  # no whole chunk inside: one read through the held chunks
            self.seek(offset)
            self.readinto(dest)
            return []
        if first > offset:
            self.seek(offset)
            self.readinto(dest[: first - offset])
        if end > last:
            self.seek(last)
            self.readinto(dest[last - offset :])
        step = max(self.chunk, most // self.chunk * self.chunk)
        return [(dest[a - offset : min(a + step, last) - offset], a) for a in range(first, last, step)]

    def read_checked(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with whole chunks from ``offset`` (a chunk boundary; the file's short
        last chunk may end it), each checked. Thread-safe."""
        self._checked(view, offset, self._shared)

    def _checked(self, view: memoryview, offset: int, reader: Callable[[memoryview, int], int] | None = None) -> None:
        """Fill ``view`` (whole chunks from ``offset``, a chunk boundary) and check every chunk;
        a chunk that fails is read again from the fallback (the store, for a local copy)."""
        fill_exact(reader or self._pread_into, view, offset, self.name_in_step)
        for a in range(0, len(view), self.chunk):
            piece, k = view[a : a + self.chunk], (offset + a) // self.chunk
            if crc32c.crc32c(piece) == self.crcs[k]:
                continue
            if self._fallback is not None:
                log.warning("%s: checksum chunk %d of the local copy is bad; reading it from the store",
                            self.name_in_step, k)
                fill_exact(self._fallback(), piece, offset + a, self.name_in_step)
                if crc32c.crc32c(piece) == self.crcs[k]:
                    continue
            raise ChecksumError(f"{self.name_in_step}: checksum chunk {k} (bytes from {k * self.chunk}) "
                                "fails its CRC32C check", self.name_in_step)

    def close(self) -> None:
        if not self.closed:
            self._close()
            self._held.clear()
        super().close()


class CheckedFiles:
    """The ``FileSystemBase`` torch's ``FileSystemReader`` reads through: the files of one
    committed step (manifest ``man``) in the store (``root`` its path there, ``local=None``)
    or in a local staged copy (``local``, a directory), each a :class:`CheckedFile`; a bad
    chunk of a local copy is read again from the store. Only the manifest's files open."""

    def __init__(self, root: str, man: dict[str, Any], client: Any, local: str | None = None):
        self.root, self.client, self.local = root, client, local
        self.records = {rec["name"]: rec for rec in man["files"]}

    def init_path(self, path: Any) -> str:
        return str(path)

    def concat_path(self, path: Any, suffix: str) -> str:
        return posixpath.join(str(path), str(suffix))

    def exists(self, path: Any) -> bool:
        return posixpath.basename(str(path)) in self.records

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[CheckedFile]:
        if mode != "rb":
            raise io.UnsupportedOperation(f"a committed checkpoint is read-only (mode {mode!r})")
        name = posixpath.basename(str(path))
        rec = self.records.get(name)
        if rec is None:
            raise FileNotFoundError(f"{name} is not a file of the checkpoint at {self.root}")
        opened: list[Any] = []
        lock = threading.Lock()

        def store_file() -> Any:
            with lock:
                if not opened:
                    opened.append(self.client.open(posixpath.join(self.root, name), "rb"))
            return opened[0]

        def shared() -> Callable[[memoryview, int], int]:
            """The store's stateless, thread-safe read of the file."""
            f = store_file()
            return lambda dest, off: self.client.read_into(f.ino, f.layout, f.size, off, dest)

        def close() -> None:
            for x in opened:
                x.close()

        if self.local is not None:
            fd = os.open(os.path.join(self.local, name), os.O_RDONLY)

            def close_local() -> None:
                os.close(fd)
                close()

            f = CheckedFile(name, rec, lambda dest, off: os.preadv(fd, [dest], off), close_local, fallback=shared)
        else:
            f = CheckedFile(name, rec, store_file().pread_into, close, shared=shared())
        with f:
            yield f
