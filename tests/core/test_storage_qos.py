"""Quality of service in a storage server (storage/_qos.py): bulk chunk writes share a
few worker slots at idle I/O priority; small writes and reads keep theirs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import crc32c
import pytest
import trio

from stripefs import wire
from stripefs.storage import ChunkStore
from stripefs.storage import _qos
from stripefs.storage._replication import Replicator
from stripefs.wire import messages as m

CHUNK = 4 << 20


def _ioprio_class() -> int:
    assert _qos._IOPRIO is not None
    libc, _set, get = _qos._IOPRIO
    return libc.syscall(get, 1, 0) >> 13


@pytest.mark.skipif(_qos._IOPRIO is None, reason="ioprio syscalls are Linux x86_64/aarch64 only")
def test_a_bulk_write_runs_at_idle_io_priority_and_puts_it_back() -> None:
    seen: list[tuple[int, int, int]] = []

    def thread() -> None:
        before = _ioprio_class()
        with _qos.idle_io(_qos.BULK_WRITE):
            during = _ioprio_class()
        with _qos.idle_io(64 << 10):  # a small write keeps the default class
            small = _ioprio_class()
        seen.append((before, during, small, _ioprio_class()))  # type: ignore[arg-type]

    t = threading.Thread(target=thread)
    t.start()
    t.join(10)
    before, during, small, after = seen[0]  # type: ignore[misc]
    assert during == 3  # IOPRIO_CLASS_IDLE
    assert small == before and after == before


def test_bulk_writes_share_few_slots_and_small_writes_pass_them(tmp_path: Path) -> None:
    store = ChunkStore(str(tmp_path))
    repl = Replicator(store, "secret", None)  # type: ignore[arg-type]  # no metadata calls here
    repl.server_id = 1
    repl.routing = wire.Routing(1, {1: (1,)}, {1: wire.ServerInfo(1, "127.0.0.1", 1)}, {1: ((1, "serving"),)}, 1)
    running, peak, finished = [0], [0], []
    lock = threading.Lock()
    real_write = store.write

    def slow_write(ino, index, offset, data, *rest):  # type: ignore[no-untyped-def]
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0]) if len(data) >= _qos.BULK_WRITE else peak[0]
        try:
            if len(data) >= _qos.BULK_WRITE:
                time.sleep(0.2)  # a bulk chunk's write and fdatasync
            return real_write(ino, index, offset, data, *rest)
        finally:
            with lock:
                running[0] -= 1
                finished.append(ino)

    store.write = slow_write  # type: ignore[method-assign]
    big, small = os.urandom(2 << 20), os.urandom(4096)

    async def one(ino: int, data: bytes) -> None:
        msg = m.WriteChunk(ino=ino, index=0, offset=0, crc=crc32c.crc32c(data), chunk_size=CHUNK, chain=1,
                           routing_version=1)
        await repl.write(msg, memoryview(data))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for ino in range(10, 16):
                nursery.start_soon(one, ino, big)
            await trio.sleep(0.05)
            nursery.start_soon(one, 99, small)

    trio.run(main)
    assert peak[0] == _qos.BULK_SLOTS, f"{peak[0]} bulk writes ran at once"
    assert finished.index(99) < 3, "a small write waited for the bulk writes' slots"
    assert sorted(store.read_whole(i, 0)[1] == big for i in range(10, 16)) == [True] * 6

