"""The page store's bytes and eviction decisions, with no cluster: exact layouts, every
corruption of an entry caught, the victim order."""

from __future__ import annotations

import pytest

import stripefs.kvcache
from stripefs.kvcache._format import (ENTRY, MAX_KEY, BadRecord, Entry, Location, decode_entry, encode_entry,
                                      encode_target, key_name, parse_target, segment_pages, segment_size, table_offset)
from stripefs.kvcache._policy import SegmentInfo, choose_victims


def test_exports() -> None:
    assert set(stripefs.kvcache.__all__) == {"NamespaceInfo", "PageStore", "StoreStats", "namespaces"}


def test_entry_round_trip_and_exact_head() -> None:
    e = Entry(b"\x00key\xff", slot=3, page_len=1 << 20, crc=0xDEADBEEF)
    raw = encode_entry(e)
    assert len(raw) == ENTRY
    assert raw[:20] == b"KVP1" + (5).to_bytes(2, "little") + bytes(2) + (3).to_bytes(4, "little") \
        + (1 << 20).to_bytes(4, "little") + (0xDEADBEEF).to_bytes(4, "little")
    assert raw[20:25] == b"\x00key\xff" and raw[152:] == bytes(ENTRY - 152)
    assert decode_entry(raw) == e
    assert decode_entry(encode_entry(Entry(b"k" * MAX_KEY, 0, 1, 0))).key == b"k" * MAX_KEY


def test_every_flipped_bit_of_an_entry_is_caught() -> None:
    raw = bytearray(encode_entry(Entry(b"some key", 7, 4096, 12345)))
    for at in range(152):  # the checksummed part (the padding after it carries nothing)
        for bit in (0x01, 0x80):
            raw[at] ^= bit
            with pytest.raises(BadRecord):
                decode_entry(bytes(raw))
            raw[at] ^= bit
    with pytest.raises(BadRecord):
        decode_entry(bytes(raw[:-1]))


def test_keys_names_targets() -> None:
    assert key_name(b"\x01\xab") == "01ab"
    assert len(key_name(b"x" * MAX_KEY)) <= 255
    for bad in (b"", b"x" * (MAX_KEY + 1), "text"):
        with pytest.raises(ValueError):
            key_name(bad)  # type: ignore[arg-type]
    loc = Location("1700000000000000000-0a0b0c0d-64", 5, 0xABC)
    assert encode_target(loc) == "1700000000000000000-0a0b0c0d-64:5:00000abc"
    assert parse_target(encode_target(loc)) == loc
    for bad in (None, "", "a:b", "x-y:1:00", "1-2-3:z:00", "1-2-3:1:zz", "1-2-0:1:00"):
        with pytest.raises(BadRecord):
            parse_target(bad)
    assert segment_pages("17-0a0b0c0d-64") == 64
    assert segment_size(4, 4096) == 4 * (4096 + ENTRY) and table_offset(4, 4096) == 4 * 4096


def seg(name: str, pages: int, used: int, made: int | None = None) -> SegmentInfo:
    return SegmentInfo(name, pages, used, used if made is None else made)


@pytest.mark.parametrize("segs,capacity,incoming,now,ttl,victims", [
    ([seg("a", 2, 1), seg("b", 2, 2)], 4, 0, 10, None, []),                      # full, nothing coming: stays
    ([seg("a", 2, 1), seg("b", 2, 2)], 4, 1, 10, None, ["a"]),                   # least recently used first
    ([seg("a", 2, 5), seg("b", 2, 2)], 4, 1, 10, None, ["b"]),                   # a was used since: b goes
    ([seg("a", 2, 1), seg("b", 2, 1)], 4, 1, 10, None, ["a"]),                   # a tie: name (creation) order
    ([seg("a", 2, 1), seg("b", 2, 2)], 4, 4, 10, None, ["a", "b"]),              # room for a whole store
    ([seg("a", 1, 9, made=1), seg("b", 1, 2, made=2)], 100, 0, 9, 8, ["a"]),    # a expired, used or not
    ([seg("a", 1, 9, made=1), seg("b", 1, 2, made=2)], 1, 1, 9, 8, ["a", "b"]),
])
def test_victims(segs: list[SegmentInfo], capacity: int, incoming: int, now: int, ttl: int | None,
                 victims: list[str]) -> None:
    got = choose_victims(segs, page_size=1, capacity=capacity, incoming=incoming, now_ns=now, ttl_ns=ttl)
    assert [s.name for s in got] == victims
