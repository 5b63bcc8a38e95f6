"""AsyncClient calls: metadata requests and one-chunk reads answered on the trio loop
without a worker thread per request, with the sync calls' errors and retries."""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest
import trio

from stripefs.fsclient import AsyncClient
from stripefs.fsclient.testing.procs import pause
from stripefs.wire import StripefsError, messages as m


def test_metadata_calls_need_no_worker_thread_each(client, testdir: str) -> None:
    client.write_bytes(f"{testdir}/f", b"abc")
    aio = AsyncClient(client, limiter=trio.CapacityLimiter(1))
    seen: list[int] = []

    async def main() -> None:
        await aio.call(m.Ping())  # connected (at most this once on a worker thread)
        d = await aio.attr(m.Resolve(path=testdir))
        # Every worker thread slot taken, the client's and trio's default ones (a
        # connect goes through the latter): a call that hops to a thread would hang.
        default = trio.to_thread.current_default_thread_limiter()
        default.total_tokens = 1
        async with aio.limiter, default:
            with trio.fail_after(10):
                for _ in range(20):
                    attr = await aio.attr(m.Lookup(parent=d.ino, name="f"))
                    seen.append(attr.size)
                    assert threading.current_thread() is threading.main_thread()
                with pytest.raises(FileNotFoundError):
                    await aio.call(m.Lookup(parent=d.ino, name="missing"))
                reply = await aio.call(m.StatMany(paths=[f"{testdir}/f", f"{testdir}/nope"]))
                assert [a.size for a in reply.attrs] == [3] and reply.failed == [1]

    trio.run(main)
    assert seen == [3] * 20


def test_async_calls_survive_a_broken_connection(client, testdir: str) -> None:
    aio = AsyncClient(client)

    async def main() -> None:
        await aio.call(m.Ping())
        client._core._meta_conn().close()  # as if the service had dropped us
        with trio.fail_after(30):
            assert (await aio.attr(m.Resolve(path=testdir))).is_dir

    trio.run(main)


def test_async_call_errors_are_typed(client) -> None:
    aio = AsyncClient(client)

    async def main() -> None:
        with pytest.raises(StripefsError) as info:
            await aio.call(m.StatMany(paths=["/"] * 201))
        assert isinstance(info.value, OSError)

    trio.run(main)


def _held(aio: AsyncClient):
    """Every worker-thread slot taken (the client's and trio's default one): a read
    that hops to a thread hangs."""
    default = trio.to_thread.current_default_thread_limiter()
    default.total_tokens = 1
    return aio.limiter, default


def test_one_chunk_reads_need_no_worker_thread_each(client, testdir: str) -> None:
    data = os.urandom(3 * 1024 * 1024 + 5000)
    client.write_bytes(f"{testdir}/f", data)
    attr = client.stat(f"{testdir}/f")
    cs = attr.layout.chunk_size
    aio = AsyncClient(client, limiter=trio.CapacityLimiter(1))
    rnd = random.Random(7)

    async def main() -> None:
        buf = bytearray(1 << 16)
        for c in range(0, attr.size, cs):  # every server's connection opened (a thread may do that once)
            await aio.read_into(attr.ino, attr.layout, attr.size, c, memoryview(buf)[:1])
        limiter, default = _held(aio)
        async with limiter, default:
            with trio.fail_after(10):
                for _ in range(40):
                    size = rnd.choice([1, 4096, 65536])
                    off = rnd.randrange(0, attr.size)
                    off -= max(0, off % cs + size - cs)  # within one chunk
                    n = await aio.read_into(attr.ino, attr.layout, attr.size, off, memoryview(buf)[:size])
                    assert bytes(buf[:n]) == data[off : off + size]
                    assert threading.current_thread() is threading.main_thread()
                # Past the end: nothing to read, nothing sent.
                assert await aio.read_into(attr.ino, attr.layout, attr.size, attr.size, memoryview(buf)) == 0
        # A read across a chunk boundary takes the worker thread (several requests).
        off = cs - 100
        n = await aio.read_into(attr.ino, attr.layout, attr.size, off, memoryview(buf)[:4096])
        assert bytes(buf[:n]) == data[off : off + 4096]

    trio.run(main)


def test_async_reads_zero_fill_holes_and_short_chunks(client, testdir: str) -> None:
    with client.open(f"{testdir}/sparse", "wb") as f:
        f.seek(1 << 20)
        f.write(b"end")
    attr = client.stat(f"{testdir}/sparse")
    aio = AsyncClient(client)

    async def main() -> None:
        buf = bytearray(b"\xff" * 8192)
        await aio.read_into(attr.ino, attr.layout, attr.size, attr.size - 3, memoryview(buf)[:3])
        assert bytes(buf[:3]) == b"end"
        n = await aio.read_into(attr.ino, attr.layout, attr.size, 4096, memoryview(buf))
        assert n == 8192 and bytes(buf) == bytes(8192)

    trio.run(main)


def test_async_reads_fall_back_when_their_connection_broke(client, testdir: str) -> None:
    data = os.urandom(100_000)
    client.write_bytes(f"{testdir}/f", data)
    attr = client.stat(f"{testdir}/f")
    aio = AsyncClient(client)

    async def main() -> None:
        buf = bytearray(4096)
        await aio.read_into(attr.ino, attr.layout, attr.size, 0, memoryview(buf))
        routing = client.routing()
        for sid in routing.chains[attr.layout.chain_of(0)]:
            info = routing.servers[sid]
            conn = client._core._data.live_one(sid, (info.host, info.port))
            if conn is not None:
                conn.close()  # as if the server had dropped us: the attempt fails, a thread retries
        with trio.fail_after(30):
            n = await aio.read_into(attr.ino, attr.layout, attr.size, 5000, memoryview(buf))
        assert bytes(buf[:n]) == data[5000:9096]

    trio.run(main)


def test_a_cancelled_async_read_never_lands_later(make_cluster) -> None:
    h = make_cluster(servers=1)
    client = h.client()
    try:
        data = os.urandom(200_000)
        client.write_bytes("/f", data)
        attr = client.stat("/f")
        aio = AsyncClient(client)
        pid = h.data["servers"][0]["pid"]
        buf = bytearray(65536)

        async def main() -> None:
            await aio.read_into(attr.ino, attr.layout, attr.size, 0, memoryview(buf))  # connected
            pause(pid)  # the request reaches a live socket and stays unanswered
            try:
                with trio.move_on_after(0.5) as scope:
                    await aio.read_into(attr.ino, attr.layout, attr.size, 1000, memoryview(buf))
                assert scope.cancelled_caught
                buf[:] = b"\xaa" * len(buf)  # the caller reuses its buffer at once
            finally:
                os.kill(pid, signal.SIGCONT)
            await trio.sleep(0.5)  # the server answers what it was sent before it stopped
            assert bytes(buf) == b"\xaa" * len(buf), "a cancelled read landed afterwards"
            with trio.fail_after(30):  # and the client reads on
                n = await aio.read_into(attr.ino, attr.layout, attr.size, 1000, memoryview(buf))
            assert bytes(buf[:n]) == data[1000 : 1000 + len(buf)]

        trio.run(main)
    finally:
        client.close()
