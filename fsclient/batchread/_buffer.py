"""The registered buffer of the batch read path: page-aligned shared memory.

A :class:`SharedBuffer` is the analogue of a 3FS *iov*: one block of shared
memory that reads land in. It is created once (``SharedBuffer(nbytes)``) and
shared with DataLoader workers:

* **fork**: the child inherits the mapping itself; nothing to do;
* **spawn** (or any pickling): the buffer pickles as its name and size, and the
  receiving process maps the same ``/dev/shm`` segment.

Only the creating process owns the segment (``unlink()`` removes it; Python's
resource tracker removes it if the owner dies). Processes that attach map the
file directly instead of going through ``SharedMemory(name)``, because on
Python < 3.13 attaching registers the segment with the resource tracker a
second time and the tracker would unlink it when the *attaching* process exits.
"""

from __future__ import annotations

import mmap
import os
from multiprocessing import shared_memory
from typing import Any

from stripefs.wire import ErrorCode, StripefsError

__all__ = ["SharedBuffer"]

PAGE = mmap.PAGESIZE
_SHM_DIR = "/dev/shm"


class SharedBuffer:
    """Page-aligned shared memory, viewable as memoryview, numpy array or tensor without copies.

    Args:
        nbytes: size in bytes (rounded up to whole pages).
        name: attach to an existing segment of this name instead of creating one.

    Raises:
        StripefsError: INVALID for a non-positive size; NOT_FOUND when ``name``
            names no segment.

    Caveats:
        * The creating process should :meth:`unlink` (or use ``with``); if it dies
          first, Python's resource tracker removes the segment.
        * Views (memoryview, numpy, tensors) keep the mapping alive after
          :meth:`close` until they are dropped.
        * Linux only (``/dev/shm``).
    """

    def __init__(self, nbytes: int = 0, *, name: str | None = None):
        self._shm: shared_memory.SharedMemory | None = None
        self.owner = name is None
        if name is None:
            if not isinstance(nbytes, int) or nbytes <= 0:
                raise StripefsError(ErrorCode.INVALID, f"buffer size must be a positive int, got {nbytes!r}")
            size = -(-nbytes // PAGE) * PAGE
            # SharedMemory creates the segment and registers it with the resource
            # tracker (removed if this process dies); we map it ourselves and close
            # its own mapping, so garbage collection never trips over our views.
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            self.name: str = self._shm.name
            self._mmap: mmap.mmap = _attach(self.name)
            self._shm.close()
        else:
            self.name = name
            self._mmap = _attach(name)
        self.size = len(self._mmap)
        self._view = memoryview(self._mmap)
        self.pid = os.getpid()

    @classmethod
    def attach(cls, name: str) -> "SharedBuffer":
        """Map an existing buffer created by another process."""
        return cls(name=name)

    # -- views (no copies) ------------------------------------------------------------------
    @property
    def view(self) -> memoryview:
        """The whole buffer as a writable ``memoryview`` of bytes."""
        return self._view

    def slice(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` as a memoryview. Raises RANGE outside the buffer."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise StripefsError(ErrorCode.RANGE, f"slice [{offset}, {offset + length}) outside a {self.size}-byte buffer")
        return self._view[offset : offset + length]

    def numpy(self, dtype: Any = "uint8", offset: int = 0, count: int = -1) -> Any:
        """A numpy array over the buffer (``numpy.frombuffer``: shares the memory)."""
        import numpy as np

        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset)

    def tensor(self, dtype: Any = None, offset: int = 0, count: int = -1) -> Any:
        """A ``torch.Tensor`` over the buffer (``torch.frombuffer``: shares the memory)."""
        import torch

        return torch.frombuffer(self._mmap, dtype=dtype or torch.uint8, count=count, offset=offset)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self, *, strict: bool = False) -> None:
        """Unmap this process's mapping (other processes keep theirs).

        While views (slices, arrays, tensors) are alive the mapping stays until
        the last one is dropped; ``strict=True`` raises instead.

        Raises:
            BufferError: views are still alive and ``strict``.
        """
        try:
            self._view.release()
            self._mmap.close()
        except BufferError:
            if strict:
                raise

    def unlink(self) -> None:
        """Remove the segment's name (creating process only); mappings stay valid until closed."""
        if self._shm is not None and os.getpid() == self.pid:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> "SharedBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.unlink()
        self.close()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # spawn workers get the name and map the same segment.
        return (_attach_buffer, (self.name,))

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"SharedBuffer(name={self.name!r}, size={self.size}, owner={self.owner})"


def _attach_buffer(name: str) -> SharedBuffer:
    return SharedBuffer(name=name)


def _attach(name: str) -> mmap.mmap:
    if "/" in name or not name:
        raise StripefsError(ErrorCode.INVALID, f"bad shared memory name {name!r}")
    try:
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
    except FileNotFoundError as exc:
        raise StripefsError(ErrorCode.NOT_FOUND, f"no shared buffer named {name!r}") from exc
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
