"""The whole-file CRC32C combined from the per-chunk ones equals a direct pass (one pass, not two)."""

from __future__ import annotations

import os

import crc32c
import pytest

from stripefs.staging._format import chunk_crcs, crc_combine


@pytest.mark.parametrize("n", [0, 1, 4095, 1 << 16, (1 << 16) + 1, 5 * (1 << 16), 5 * (1 << 16) + 777])
def test_chunk_crcs_match_direct_crcs(n):
    data = os.urandom(n)
    total, crcs = chunk_crcs(memoryview(data), 1 << 16)
    assert total == crc32c.crc32c(data)
    assert crcs == [crc32c.crc32c(data[o : o + (1 << 16)]) for o in range(0, n, 1 << 16)]


def test_crc_combine():
    for la, lb in [(0, 0), (0, 5), (7, 0), (1000, 333), (1 << 16, 1 << 16)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert crc_combine(crc32c.crc32c(a), crc32c.crc32c(b), lb) == crc32c.crc32c(a + b), (la, lb)
