"""Fixtures of the batch read tests: reference files written through the native client."""

from __future__ import annotations

import os
import random
from typing import Any, Iterator

import pytest

CHUNK = 256 * 1024  # tests/conftest.py TEST_CHUNK


@pytest.fixture(scope="session")
def files(cluster: Any) -> Iterator[dict[str, bytes]]:
    """Several files of awkward sizes (and one with holes): path -> expected bytes.

    Written once per session; tests only read them.
    """
    client = cluster.client()
    testdir = f"/batchread-{os.getpid()}"
    client.makedirs(testdir)
    rng = random.Random(5)
    out: dict[str, bytes] = {}
    for k, size in enumerate([0, 1, 100_000, CHUNK, 3 * CHUNK + 17, 1_500_000]):
        data = rng.randbytes(size)
        path = f"{testdir}/f{k}.bin"
        client.write_bytes(path, data)
        out[path] = data
    # Holes: chunks 0-1 never written, a tail extended by truncate.
    path = f"{testdir}/holes.bin"
    tail = rng.randbytes(CHUNK // 2)
    with client.open(path, "wb") as f:
        f.pwrite(tail, 2 * CHUNK + 1000)
    client.truncate(path, 4 * CHUNK)
    out[path] = bytes(2 * CHUNK + 1000) + tail + bytes(4 * CHUNK - (2 * CHUNK + 1000 + len(tail)))
    client.close()
    yield out
