"""Cuts (a truncate's RemoveChunks + TruncateChunk) are ordered with a chain's writes.

Writes go head -> tail under the head's chunk lock; a cut that reached the targets of a
chain in parallel, outside that order, could leave a replica unlike its head:

(a) a write applied at the head, the cut reaching the replica first: the forwarded write
    finds a version gap and copies the head's chunk from before the cut, then the head
    is cut; the replica keeps bytes the truncate dropped.
(b) the head cut first, then a new write recreating the chunk at version 1: the replica,
    still holding the old chunk at a later version, takes it for applied (or copies it),
    then its own cut removes it; the replica lacks acknowledged bytes.

Each is replayed deterministically in one process: real storage services on loopback,
a :class:`Membership` and the metadata service's :class:`Collector`, and hooks that hold
a forward or a local cut until the racing step happened (or a bounded wait passed: with
cuts ordered through the chain that step never comes, and the wait is all it costs).
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import crc32c
import trio

from stripefs.metadata._collector import Collector
from stripefs.metadata._membership import Membership
from stripefs.metadata._store import GarbageItem
from stripefs.rpc import serve_rpc
from stripefs.storage import ChunkStore
from stripefs.storage._replication import Replicator
from stripefs.storage._server import StorageService
from stripefs.wire import ErrorCode, Layout, StripefsError
from stripefs.wire import messages as m

SECRET = "cut-ordering-secret"
CHUNK = 256 * 1024
INO = 77


class _Meta:
    """The metadata service as storage servers see it here: the chain table, from ``mb``."""

    def __init__(self, mb: Membership) -> None:
        self.mb = mb

    async def call(self, msg: Any, payload: bytes = b"") -> tuple[dict, bytes]:
        assert isinstance(msg, m.GetRouting), msg
        return m.RoutingReply(routing=self.mb.routing()).to_header(), b""


class Cluster:
    def __init__(self, mb: Membership, repls: dict[int, Replicator]) -> None:
        self.mb, self.repls = mb, repls
        self.collector = Collector(None, lambda: mb, SECRET)  # type: ignore[arg-type]  # no store: _cut only

    def chain(self, head: int) -> int:
        """A chain that ``head`` heads."""
        return next(c for c, ts in sorted(self.mb.table.items()) if ts[0] == head)

    async def write(self, chain: int, offset: int, data: bytes, index: int = 0) -> m.WriteChunkReply:
        head = self.mb.routing().forward_order(chain)[0]
        msg = m.WriteChunk(ino=INO, index=index, offset=offset, crc=crc32c.crc32c(data), chunk_size=CHUNK,
                           chain=chain, routing_version=self.mb.version)
        return await self.repls[head].write(msg, memoryview(data))

    async def cut(self, chain: int, length: int) -> set[int]:
        return await self.collector._cut(GarbageItem(0, "truncate", INO, length, Layout(CHUNK, (chain,))))

    def chunk(self, sid: int, index: int = 0) -> tuple[int, bytes] | None:
        found = self.repls[sid].store.read_whole(INO, index)
        return None if found is None else (found[0].version, bytes(found[1]))


@asynccontextmanager
async def cluster(tmp_path: Path, servers: int = 2, replicas: int = 2) -> AsyncIterator[Cluster]:
    mb = Membership(None, replicas=replicas)
    meta = _Meta(mb)
    repls: dict[int, Replicator] = {}
    async with trio.open_nursery() as nursery:
        for k in range(servers):
            store = ChunkStore(str(tmp_path / f"s{k}"))
            repl = Replicator(store, SECRET, meta)  # type: ignore[arg-type]
            service = StorageService(store, repl)
            host, port = await nursery.start(functools.partial(serve_rpc, service, "127.0.0.1", 0, secret=SECRET))
            sid, _ = mb.register(m.RegisterServer(host=host, port=port, root=store.root, capacity=1 << 30, used=0,
                                                  pid=os.getpid(), token=f"{k + 1:02x}" * 32))
            mb.admit(sid)
            repl.server_id = sid
            repls[sid] = repl
        mb.freeze()
        for repl in repls.values():
            repl.routing = mb.routing()
        try:
            yield Cluster(mb, repls)
        finally:
            for repl in repls.values():
                repl.peers.close()
            nursery.cancel_scope.cancel()


def _version(repl: Replicator, index: int) -> int:
    meta = repl.store.stat(INO, index)
    return 0 if meta is None else meta.version


async def _until(pred: Callable[[], bool], timeout: float) -> bool:
    """Poll ``pred`` for up to ``timeout`` seconds; whether it came true."""
    with trio.move_on_after(timeout):
        while not pred():
            await trio.sleep(0.005)
        return True
    return False


def test_a_write_forwarded_after_the_replica_was_cut_does_not_bring_cut_bytes_back(tmp_path: Path) -> None:
    """(a): the head applied version 2, the cut reached the replica before the forward."""

    async def main() -> None:
        async with cluster(tmp_path) as cl:
            chain = cl.chain(1)
            head, replica = cl.repls[1], cl.repls[2]
            await cl.write(chain, 0, b"\xab" * 8192)  # version 1 everywhere
            forwarded = threading.Event()
            real_forward, real_remove = head._forward, head.store.remove

            async def held_forward(*args: Any) -> None:
                # Hold the forward until the replica was cut (never, with ordered cuts: 1 s).
                await _until(lambda: replica.store.stat(INO, 0) is None, 1.0)
                await real_forward(*args)
                forwarded.set()

            def held_remove(*args: Any, **kw: Any) -> int:
                forwarded.wait(3.0)  # the head is cut only once the forward went through
                return real_remove(*args, **kw)

            head._forward = held_forward  # type: ignore[method-assign]
            head.store.remove = held_remove  # type: ignore[method-assign]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cl.write, chain, 8192, b"\xcd" * 8192)  # version 2
                assert await _until(lambda: _version(head, 0) == 2, 5.0)
                missing = await cl.cut(chain, 0)
            assert missing == set()
            assert cl.chunk(1) is None
            assert cl.chunk(2) is None, "the replica kept bytes the truncate cut"

    trio.run(main)


def test_a_write_after_the_head_was_cut_is_not_lost_on_the_replica(tmp_path: Path) -> None:
    """(b): the head was cut, a new write recreated the chunk at version 1 there, and the
    replica (still at version 2) was cut only after that write was forwarded."""

    async def main() -> None:
        async with cluster(tmp_path) as cl:
            chain = cl.chain(1)
            head, replica = cl.repls[1], cl.repls[2]
            await cl.write(chain, 0, b"\xab" * 8192)
            await cl.write(chain, 8192, b"\xab" * 8192)  # version 2 everywhere
            rewritten = threading.Event()
            real_forward, real_remove = head._forward, replica.store.remove

            async def marked_forward(*args: Any) -> None:
                await real_forward(*args)
                rewritten.set()

            def held_remove(*args: Any, **kw: Any) -> int:
                rewritten.wait(1.0)  # the replica is cut only after the new write reached it
                return real_remove(*args, **kw)

            head._forward = marked_forward  # type: ignore[method-assign]
            replica.store.remove = held_remove  # type: ignore[method-assign]
            new = b"\xee" * 4096
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cl.cut, chain, 0)
                assert await _until(lambda: head.store.stat(INO, 0) is None, 5.0)
                await cl.write(chain, 0, new)  # acknowledged: every replica has it
            assert cl.chunk(1) == (1, new)
            assert cl.chunk(2) == (1, new), "the replica lost an acknowledged write"

    trio.run(main)


def test_a_resync_copy_fetched_before_a_cut_is_not_installed_after_it(tmp_path: Path) -> None:
    """A syncing replica's resync fetched a chunk from the head, then the cut went down the
    chain before the copy was installed: the copy must not bring the cut bytes back."""

    async def main() -> None:
        async with cluster(tmp_path) as cl:
            chain = cl.chain(1)
            head, syncing = cl.repls[1], cl.repls[2]
            cl.mb.take_offline(2)
            await cl.write(chain, 0, b"\xab" * 8192)  # on the head only
            assert cl.mb.heartbeat(m.Heartbeat(server_id=2, capacity=1 << 30, used=0, chunks=0,
                                               token="02" * 32)) == "syncing"
            assert cl.mb.routing().forward_order(chain) == [1, 2]
            fetched, cut_here = threading.Event(), threading.Event()
            real_replace, real_remove = syncing.store.replace, syncing.store.remove

            def held_replace(*args: Any, **kw: Any) -> Any:
                fetched.set()
                cut_here.wait(1.0)  # the copy lands after the cut reached this replica
                return real_replace(*args, **kw)

            def marked_remove(*args: Any, **kw: Any) -> int:
                n = real_remove(*args, **kw)
                cut_here.set()
                return n

            syncing.store.replace = held_replace  # type: ignore[method-assign]
            syncing.store.remove = marked_remove  # type: ignore[method-assign]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(syncing._resync_pass, 0.0)
                assert await _until(fetched.is_set, 5.0)
                assert await cl.cut(chain, 0) == set()
            assert cl.chunk(1) is None
            assert cl.chunk(2) is None, "the resync copy brought the cut bytes back"

    trio.run(main)


def test_a_replica_that_fails_a_cut_goes_offline_and_the_rest_of_the_chain_gets_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, servers=3, replicas=3) as cl:
            chain = cl.chain(1)
            assert cl.mb.routing().forward_order(chain) == [1, 2, 3]
            await cl.write(chain, 0, b"\xab" * 8192)
            await cl.write(chain, 0, b"\xab" * 8192, index=1)

            async def broken(msg: m.RemoveChunks) -> m.RemovedReply:
                raise StripefsError(ErrorCode.IO, "disk gone")

            cl.repls[2].cut = broken  # type: ignore[method-assign]
            assert await cl.cut(chain, 100) == set()
            assert cl.mb.servers[2].state == "offline"
            for sid in (1, 3):
                assert cl.chunk(sid) == (2, b"\xab" * 100), sid  # cut to 100 bytes: one more version
                assert cl.chunk(sid, 1) is None
            assert cl.chunk(2, 1) is not None  # it resyncs when back

    trio.run(main)
