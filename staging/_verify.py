"""Checks of a checkpoint's files in the store against what its manifest (or journal) records.

Two depths: sizes only (one ``stat`` per file: what ``latest()`` can afford for every
candidate step) and full (every byte read back and checked against the per-chunk and
whole-file CRC32Cs: what the mover does before it commits, and ``staging.verify``).

An upload whose bytes are still in memory (``keep_local=0``) is checked without reading it
back: :func:`stored_problem` asks every serving replica of every chunk for the CRC32Cs it
stored (one ``StatChunk`` each, no payload) and compares them with those of the bytes in
memory — a check of every replica, where a read-back sees one.
"""

from __future__ import annotations

import mmap
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import crc32c

from stripefs.wire import CRC_BLOCK, messages as m

from ._journal import FileRow

__all__ = ["file_problems", "rows_of", "stored_problem"]

READ_BLOCK = 16 << 20  # bytes read back per request when checksumming (rounded to whole checksum chunks)
READERS = 4            # files checked at once


def rows_of(records: Iterable[dict[str, Any]]) -> list[FileRow]:
    """The manifest's ``files[]`` records as journal rows (the one shape the checks take)."""
    return [FileRow(r["name"], r["size"], r["crc32c"], r["chunk"], list(r["chunk_crc32c"]), r["size"]) for r in records]


def file_problems(client: Any, root: str, files: list[FileRow], *, checksums: bool) -> dict[str, str]:
    """What is wrong with each file of ``files`` under ``root`` in the store.

    Args:
        client: an ``fsclient.Client``.
        root: the directory holding the files (a committed step or a partial upload).
        files: name, size, whole-file CRC32C, checksum chunk and per-chunk CRC32Cs of each file.
        checksums: also read every byte back and check the CRC32Cs (otherwise sizes only).

    Returns:
        ``{file name: reason}`` for every file that is missing, has another committed size,
        or (with ``checksums``) fails a CRC32C; empty when all are good.

    Raises:
        OSError: the store could not be asked (unreachable, ...); a missing file is a problem, not an error.
    """
    problems: dict[str, str] = {}
    for f in files:
        try:
            size = client.stat(posixpath.join(root, f.name)).size
        except FileNotFoundError:
            problems[f.name] = "missing"
            continue
        if size != f.size:
            problems[f.name] = f"committed size is {size} bytes, {f.size} recorded"
    if not checksums:
        return problems
    todo = [f for f in files if f.name not in problems]
    with ThreadPoolExecutor(max(1, min(READERS, len(todo)))) as pool:
        for f, reason in zip(todo, pool.map(lambda f: _checksum_problem(client, root, f), todo)):
            if reason:
                problems[f.name] = reason
    return problems


def _checksum_problem(client: Any, root: str, f: FileRow) -> str | None:
    """Read ``f`` back and compare its CRC32Cs; the reason it fails, or None."""
    block = max(f.chunk, READ_BLOCK // f.chunk * f.chunk)  # whole checksum chunks per read
    # Page-aligned: the kernel copies into a buffer 16 bytes off a page (a bytearray) ~6x slower.
    mem = mmap.mmap(-1, min(block, max(f.size, 1)))
    buf = memoryview(mem)
    total, off = 0, 0
    with client.open(posixpath.join(root, f.name), "rb") as sf:
        while off < f.size:
            want = min(len(buf), f.size - off)
            got = 0
            while got < want:
                # Every chunk of the block at once, straight into the buffer (no readahead copy).
                n = client.read_into(sf.ino, sf.layout, sf.size, off + got, buf[got:want])
                if not n:
                    return f"ends at {off + got} bytes, {f.size} recorded"
                got += n
            for k in range(0, want, f.chunk):
                piece = buf[k : min(k + f.chunk, want)]
                idx = (off + k) // f.chunk
                if idx >= len(f.chunk_crcs) or crc32c.crc32c(piece) != f.chunk_crcs[idx]:
                    return f"CRC32C mismatch in the chunk at offset {off + k}"
                total = crc32c.crc32c(piece, total)
            off += want
    if total != f.crc:
        return "whole-file CRC32C mismatch"
    return None


def stored_problem(client: Any, root: str, f: FileRow, data: memoryview) -> str | None:
    """Check ``f`` in the store against ``data``, the bytes uploaded (still in memory).

    Every serving replica of every chunk is asked for its length and the CRC32C of each
    64 KiB block it stored (``StatChunk``, in parallel); they must equal those of ``data``.
    The committed size must be ``f.size``.

    Returns:
        the reason the file fails, or None.

    Raises:
        OSError: the metadata service could not be asked (a replica that cannot is a problem).
    """
    reason = _stored_problem(client, root, f, data, refresh=False)
    if reason is not None and reason != "missing":
        # A replica may have moved since the routing was read (failover, resync): ask again.
        reason = _stored_problem(client, root, f, data, refresh=True)
    return reason


def _stored_problem(client: Any, root: str, f: FileRow, data: memoryview, refresh: bool) -> str | None:
    try:
        attr = client.stat(posixpath.join(root, f.name))
    except FileNotFoundError:
        return "missing"
    if attr.size != f.size or len(data) != f.size:
        return f"committed size is {attr.size} bytes, {f.size} recorded"
    cs = attr.layout.chunk_size
    chains = client.routing(refresh=refresh).chains
    jobs = []
    for index in range(-(-f.size // cs)):
        chunk = data[index * cs : min((index + 1) * cs, f.size)]
        want = [crc32c.crc32c(chunk[b : b + CRC_BLOCK]) for b in range(0, len(chunk), CRC_BLOCK)]
        servers = chains.get(attr.layout.chain_of(index), ())
        if not servers:
            return f"chunk {index}: its chain has no serving replica"
        jobs += [(index, server, len(chunk), want) for server in servers]

    def check(job: tuple[int, int, int, list[int]]) -> str | None:
        index, server, n, want = job
        try:
            got = client.call_storage(server, m.StatChunk(ino=attr.ino, index=index))
        except OSError as exc:  # StripefsError (NOT_FOUND: the chunk is missing), or unreachable
            return f"chunk {index} on server {server}: {exc}"
        if got.length != n or list(got.crcs) != want:
            return f"chunk {index} on server {server}: stored {got.length} bytes whose CRC32Cs differ from the upload's"
        return None

    with ThreadPoolExecutor(8) as pool:
        for reason in pool.map(check, jobs):
            if reason:
                return reason
    return None
