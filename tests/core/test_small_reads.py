"""Small reads (answered by each storage connection's reply thread) mixed with writes and
large reads on the same pooled connections: every answer holds exactly its bytes."""

from __future__ import annotations

import os
import random
import threading

from fsclient import Client
from tests.conftest import TEST_CHUNK


def test_small_reads_among_writes_and_large_reads_on_shared_connections(client: Client, testdir: str) -> None:
    data = os.urandom(TEST_CHUNK * 8)  # over every server of the shared cluster
    path = f"{testdir}/read.bin"
    with client.open(path, "wb") as f:
        f.write(data)
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with client.open(path, "rb") as f:
                for _ in range(150):
                    n = rng.choice((1, 100, 4096, 4096, 65536, TEST_CHUNK + 4096))  # small, and split large
                    off = rng.randrange(len(data) - n)
                    assert f.pread(n, off) == data[off : off + n]
        except BaseException as exc:
            errors.append(exc)

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        mine = f"{testdir}/w{seed}.bin"
        expect = bytearray()
        try:
            with client.open(mine, "wb") as f:
                for _ in range(20):
                    piece = rng.randbytes(rng.choice((512, 65536, 200_000)))
                    f.write(piece)
                    expect += piece
            with client.open(mine, "rb") as f:
                assert f.read() == bytes(expect)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=writer, args=(100 + i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
