"""Zero-copy batch reads for dataloaders: the stripefs analogue of 3FS USRBIO.

Three concepts (see docs/read-api.md):

* a **buffer** (:class:`SharedBuffer`, the *iov*): page-aligned shared memory that
  reads land in, shared with DataLoader workers under fork and spawn, viewable
  as ``memoryview`` / numpy / torch without copies;
* a **ring** (:class:`ReadRing`, the *ior*): prepare many reads
  ``(buffer slice, file, offset, length, userdata)``, :meth:`~ReadRing.submit`
  them in one go, :meth:`~ReadRing.wait` for completions;
* a **completion** (:class:`Completion`): the read's ``userdata`` and its result,
  bytes read (short past EOF) or ``-errno`` with the error.

Files are registered by stripefs path (:meth:`ReadRing.open`) or by a path under
a stripefs FUSE mount (:meth:`ReadRing.open_mounted`, via :func:`resolve_mounted`).

    >>> import fsclient
    >>> from fsclient.batchread import ReadRing, SharedBuffer
    >>> client = fsclient.Client()
    >>> buf = SharedBuffer(64 << 20)
    >>> ring = ReadRing(client)
    >>> f = ring.open("/data/train.bin")
    >>> for j in range(64):
    ...     ring.prepare(buf.slice(j << 20, 1 << 20), f, j * 7 << 20, 1 << 20, userdata=j)
    >>> ring.submit()
    >>> done = ring.wait(64)
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any, Sequence

from ..fuse._mounts import MOUNT_STATE_DIR, mount_state_path
from ._buffer import SharedBuffer
from ._mounted import MountedFile, resolve_mounted
from ._ring import Completion, ReadRing, RegisteredFile, as_dest

if TYPE_CHECKING:
    from ..core import Client

__all__ = [
    "SharedBuffer",
    "ReadRing",
    "Completion",
    "RegisteredFile",
    "MountedFile",
    "resolve_mounted",
    "mount_state_path",
    "MOUNT_STATE_DIR",
    "read_batch",
]


def read_batch(client: "Client", reads: Sequence[tuple[str | RegisteredFile, int, int]], dest: Any = None,
               *, ring: ReadRing | None = None) -> tuple[Any, list[int]]:
    """Read many ``(file, offset, length)`` ranges into one buffer, back to back.

    Args:
        client: the cluster's client.
        reads: files as stripefs paths or :class:`RegisteredFile`.
        dest: where to put them (any writable buffer, a :class:`SharedBuffer`
            included, at least the total length); a new page-aligned anonymous
            ``mmap`` when None.
        ring: a ring to reuse (one is made and closed otherwise).

    Returns:
        ``(dest, counts)``: read ``j`` occupies ``dest[start_j : start_j + counts[j]]``
        where ``start_j`` is the sum of the *requested* lengths before it.

    Raises:
        StripefsError: the first failed read's error.
    """
    total = sum(n for _f, _o, n in reads)
    if dest is None:
        dest = mmap.mmap(-1, max(total, 1))
    view = as_dest(dest.view if isinstance(dest, SharedBuffer) else dest)
    own = ring is None
    r = ring or ReadRing(client, entries=max(len(reads), 1))
    try:
        files: dict[str, RegisteredFile] = {}
        planned = []
        pos = 0
        for f, off, n in reads:
            if not isinstance(f, RegisteredFile):
                f = files.get(f) or files.setdefault(f, r.open(f))
            planned.append((view[pos : pos + n], f, off, n))
            pos += n
        return dest, r.read(planned)
    finally:
        if own:
            r.close()
