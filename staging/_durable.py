"""Publishing a local directory durably (the one place staging fsyncs directories), and the
process umask that every file and directory staging creates, locally or in the store, obeys.

A rename is durable only once the directory that holds the new name is fsynced, and the
entries of a directory about to be renamed into place are durable only once *it* is
fsynced; fsyncing the files alone leaves a crash free to lose either.
"""

from __future__ import annotations

import os

__all__ = ["fsync_dir", "process_umask", "publish_dir"]


def fsync_dir(path: str) -> None:
    """fsync a directory: makes its entries (creations, renames into it) durable.

    Raises:
        OSError: ``path`` is not an openable directory, or the fsync failed.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: str, final: str) -> None:
    """Rename the finished directory ``tmp`` to ``final`` durably (its files already fsynced).

    fsyncs ``tmp`` (its entries), renames, then fsyncs the parent of ``final`` (the rename).

    Raises:
        OSError: from the rename (e.g. ``final`` is a non-empty directory) or an fsync.
    """
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def process_umask() -> int:
    """The process umask, read without changing it.

    ``os.umask`` can only be read by setting it, which would briefly give any other thread
    creating a file a umask of 0; Linux reports it in ``/proc/self/status`` instead.
    """
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # no /proc (not Linux, or an old kernel): the racy way
    os.umask(old)
    return old
