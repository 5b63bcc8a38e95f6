"""AsyncClient metadata calls: answered on the trio loop without a worker thread per
request, with the sync call's errors and retries."""

from __future__ import annotations

import threading

import pytest
import trio

from fsclient import AsyncClient
from wire import StripefsError, messages as m


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
