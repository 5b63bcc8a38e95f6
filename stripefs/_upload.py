"""``stripefs put -r``: a local directory tree into the file system, many files at once.

The route of fsspec's ``put(recursive=True)``, with the files written in parallel: the
directories are made (parents first), every target file is created empty in batches of
200 (:meth:`Client.create_many`: one round trip and one metadata commit per batch), then
a pool of threads writes the files' bytes (each file: its chunks to every server at
once, one commit of its length at close). Per file that leaves the write and the commit
at close, overlapped across the pool, instead of a create, an open and a close in turn.

Caveats:
    * A target file that exists is overwritten (truncated first), as ``put`` of one file
      does; a target directory that exists is written into.
    * A failure part way (a local file that cannot be read, the store unreachable) leaves
      the targets not yet written empty: they were created up front. The failures are
      reported per file; the others are still written.
    * Symbolic links are followed to files; links to directories are not descended
      (``os.walk``); sockets, FIFOs and devices are skipped (and counted).
    * Files get mode 0o666 minus the umask, not the local file's mode.
"""

from __future__ import annotations

import os
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from stripefs.fsclient import Client
from stripefs.wire import Attr

__all__ = ["TreePlan", "plan_tree", "put_tree"]

COPY_BUFFER = 8 << 20  # bytes read from a local file at a time


@dataclass
class TreePlan:
    """What a tree upload will do: directories to make (parents first) and (local, remote) files."""

    dirs: list[str] = field(default_factory=list)
    files: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # local entries that are neither files nor directories
    size: int = 0


def plan_tree(src: str, dst: str) -> TreePlan:
    """Walk the local directory ``src``; its copy goes to the remote directory ``dst``."""
    plan = TreePlan(dirs=[dst])
    for root, dirnames, filenames in os.walk(src):
        dirnames.sort()
        rel = os.path.relpath(root, src)
        rdir = dst if rel == "." else posixpath.join(dst, *rel.split(os.sep))
        plan.dirs.extend(posixpath.join(rdir, d) for d in dirnames)
        for name in sorted(filenames):
            local = os.path.join(root, name)
            try:
                st = os.stat(local)
            except OSError:
                plan.skipped.append(local)  # a dangling link
                continue
            if not os.path.isfile(local):
                plan.skipped.append(local)
                continue
            plan.files.append((local, posixpath.join(rdir, name)))
            plan.size += st.st_size
    return plan


def put_tree(client: Client, plan: TreePlan, *, workers: int = 16,
             progress: Callable[[int], Any] | None = None) -> list[tuple[str, str, OSError]]:
    """Upload what ``plan`` lists; returns the files that failed, ``(local, remote, error)``.

    Raises:
        OSError: making a directory or creating the files failed (nothing was written).
    """
    for d in plan.dirs:
        client.makedirs(d, exist_ok=True)
    created = client.create_many([r for _, r in plan.files], 0o666, exclusive=True)
    failed: list[tuple[str, str, OSError]] = []
    lock = threading.Lock()

    def one(local: str, remote: str, got: Attr | OSError) -> None:
        try:
            if isinstance(got, Attr):
                dst = client.open_inode(got, name=remote, readable=False, writable=True)
            elif isinstance(got, FileExistsError):
                dst = client.open(remote, "wb")  # an existing file: truncated, as put of one file does
            else:
                raise got
            with open(local, "rb") as fin, dst:
                while chunk := fin.read(COPY_BUFFER):
                    dst.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
        except OSError as exc:
            with lock:
                failed.append((local, remote, exc))

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="stripefs-put") as pool:
        for (local, remote), got in zip(plan.files, created):
            pool.submit(one, local, remote, got)
    return failed

