"""A storage server killed mid-batch fails only its reads; steady state allocates nothing per byte."""

from __future__ import annotations

import errno
import gc
import os
import signal
import time
import tracemalloc

from fsclient.batchread import ReadRing, SharedBuffer

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
            os.kill(pid, signal.SIGSTOP)  # requests reach a live socket and stay unanswered ...
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
