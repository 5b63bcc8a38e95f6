"""A storage server killed mid-batch fails only its reads; steady state allocates nothing per byte."""

from __future__ import annotations

import errno
import gc
import os
import signal
import time
import tracemalloc
from typing import Any

import pytest

from stripefs.fsclient.batchread import ReadRing, SharedBuffer
from stripefs.fsclient.testing.procs import pause
from stripefs.storage import HEADER_SIZE, chunk_files
from stripefs.wire import ErrorCode, StripefsError

CHUNK = 256 * 1024


def test_server_killed_mid_batch_fails_only_its_reads(make_cluster) -> None:
    h = make_cluster(servers=4)
    client = h.client()
    try:
        data = os.urandom(16 * CHUNK)
        client.write_bytes("/big.bin", data)
        ring = ReadRing(client, retries=1)
        f = ring.open("/big.bin")
        routing = client.routing()
        server_of = [routing.chains[f.layout.chain_of(i)][0] for i in range(16)]
        victim = server_of[0]
        port = routing.servers[victim].port
        pid = next(s["pid"] for s in h.data["servers"] if s["port"] == port)
        with SharedBuffer(16 * CHUNK) as buf:
            ring.read([(buf.slice(i * CHUNK, CHUNK), f, i * CHUNK, CHUNK) for i in range(16)])  # warm connections
            pause(pid)  # requests reach a live socket and stay unanswered ...
            try:
                for i in range(16):
                    ring.prepare(buf.slice(i * CHUNK, CHUNK), f, i * CHUNK, CHUNK, i)
                ring.submit()
                time.sleep(0.3)
            finally:
                os.kill(pid, signal.SIGKILL)  # ... until the server dies with them in flight
                os.kill(pid, signal.SIGCONT)
            done = {}
            while len(done) < 16:
                got = ring.wait(16 - len(done), timeout=60)
                assert got, "reads hang after the server died"
                done.update((c.userdata, c) for c in got)
            for i in range(16):
                c = done[i]
                if server_of[i] == victim:
                    assert c.error is not None and c.result == -errno.EHOSTUNREACH
                    msg = str(c.error)
                    assert "/big.bin" in msg and f"chunk {i}" in msg and f"server {victim}" in msg
                else:
                    assert c.error is None and c.result == CHUNK
                    assert buf.view[i * CHUNK : (i + 1) * CHUNK] == data[i * CHUNK : (i + 1) * CHUNK]
    finally:
        client.close()


def test_steady_state_allocates_no_payload_memory(client, files) -> None:
    path = max(files, key=lambda p: len(files[p]))
    batch, sample = 32, 256 * 1024
    ring = ReadRing(client, entries=batch)
    f = ring.open(path)
    offsets = [(j * 40_000) % (len(files[path]) - sample) for j in range(batch)]
    with SharedBuffer(batch * sample) as buf:
        slots = [buf.slice(j * sample, sample) for j in range(batch)]

        def one_batch() -> None:
            for j in range(batch):
                ring.prepare(slots[j], f, offsets[j], sample, j)
            ring.submit()
            left = batch
            while left:
                left -= len(ring.wait(left, timeout=30))

        for _ in range(5):
            one_batch()
        # rpc futures and their pending records form a reference cycle (future.pending
        # <-> pending.future): collect cycles so both snapshots see the steady state.
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            tracemalloc.reset_peak()
            rounds = 20
            for _ in range(rounds):
                one_batch()
            _cur, peak = tracemalloc.get_traced_memory()
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
        moved = rounds * batch * sample  # 160 MiB went through the ring
        assert growth < 64 * 1024, f"memory grew by {growth} bytes over {rounds} batches"
        assert peak < batch * sample // 2, f"peak traced memory {peak} suggests payload copies"
        assert moved > 40 * peak
        assert buf.view[:sample] == files[path][offsets[0] : offsets[0] + sample]


def _pid_of(h, client, sid: int) -> int:
    port = client.routing().servers[sid].port
    return next(s["pid"] for s in h.data["servers"] if s["port"] == port)


def test_a_timed_out_ring_is_reusable_and_stale_reads_never_land(make_cluster) -> None:
    h = make_cluster(servers=2)
    client = h.client()
    try:
        data = os.urandom(8 * CHUNK)
        client.write_bytes("/f", data)
        ring = ReadRing(client, entries=16)
        f = ring.open("/f")
        victim = client.routing().chains[f.layout.chain_of(0)][0]
        pid = _pid_of(h, client, victim)
        chunks = [data[i * CHUNK : (i + 1) * CHUNK] for i in range(8)]
        marker = b"\xaa" * (8 * CHUNK)
        with SharedBuffer(16 * CHUNK) as buf:
            ring.read([(buf.slice(i * CHUNK, CHUNK), f, i * CHUNK, CHUNK) for i in range(8)])  # warm connections
            # read(timeout=) gives up while a stopped server holds some pieces ...
            pause(pid)
            try:
                with pytest.raises(StripefsError) as info:
                    ring.read([(buf.slice(i * CHUNK, CHUNK), f, i * CHUNK, CHUNK) for i in range(8)], timeout=0.5)
                assert info.value.code == ErrorCode.TIMEOUT
                buf.view[: 8 * CHUNK] = marker  # ... and the caller reuses its buffer at once
            finally:
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.5)  # the server answers what it was sent before it stopped
            assert buf.view[: 8 * CHUNK] == marker, "a read that timed out landed afterwards"
            # The ring is reusable: the next read() counts only its own reads.
            counts = ring.read([(buf.slice((8 + i) * CHUNK, CHUNK), f, (7 - i) * CHUNK, CHUNK) for i in range(8)],
                               timeout=30)
            assert counts == [CHUNK] * 8 and buf.view[8 * CHUNK :] == b"".join(reversed(chunks))

            # The same with prepare/submit/wait: a batch given up on is cancelled, and the
            # next batch (same userdata, same buffer slices) sees only its own completions.
            pause(pid)
            try:
                for i in range(8):
                    ring.prepare(buf.slice(i * CHUNK, CHUNK), f, i * CHUNK, CHUNK, userdata=i)
                ring.submit()
                first = ring.wait(8, timeout=0.5)
                assert 0 < len(first) < 8 and len({c.generation for c in first}) == 1
                assert ring.cancel() == 8 - len(first) and ring.in_flight == 0
                buf.view[: 8 * CHUNK] = marker
            finally:
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.5)
            assert buf.view[: 8 * CHUNK] == marker, "a cancelled read landed afterwards"
            for i in range(8):
                ring.prepare(buf.slice(i * CHUNK, CHUNK), f, (7 - i) * CHUNK, CHUNK, userdata=i)
            ring.submit()
            done: dict[int, Any] = {}
            while len(done) < 8:
                got = ring.wait(8 - len(done), timeout=30)
                assert got, "reads hang after a cancel"
                for c in got:
                    assert c.userdata not in done and c.error is None and c.result == CHUNK
                    done[c.userdata] = c
            assert {c.generation for c in done.values()} == {first[0].generation + 1}
            assert buf.view[: 8 * CHUNK] == b"".join(reversed(chunks)) and ring.in_flight == 0
    finally:
        client.close()


def test_ring_spreads_reads_over_replicas_and_fails_over_on_a_bad_checksum(make_cluster) -> None:
    h = make_cluster(servers=3, replicas=2)
    client = h.client()
    try:
        data = os.urandom(12 * CHUNK)
        client.write_bytes("/clean", data)
        client.write_bytes("/bad", data)
        sent: list[tuple[int, int]] = []  # (server, chain) of every piece the ring sends
        real = client.data_connection

        class Recording:
            def __init__(self, sid: int) -> None:
                self.sid, self.conn = sid, real(sid)

            def submit(self, msg: Any, *args: Any, **kw: Any) -> Any:
                sent.append((self.sid, msg.chain))
                return self.conn.submit(msg, *args, **kw)

        client.data_connection = Recording  # type: ignore[method-assign]
        ring = ReadRing(client)
        routing = client.routing()
        with SharedBuffer(12 * CHUNK) as buf:
            f = ring.open("/clean")
            assert ring.read([(buf.slice(i * CHUNK, CHUNK), f, i * CHUNK, CHUNK) for i in range(12)]) == [CHUNK] * 12
            assert buf.view[:] == data
            # As the native client: chunks spread over every replica of their chain, not only the head.
            assert any(sid != routing.chains[chain][0] for sid, chain in sent)
            # A replica whose copy fails its checksum is read around (the next replica serves it).
            ino = client.stat("/bad").ino
            for name in chunk_files(h.data["servers"][0]["root"], ino):
                with open(name, "r+b") as fh:
                    fh.seek(HEADER_SIZE + 100)
                    b = fh.read(1)
                    fh.seek(HEADER_SIZE + 100)
                    fh.write(bytes([b[0] ^ 0xFF]))
            f = ring.open("/bad")
            for _ in range(2):
                buf.view[:] = bytes(12 * CHUNK)
                assert ring.read([(buf.slice(i * CHUNK, CHUNK), f, i * CHUNK, CHUNK) for i in range(12)],
                                 timeout=60) == [CHUNK] * 12
                assert buf.view[:] == data
    finally:
        client.close()
