"""The bytes of the page store, with no I/O: segment layout, table entries, index targets, names.

A **segment** is one file of ``n`` pages written at once (by one ``batch_put``)::

    [page 0][page 1] ... [page n-1][entry 0][entry 1] ... [entry n-1]
     \\______ n * page_size ______/ \\________ n * ENTRY bytes ______/

Pages come first so that each starts on a chunk boundary whenever the page size is a
multiple of the chunk size (one storage request per chunk, no piece shared by two pages).
Entry ``i`` describes page ``i``: the record of a page is its bytes plus its entry.

An **entry** (``ENTRY`` = 256 bytes, little-endian)::

    0   4s  magic  b"KVP1"
    4   H   key length (1..MAX_KEY)
    6   H   flags (0)
    8   I   slot (the page's index in its segment)
    12  I   page length
    16  I   CRC32C of the page's bytes
    20  128 key, zero-padded
    148 I   CRC32C of bytes 0..147
    152     zeros up to 256

An **index target** (the text of a key's index entry) names where the page lives:
``"<segment name>:<slot>:<page crc, 8 hex digits>"``. A **segment name** is
``"<creation ns, 19+ digits>-<writer, 8 hex>-<pages>"``: unique (a writer's random id),
roughly in creation order, and telling its page count without a read.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass

import crc32c

__all__ = [
    "ENTRY", "MAX_KEY", "Entry", "Location", "encode_entry", "decode_entry", "key_name", "new_segment_name",
    "new_writer_id", "segment_pages", "segment_size", "table_offset", "encode_target", "parse_target", "BadRecord",
]

MAGIC = b"KVP1"
ENTRY = 256
MAX_KEY = 127  # bytes: its hex (the index entry's name) stays within a 255-byte file name
_HEAD = struct.Struct("<4sHHIII")  # magic, key length, flags, slot, page length, page crc
_KEY_AT, _CRC_AT = _HEAD.size, _HEAD.size + 128
_CRC = struct.Struct("<I")


class BadRecord(ValueError):
    """A table entry or index target that does not decode (torn, corrupted or foreign bytes)."""


@dataclass(frozen=True, slots=True)
class Entry:
    key: bytes
    slot: int
    page_len: int
    crc: int


@dataclass(frozen=True, slots=True)
class Location:
    """Where an index entry says a page lives."""

    segment: str
    slot: int
    crc: int


def key_name(key: bytes) -> str:
    """The index entry's file name of ``key``: its lowercase hex.

    Raises:
        ValueError: not bytes, empty, or longer than ``MAX_KEY``.
    """
    if not isinstance(key, (bytes, bytearray)) or not 1 <= len(key) <= MAX_KEY:
        raise ValueError(f"a key is 1..{MAX_KEY} bytes, got {key!r:.60}")
    return bytes(key).hex()


def encode_entry(entry: Entry) -> bytes:
    key = entry.key
    out = bytearray(ENTRY)
    _HEAD.pack_into(out, 0, MAGIC, len(key), 0, entry.slot, entry.page_len, entry.crc)
    out[_KEY_AT:_KEY_AT + len(key)] = key
    _CRC.pack_into(out, _CRC_AT, crc32c.crc32c(memoryview(out)[:_CRC_AT]))
    return bytes(out)


def decode_entry(data: "bytes | memoryview") -> Entry:
    """Decode one table entry.

    Raises:
        BadRecord: wrong size or magic, a failed entry checksum, a bad key length.
    """
    view = memoryview(data)
    if len(view) != ENTRY:
        raise BadRecord(f"an entry is {ENTRY} bytes, got {len(view)}")
    magic, klen, _flags, slot, page_len, crc = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise BadRecord("not a page entry (bad magic)")
    if _CRC.unpack_from(view, _CRC_AT)[0] != crc32c.crc32c(view[:_CRC_AT]):
        raise BadRecord("entry checksum mismatch")
    if not 1 <= klen <= MAX_KEY:
        raise BadRecord(f"bad key length {klen}")
    return Entry(bytes(view[_KEY_AT:_KEY_AT + klen]), slot, page_len, crc)


def new_segment_name(writer: str, pages: int) -> str:
    """A fresh segment name (see the module docstring); ``writer`` is 8 hex digits."""
    return f"{time.time_ns()}-{writer}-{pages}"


def new_writer_id() -> str:
    return os.urandom(4).hex()


def segment_pages(name: str) -> int:
    """The page count a segment name carries.

    Raises:
        BadRecord: not a segment name.
    """
    parts = name.split("-")
    if len(parts) != 3 or not all(p.isalnum() for p in parts):
        raise BadRecord(f"not a segment name: {name!r}")
    try:
        pages = int(parts[2])
    except ValueError:
        raise BadRecord(f"not a segment name: {name!r}") from None
    if pages < 1:
        raise BadRecord(f"not a segment name: {name!r}")
    return pages


def segment_size(pages: int, page_size: int) -> int:
    return pages * (page_size + ENTRY)


def table_offset(pages: int, page_size: int) -> int:
    return pages * page_size


def encode_target(loc: Location) -> str:
    return f"{loc.segment}:{loc.slot}:{loc.crc:08x}"


def parse_target(target: "str | None") -> Location:
    """Decode an index entry's target.

    Raises:
        BadRecord: anything but ``segment:slot:crc``.
    """
    try:
        segment, slot, crc = (target or "").split(":")
        segment_pages(segment)
        return Location(segment, int(slot), int(crc, 16))
    except ValueError as exc:  # BadRecord is one
        raise BadRecord(f"not an index target: {target!r}") from exc
