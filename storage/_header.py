"""A chunk file's header (storage/_chunks.py describes the layout) and its in-memory form,
:class:`ChunkMeta`, which chunks in container logs (storage/_small.py) share."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import crc32c

from stripefs.wire import CRC_BLOCK, ErrorCode, MAX_CHUNK, StripefsError

HEADER_SIZE = 8192
BLOCK = CRC_BLOCK  # 64 KiB: the unit of a stored CRC32C (shared with the read-reply checks)
MAGIC = b"SFCHUNK1"
_HDR = struct.Struct("!8sQQIIQ")
_CRC_OFF = 64
MAX_BLOCKS = (HEADER_SIZE - _CRC_OFF) // 4
assert MAX_CHUNK // BLOCK <= MAX_BLOCKS


def _crc(data: memoryview | bytes) -> int:
    return crc32c.crc32c(data)


@dataclass(slots=True)
class ChunkMeta:
    version: int = 0
    length: int = 0
    crcs: list[int] = field(default_factory=list)
    verified: int = 0  # bitmask of blocks verified since the file last changed
    mtime_ns: int = 0  # file mtime when verified/written by us
    chain: int = 0

    @property
    def digest(self) -> int:
        """CRC32C over the length and the block CRCs: equal chunks have equal digests.

        Versions alone cannot tell replicas apart: a head that applied a write and
        died before forwarding it comes back with bytes at a version its successor
        later reached with other bytes. Replication and resync compare this too.
        """
        return _crc(struct.pack(f"!Q{len(self.crcs)}I", self.length, *self.crcs))

    def pack(self) -> bytes:
        head = _HDR.pack(MAGIC, self.version, self.length, BLOCK, len(self.crcs), self.chain).ljust(_CRC_OFF, b"\0")
        return head + struct.pack(f"!{len(self.crcs)}I", *self.crcs)

    @classmethod
    def unpack(cls, raw: bytes) -> "ChunkMeta":
        if len(raw) < _CRC_OFF:
            raise StripefsError(ErrorCode.CHECKSUM, "chunk header truncated")
        magic, version, length, block, n, chain = _HDR.unpack_from(raw)
        if magic != MAGIC or block != BLOCK or n > MAX_BLOCKS or n != -(-length // BLOCK):
            raise StripefsError(ErrorCode.CHECKSUM, "chunk header is corrupt")
        crcs = list(struct.unpack_from(f"!{n}I", raw, _CRC_OFF))
        return cls(version, length, crcs, chain=chain)
