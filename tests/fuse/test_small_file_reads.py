"""Small files read whole through the mount (issue #29): LOOKUP, OPEN, READ, FLUSH, RELEASE.

What the daemon sends per file, counted in-process (a :class:`StripeOperations` driven
directly, no kernel, attribute leases on): one metadata request (the leased ``Lookup``; the
OPEN takes its attributes), one storage request, sent at the read-only OPEN and taken by the
READ, and no worker-thread hop. And that the read sent at OPEN never serves bytes it must
not: a write through another handle of the mount before the READ, another client's rewrite
at the same size with the mtime set back, a failed request, an open closed without a READ.
"""

from __future__ import annotations

import os
import stat
import time
from concurrent.futures import Future
from typing import Any, Awaitable, Callable

import pyfuse3
import pytest
import trio

from stripefs.fsclient.fuse._loopreads import LoopRead
from stripefs.fsclient.fuse._operations import StripeOperations
from stripefs.wire import ErrorCode, StripefsError

from .test_small_file_path import Counted

pytestmark = pytest.mark.fuse

CTX = pyfuse3.RequestContext()  # uid 0, gid 0
SIZE = 100_000  # one chunk of the test cluster (256 KiB chunks)


class Reads:
    """Storage reads of a :class:`StripeOperations`: those sent from the loop as one request
    at OPEN (``started``: on the loop's own connection, ``loop`` of them, or on the
    client's, ``submit_planned``) and those the plain path sends (``aio.read_into``)."""

    def __init__(self, ops: StripeOperations) -> None:
        self.started = self.loop = self.plain = 0
        core, aio, loop = ops.client._core, ops.aio, ops.loop_reads
        submit, start, read_into = core.submit_planned, loop.start, aio.read_into

        def counted_submit(*args: Any, **kw: Any) -> Any:
            self.started += 1
            return submit(*args, **kw)

        def counted_start(*args: Any, **kw: Any) -> Any:
            read = start(*args, **kw)
            if read is not None:
                self.started += 1
                self.loop += 1
            return read

        async def counted_read_into(*args: Any, **kw: Any) -> Any:
            self.plain += 1
            return await read_into(*args, **kw)

        core.submit_planned, aio.read_into = counted_submit, counted_read_into  # type: ignore[method-assign]
        loop.start = counted_start  # type: ignore[method-assign]


async def connected(ops: StripeOperations) -> None:
    """Every storage server's loop connection open (else the first read of each goes the
    client's way while it connects)."""
    for info in ops.client.routing().servers.values():
        ops.loop_reads.connection(info.server_id, (info.host, info.port))
    with trio.fail_after(10):
        while not all(c.ready for c in ops.loop_reads.conns.values()):
            await trio.sleep(0.01)


def run_ops(ops: StripeOperations, fn: Callable[[], Awaitable[None]], loop: bool) -> None:
    """``fn`` on a trio loop, as the daemon runs the operations: with the loop's own
    storage connections (``loop``), or without (every read on the client's connections)."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            if loop:
                ops.loop_reads.attach(nursery)
                await connected(ops)
            await fn()
            nursery.cancel_scope.cancel()

    trio.run(main)


def failing_on_loop(plan: Any) -> LoopRead:
    """``LoopReads.start`` whose read failed (a connection lost under it)."""
    read = LoopRead(None, plan.dest, plan.check)  # type: ignore[arg-type]
    read._settle(None, StripefsError(ErrorCode.UNAVAILABLE, "injected"))
    return read


@pytest.fixture(params=["loop", "client"])
def loop(request: pytest.FixtureRequest) -> bool:
    """Reads at OPEN on the loop's own connections, or on the client's."""
    return request.param == "loop"


@pytest.fixture
def ops(cluster) -> Any:
    client = cluster.client()
    try:
        ops = StripeOperations(client)
        client.routing()  # the chain table, fetched once per client
        yield ops
    finally:
        client.close()


def _files(ops: StripeOperations, testdir: str, n: int) -> dict[bytes, bytes]:
    made = {b"f%d" % k: os.urandom(SIZE + k) for k in range(n)}
    for name, data in made.items():
        ops.client.write_bytes(f"{testdir}/{name.decode()}", data)
    return made


def _wait_leasing(ops: StripeOperations) -> None:
    kl = ops.kernel_leases
    assert kl is not None, "the daemon's lease watch is off"
    end = time.monotonic() + 10
    while not kl.asking and time.monotonic() < end:
        time.sleep(0.05)
    assert kl.asking


def test_a_small_file_costs_one_metadata_and_one_storage_request(ops: StripeOperations, testdir: str,
                                                                 loop: bool) -> None:
    """lookup, open (read-only), read, flush, release of files never seen: per file one
    ``Lookup`` (leased; the OPEN takes its attributes) -- after the second, the
    directory's listing under a lease, and no metadata request at all for the files after
    it (``_leaseddirs.py``) -- one storage request sent at the OPEN and taken by the READ
    (none at the READ), and no worker-thread hop."""
    made = _files(ops, testdir, 6)
    parent = ops.client.stat(testdir).ino
    _wait_leasing(ops)
    counted, reads = Counted(ops), Reads(ops)

    async def run() -> None:
        for k, (name, data) in enumerate(made.items()):
            counted.reset()
            reads.started = reads.plain = reads.loop = 0
            entry = await ops.lookup(parent, name, CTX)
            fi = await ops.open(entry.st_ino, os.O_RDONLY, CTX)
            assert not fi.keep_cache
            assert ops.files[entry.st_ino].ahead is not None  # sent at the OPEN
            assert reads.started == 1
            got = bytes(await ops.read(fi.fh, 0, 1 << 20))
            assert got == data
            assert bytes(await ops.read(fi.fh, 4096, 8192)) == data[4096:12288]  # from memory
            await ops.flush(fi.fh)
            await ops.release(fi.fh)
            want = ["Lookup"] if k == 0 else ["Lookup", "Readdir"] if k == 1 else []
            assert counted.calls == want and counted.sync_calls == [] and counted.hops == 0
            assert (reads.started, reads.plain, reads.loop) == (1, 0, int(loop))

    run_ops(ops, run, loop)


def test_a_write_through_another_handle_before_the_read_is_seen(ops: StripeOperations, testdir: str,
                                                                 loop: bool) -> None:
    """The read sent at a read-only OPEN is of the bytes before a write through another
    handle of this mount; the READ after that write returns the written bytes."""
    data = _files(ops, testdir, 1)[b"f0"]
    ino = ops.client.stat(f"{testdir}/f0").ino

    async def run() -> None:
        reader = await ops.open(ino, os.O_RDONLY, CTX)
        assert ops.files[ino].ahead is not None
        writer = await ops.open(ino, os.O_RDWR, CTX)
        assert await ops.write(writer.fh, 10, b"WRITTEN") == 7
        want = data[:10] + b"WRITTEN" + data[17:]
        assert bytes(await ops.read(reader.fh, 0, 1 << 20)) == want
        await ops.flush(writer.fh)
        await ops.release(writer.fh)
        assert bytes(await ops.read(reader.fh, 0, 1 << 20)) == want
        await ops.flush(reader.fh)
        await ops.release(reader.fh)

    run_ops(ops, run, loop)
    assert ops.client.read_bytes(f"{testdir}/f0") == data[:10] + b"WRITTEN" + data[17:]


def test_an_open_without_a_read_and_a_failed_read_ahead(ops: StripeOperations, testdir: str, monkeypatch,
                                                        loop: bool) -> None:
    """An OPEN closed without a READ (its read may still be in flight) leaves nothing behind
    that a later open reads; a read sent at OPEN that fails is read again the plain way."""
    data = _files(ops, testdir, 1)[b"f0"]
    ino = ops.client.stat(f"{testdir}/f0").ino
    core = ops.client._core

    async def run() -> None:
        for _ in range(20):  # stat-like opens: no READ
            ops.cached.pop(ino, None)  # the kernel holds no pages of it (evicted): its read is sent
            fi = await ops.open(ino, os.O_RDONLY, CTX)
            assert ops.files[ino].ahead is not None
            await ops.flush(fi.fh)
            await ops.release(fi.fh)
        ops.cached.pop(ino, None)
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        assert bytes(await ops.read(fi.fh, 0, 1 << 20)) == data
        await ops.release(fi.fh)

        def failing(*args: Any, **kw: Any) -> Any:
            fut: Future = Future()
            fut.set_exception(StripefsError(ErrorCode.UNAVAILABLE, "injected"))
            return fut, lambda reply: SIZE

        if loop:
            monkeypatch.setattr(ops.loop_reads, "start", failing_on_loop)
        else:
            monkeypatch.setattr(core, "submit_planned", failing)
        ops.cached.pop(ino, None)
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        assert ops.files[ino].ahead is not None
        assert bytes(await ops.read(fi.fh, 0, 1 << 20)) == data
        await ops.release(fi.fh)

    run_ops(ops, run, loop)


def test_a_first_read_without_a_read_at_open_reads_the_file_whole(ops: StripeOperations, testdir: str,
                                                                  monkeypatch, loop: bool) -> None:
    """A file opened for reading and writing (nothing sent at its OPEN): its first READ reads
    it whole, on the loop's connection when the loop has one, and the next READ is answered
    from memory; one that fails on the loop's connection is read the plain way."""
    made = _files(ops, testdir, 2)
    reads = Reads(ops)

    async def run() -> None:
        for k, (name, data) in enumerate(made.items()):
            ino = ops.client.stat(f"{testdir}/{name.decode()}").ino
            if k == 1 and loop:
                monkeypatch.setattr(ops.loop_reads, "start", failing_on_loop)
            reads.started = reads.plain = reads.loop = 0
            fi = await ops.open(ino, os.O_RDWR, CTX)
            assert ops.files[ino].ahead is None
            assert bytes(await ops.read(fi.fh, 0, 1 << 20)) == data
            assert bytes(await ops.read(fi.fh, 100, 50)) == data[100:150]
            await ops.flush(fi.fh)
            await ops.release(fi.fh)
            assert (reads.loop, reads.plain) == ((1, 0) if loop and k == 0 else (0, 1))

    run_ops(ops, run, loop)


def test_a_random_read_of_a_big_file_is_one_request_on_the_loop(ops: StripeOperations, testdir: str,
                                                                loop: bool) -> None:
    """Page-cache mode: a read at an offset no readahead window holds, within one chunk, is
    one request -- on the loop's connection when the loop has one; a read across chunks
    goes the client's way. The bytes are the file's either way."""
    data = os.urandom(3 << 20)
    ops.client.write_bytes(f"{testdir}/big", data)
    attr = ops.client.stat(f"{testdir}/big")
    cs = attr.layout.chunk_size
    reads = Reads(ops)

    async def run() -> None:
        fi = await ops.open(attr.ino, os.O_RDONLY, CTX)
        assert ops.files[attr.ino].ahead is None  # too big to be read whole at OPEN
        for off, size in ((4 * cs + 12345, 65536), (7 * cs - 1000, 4096), (9 * cs + 5, 8192)):
            reads.loop = reads.plain = 0
            assert bytes(await ops.read(fi.fh, off, size)) == data[off:off + size]
            one_chunk = off // cs == (off + size - 1) // cs
            assert (reads.loop, reads.plain) == ((1, 0) if loop and one_chunk else (0, 1))
        await ops.release(fi.fh)

    run_ops(ops, run, loop)


def test_a_rewrite_elsewhere_is_read_at_the_next_open(ops: StripeOperations, testdir: str, loop: bool) -> None:
    """Another client rewrites the file at the same size and sets the mtime back after this
    mount read it: the next open drops the kernel's pages and its read sent at OPEN
    returns the new bytes (a rewrite while it is open here: the open after it does)."""
    path = f"{testdir}/f0"
    old = _files(ops, testdir, 1)[b"f0"]
    ino = ops.client.stat(path).ino
    before = ops.client.stat(path)

    async def run() -> None:
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        assert bytes(await ops.read(fi.fh, 0, 1 << 20)) == old
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
        for k in range(2):
            new = bytes([65 + k]) * len(old)
            held = await ops.open(ino, os.O_RDONLY, CTX) if k else None  # open here meanwhile
            ops.client.write_bytes(path, new)
            ops.client.utime(path, (before.atime_ns, before.mtime_ns))
            assert ops.client.stat(path).mtime_ns == before.mtime_ns
            fi = await ops.open(ino, os.O_RDONLY, CTX)
            assert not fi.keep_cache
            assert bytes(await ops.read(fi.fh, 0, 1 << 20)) == new
            await ops.release(fi.fh)
            if held is not None:
                await ops.release(held.fh)

    run_ops(ops, run, loop)


def test_through_the_mount_a_rewrite_at_the_same_size_and_mtime_is_seen(mdir: str, client, testdir: str) -> None:
    """Through the kernel: files of one chunk read whole, rewritten elsewhere at the same
    size with the mtime set back, read again: the new bytes, every time."""
    for k in range(5):
        path = f"{testdir}/g{k}"
        client.write_bytes(path, b"o" * (SIZE + k))
        before = client.stat(path)
        with open(f"{mdir}/g{k}", "rb") as f:
            assert f.read() == b"o" * (SIZE + k)
        client.write_bytes(path, b"N" * (SIZE + k))
        client.utime(path, (before.atime_ns, before.mtime_ns))
        with open(f"{mdir}/g{k}", "rb") as f:
            assert f.read() == b"N" * (SIZE + k)
        st = os.stat(f"{mdir}/g{k}")
        assert stat.S_ISREG(st.st_mode) and st.st_size == SIZE + k
