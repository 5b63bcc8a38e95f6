"""``stripefs put -r``: a local directory tree into the file system, many files at once.

The directories are made (parents first); then the files go in batches of up to
:data:`BATCH_FILES` files and :data:`BATCH_BYTES` bytes, a few batches at once:
:meth:`Client.write_files` writes a batch's bytes to every server in parallel and then
commits the whole batch (names, inodes, lengths) in one metadata transaction per 200
files. A file larger than :data:`WHOLE_MAX` is streamed on its own (create, write,
commit at close) instead of being read into memory.

Caveats:
    * A target file that exists is rewritten in place (as ``open(path, "wb")``), found by
      one listing per target directory (no reservation is spent on it); a target
      directory that exists is written into.
    * A failure part way (a local file that cannot be read, the store unreachable)
      leaves no partial new file: a new file appears whole or not at all. The failures are
      reported per file; the others are still written.
    * Symbolic links are followed to files; links to directories are not descended
      (``os.walk``); sockets, FIFOs and devices are skipped (and counted).
    * New files get mode 0o666 minus the umask, not the local file's mode.
"""

from __future__ import annotations

import os
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from stripefs.fsclient import Client

__all__ = ["TreePlan", "plan_tree", "put_tree"]

COPY_BUFFER = 8 << 20  # bytes read from a local file at a time (files streamed on their own)
BATCH_FILES = 200  # files per write_files batch (one metadata commit)
BATCH_BYTES = 64 << 20  # bytes read into memory per batch, at most (one file larger is a batch alone)
WHOLE_MAX = 16 << 20  # a file larger than this is streamed, not read whole
BATCHES_AT_ONCE = 4  # batches in flight: local reads overlap the writes and commits


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
        OSError: making a directory failed (no file was written).
    """
    existing: set[str] = set()
    for d in plan.dirs:
        client.makedirs(d, exist_ok=True)
        existing.update(posixpath.join(d, name) for name in client.listdir(d))
    failed: list[tuple[str, str, OSError]] = []
    lock = threading.Lock()

    def fail(local: str, remote: str, exc: OSError) -> None:
        with lock:
            failed.append((local, remote, exc))

    def batch(pairs: list[tuple[str, str]]) -> None:
        files: list[tuple[str, bytes]] = []
        sources: list[str] = []
        for local, remote in pairs:
            try:
                with open(local, "rb") as fin:
                    files.append((remote, fin.read()))
                sources.append(local)
            except OSError as exc:
                fail(local, remote, exc)
        for local, (remote, data), got in zip(sources, files, client.write_files(files, mode=0o666)):
            if isinstance(got, OSError):
                fail(local, remote, got)
            elif progress is not None:
                progress(len(data))

    def stream(local: str, remote: str) -> None:
        try:  # a name that exists: opened with truncate at once (nothing to make at close)
            with open(local, "rb") as fin, client.open(remote, "wb", defer=remote not in existing) as dst:
                while chunk := fin.read(COPY_BUFFER):
                    dst.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
        except OSError as exc:
            fail(local, remote, exc)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, BATCHES_AT_ONCE)), thread_name_prefix="stripefs-put") as pool:
        pending: list[tuple[str, str]] = []
        held = 0
        for local, remote in plan.files:
            try:
                size = os.stat(local).st_size
            except OSError as exc:
                fail(local, remote, exc)
                continue
            if size > WHOLE_MAX or remote in existing:  # streamed, or rewritten in place
                pool.submit(stream, local, remote)
                continue
            if pending and (len(pending) >= BATCH_FILES or held + size > BATCH_BYTES):
                pool.submit(batch, pending)
                pending, held = [], 0
            pending.append((local, remote))
            held += size
        if pending:
            pool.submit(batch, pending)
    return failed
