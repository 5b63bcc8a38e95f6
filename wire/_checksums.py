"""End-to-end checksums of read payloads: a torn or corrupted payload is an error, never data.

A ``ReadChunk`` reply carries the CRC32C of each *segment* of its payload: the
payload cut at the 64 KiB block boundaries of the chunk (the blocks whose CRCs the
storage server keeps in each chunk's header). A segment that is a whole stored
block is answered with the stored CRC (no pass over the data on the server); only
the partial segments at the two ends are computed. The client checks every
segment of what it received, so the check costs one CRC32C pass over the
payload (hardware CRC32C: ~15 GB/s) and no copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import crc32c

from ._errors import ErrorCode, StripefsError

__all__ = ["CRC_BLOCK", "segments", "check_segments"]

CRC_BLOCK = 64 * 1024  # the storage servers' checksum block


def segments(offset: int, length: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` offsets *in the chunk* of the payload's segments, in order."""
    end = offset + length
    while offset < end:
        cut = min(end, (offset // CRC_BLOCK + 1) * CRC_BLOCK)
        yield offset, cut
        offset = cut


def check_segments(payload: memoryview, offset: int, crcs: Sequence[int]) -> None:
    """Check a received payload (read at chunk ``offset``) against its segment CRCs.

    Raises:
        StripefsError: CHECKSUM when a segment differs or the count is wrong.
    """
    spans = list(segments(offset, len(payload)))
    if len(spans) != len(crcs):
        raise StripefsError(ErrorCode.CHECKSUM, f"reply carries {len(crcs)} checksums for {len(spans)} segments")
    for (s, e), want in zip(spans, crcs):
        if crc32c.crc32c(payload[s - offset : e - offset]) != want:
            raise StripefsError(ErrorCode.CHECKSUM, f"payload bytes {s - offset}..{e - offset} fail their checksum")
