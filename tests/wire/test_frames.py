"""Sans-IO framing: exact bytes, byte-at-a-time, trailing bytes, limits, fuzzing."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import struct

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from stripefs import wire
from stripefs.wire import FLAG_ERROR, FLAG_RESPONSE, NEED_DATA, PREFIX, ErrorCode, FrameDecoder, StripefsError, encode_frame


def test_exact_bytes_of_a_frame() -> None:
    frame = encode_frame(41, 7, {"a": 1}, b"xyz")
    header = msgpack.packb({"a": 1})
    assert header == b"\x81\xa1a\x01"
    assert frame == b"SF\x01\x00" + b"\x00\x29" + b"\x00\x00" + (7).to_bytes(8, "big") + (4).to_bytes(4, "big") + (3).to_bytes(8, "big") + header + b"xyz"
    assert PREFIX.size == 28


def test_whole_frame_at_once_and_trailing_bytes() -> None:
    data = encode_frame(11, 1, {"ino": 5}) + encode_frame(41, 2, {"x": b"\x00"}, b"payload", FLAG_RESPONSE) + b"SF"
    dec = FrameDecoder()
    dec.feed(data)
    f1 = dec.next_event()
    f2 = dec.next_event()
    assert f1.head.msg_type == 11 and f1.head.header == {"ino": 5} and f1.payload == b""
    assert f2.head.req_id == 2 and f2.head.is_response and not f2.head.is_error and f2.payload == b"payload"
    assert dec.next_event() is NEED_DATA
    assert dec.buffered == 2


def test_one_byte_at_a_time() -> None:
    frames = [encode_frame(i, i, {"i": i, "s": "x" * i}, bytes([i]) * i) for i in range(1, 20)]
    dec = FrameDecoder()
    got = []
    for byte in b"".join(frames):
        dec.feed(bytes([byte]))
        while (ev := dec.next_event()) is not NEED_DATA:
            got.append(ev)
    assert [(f.head.msg_type, f.payload) for f in got] == [(i, bytes([i]) * i) for i in range(1, 20)]


def test_payload_moved_by_caller() -> None:
    dec = FrameDecoder()
    dec.feed(encode_frame(41, 3, {}, b"0123456789")[:-4])
    head = dec.next_head()
    assert head.payload_len == 10
    dest = bytearray(10)
    n = dec.take_payload(memoryview(dest))
    assert n == 6 and dest[:6] == b"012345"
    dec.payload_received(4)  # the caller read the rest from the socket itself
    assert dec.payload_left == 0
    with pytest.raises(StripefsError):
        dec.payload_received(1)


@pytest.mark.parametrize(
    "mutate, code",
    [
        (lambda b: b"XX" + b[2:], ErrorCode.PROTOCOL),
        (lambda b: b[:2] + b"\x09" + b[3:], ErrorCode.PROTOCOL),  # version
        (lambda b: b[:3] + b"\x80" + b[4:], ErrorCode.PROTOCOL),  # unknown flag
        (lambda b: b[:6] + b"\x00\x01" + b[8:], ErrorCode.PROTOCOL),  # reserved
        (lambda b: b[:16] + struct.pack("!I", wire.MAX_HEADER + 1) + b[20:], ErrorCode.TOO_BIG),
        (lambda b: b[:20] + struct.pack("!Q", wire.MAX_PAYLOAD + 1) + b[28:], ErrorCode.TOO_BIG),
    ],
)
def test_bad_prefixes_are_refused(mutate, code) -> None:
    dec = FrameDecoder()
    dec.feed(mutate(encode_frame(11, 1, {"ino": 1})))
    with pytest.raises(StripefsError) as exc:
        dec.next_event()
    assert exc.value.code == code
    with pytest.raises(StripefsError):  # broken for good: the stream position is lost
        dec.next_event()


def test_header_must_be_a_map() -> None:
    body = msgpack.packb([1, 2])
    raw = PREFIX.pack(b"SF", 1, 0, 11, 0, 1, len(body), 0) + body
    dec = FrameDecoder()
    dec.feed(raw)
    with pytest.raises(StripefsError) as exc:
        dec.next_event()
    assert exc.value.errno == errno.EPROTO


def test_encode_refuses_oversized() -> None:
    with pytest.raises(StripefsError) as exc:
        wire.encode_prefix(41, 1, {}, wire.MAX_PAYLOAD + 1)
    assert exc.value.code == ErrorCode.TOO_BIG
    with pytest.raises(StripefsError):
        encode_frame(11, 1, {"x": "a" * (wire.MAX_HEADER + 10)})


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_decoder_never_crashes_otherwise(data: bytes) -> None:
    dec = FrameDecoder()
    dec.feed(data)
    try:
        while dec.next_event() is not NEED_DATA:
            pass
    except StripefsError as exc:
        assert exc.code in (ErrorCode.PROTOCOL, ErrorCode.TOO_BIG)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 65535),
            st.integers(0, 2**64 - 1),
            st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=20), st.binary(max_size=20)), max_size=5),
            st.binary(max_size=300),
            st.sampled_from([0, FLAG_RESPONSE, FLAG_RESPONSE | FLAG_ERROR]),
        ),
        max_size=5,
    ),
    st.integers(1, 50),
)
def test_roundtrip_any_split(frames, step: int) -> None:
    data = b"".join(encode_frame(t, r, h, p, f) for t, r, h, p, f in frames)
    dec = FrameDecoder()
    out = []
    for i in range(0, len(data), step):
        dec.feed(data[i : i + step])
        while (ev := dec.next_event()) is not NEED_DATA:
            out.append((ev.head.msg_type, ev.head.req_id, ev.head.header, ev.payload, ev.head.flags))
    assert out == list(frames)


def test_a_prefix_breaking_several_rules_names_the_first() -> None:
    frame = encode_frame(11, 1, {"ino": 1})
    for raw, message in [
        (b"XX\x09\x80" + frame[4:], "bad magic"),  # also bad version and flags
        (frame[:2] + b"\x09\x80" + frame[4:], "unsupported protocol version 9"),
        (frame[:3] + b"\x80" + frame[4:16] + struct.pack("!I", wire.MAX_HEADER + 1) + frame[20:], "unknown flags"),
    ]:
        dec = FrameDecoder()
        dec.feed(raw)
        with pytest.raises(StripefsError) as exc:
            dec.next_head()
        assert exc.value.code == ErrorCode.PROTOCOL and message in exc.value.message


def _expected(msg_type: int, req_id: int, header: dict) -> bytes:
    body = msgpack.packb(header, use_bin_type=True, unicode_errors="surrogateescape")
    return PREFIX.pack(b"SF", 1, 0, msg_type, 0, req_id, len(body), 0) + body


def test_encoder_recovers_from_a_header_it_cannot_pack() -> None:
    # Each thread keeps one msgpack Packer: a failure must not leave bytes behind in it.
    with pytest.raises(TypeError):
        wire.encode_prefix(11, 1, {"ino": 1, "bad": object()})
    with pytest.raises(OverflowError):
        wire.encode_prefix(11, 1, {"a": "x" * 100, "ino": 1 << 70})
    assert wire.encode_prefix(11, 2, {"ino": 5}) == _expected(11, 2, {"ino": 5})
    big = {"x": "a" * (300 << 10)}  # past what a thread's Packer is kept for
    assert wire.encode_prefix(11, 3, big) == _expected(11, 3, big)
    assert wire.encode_prefix(11, 4, {"ino": 6}) == _expected(11, 4, {"ino": 6})
    name = os.fsdecode(b"caf\xe9")  # an undecodable name travels as its bytes
    assert wire.encode_prefix(12, 5, {"name": name}) == _expected(12, 5, {"name": name})


def test_encoders_in_many_threads_give_exact_bytes() -> None:
    def work(i: int) -> bool:
        return all(wire.encode_prefix(11, n, {"ino": i, "name": f"t{i}-{n}"}) == _expected(11, n, {"ino": i, "name": f"t{i}-{n}"})
                   for n in range(2000))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(8)))
