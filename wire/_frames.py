"""Sans-IO framing: bytes in, frames out; no sockets in this module.

A frame is a fixed 28-byte prefix, a msgpack header, then an optional raw
payload that never passes through msgpack (so it can be sent with
``sendfile`` and received with ``recv_into`` straight into its final buffer)::

    offset size field
    0      2    magic        b"SF"
    2      1    version      1
    3      1    flags        bit0 RESPONSE, bit1 ERROR
    4      2    msg_type     numbered message table (wire._messages)
    6      2    reserved     must be 0
    8      8    request id   matches a response to its request (many in flight)
    16     4    header_len   <= MAX_HEADER
    20     8    payload_len  <= MAX_PAYLOAD
    28     ...  header (msgpack map), then payload

All integers are big-endian. Two ways to read frames from a
:class:`FrameDecoder`:

* ``next_event()`` returns a whole :class:`Frame` (payload as ``bytes``) or
  :data:`NEED_DATA` -- simple, for control messages;
* ``next_head()`` returns a :class:`FrameHead` as soon as the header is in; the
  caller then moves the payload itself: :meth:`FrameDecoder.take_payload`
  copies what is already buffered into the destination and the caller
  ``recv_into``'s the rest, reporting it with :meth:`FrameDecoder.payload_received`.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from ._build import positional_builder
from ._errors import ErrorCode, StripefsError

__all__ = [
    "MAGIC",
    "VERSION",
    "PREFIX",
    "MAX_HEADER",
    "MAX_PAYLOAD",
    "FLAG_RESPONSE",
    "FLAG_ERROR",
    "NEED_DATA",
    "FrameHead",
    "Frame",
    "FrameDecoder",
    "encode_frame",
    "encode_prefix",
]

MAGIC: Final = b"SF"
VERSION: Final = 1
PREFIX: Final = struct.Struct("!2sBBHHQIQ")
MAX_HEADER: Final = 1 << 20  # 1 MiB of msgpack is far beyond any legitimate message
MAX_PAYLOAD: Final = 64 << 20  # one chunk at the largest chunk size
FLAG_RESPONSE: Final = 0x01
FLAG_ERROR: Final = 0x02
_KNOWN_FLAGS: Final = FLAG_RESPONSE | FLAG_ERROR
_PREFIX_SIZE: Final = PREFIX.size
_unpack_prefix = PREFIX.unpack_from
_unpackb = msgpack.unpackb


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


def protocol_error(msg: str) -> StripefsError:
    return StripefsError(ErrorCode.PROTOCOL, msg)


@dataclass(frozen=True, slots=True)
class FrameHead:
    msg_type: int
    req_id: int
    flags: int
    header: dict[str, Any]
    payload_len: int

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)

    @property
    def is_error(self) -> bool:
        return bool(self.flags & FLAG_ERROR)


@dataclass(frozen=True, slots=True)
class Frame:
    head: FrameHead
    payload: bytes


_new_head = positional_builder(FrameHead)
# One msgpack Packer per thread, kept: msgpack.packb builds a new one per call, which cost
# more than packing a small header. A Packer keeps its largest buffer, so a thread that
# packed an unusually large header drops its Packer rather than hold on to the memory.
_packers = threading.local()
_KEEP_PACKER_UP_TO = 256 << 10


def _pack_header(header: dict[str, Any]) -> bytes:
    try:
        pack = _packers.pack
    except AttributeError:
        # surrogateescape: file names are bytes on Linux; undecodable ones travel as they are.
        pack = _packers.pack = msgpack.Packer(use_bin_type=True, unicode_errors="surrogateescape").pack
    body: bytes = pack(header)  # on an error the Packer empties its buffer (it stays usable)
    if len(body) > _KEEP_PACKER_UP_TO:
        del _packers.pack
        if len(body) > MAX_HEADER:
            raise StripefsError(ErrorCode.TOO_BIG, f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    return body


def encode_prefix(
    msg_type: int, req_id: int, header: dict[str, Any], payload_len: int = 0, flags: int = 0
) -> bytes:
    """Prefix + header bytes; the caller sends ``payload_len`` payload bytes after them."""
    if not 0 <= payload_len <= MAX_PAYLOAD:
        raise StripefsError(ErrorCode.TOO_BIG, f"payload of {payload_len} bytes exceeds {MAX_PAYLOAD}")
    if not 0 <= msg_type < 1 << 16 or not 0 <= req_id < 1 << 64 or flags & ~_KNOWN_FLAGS:
        raise protocol_error("msg_type, req_id or flags out of range")
    body = _pack_header(header)
    return PREFIX.pack(MAGIC, VERSION, flags, msg_type, 0, req_id, len(body), payload_len) + body


def encode_frame(
    msg_type: int, req_id: int, header: dict[str, Any], payload: bytes | memoryview = b"", flags: int = 0
) -> bytes:
    """A whole frame as one ``bytes`` (control messages; bulk senders use encode_prefix)."""
    return encode_prefix(msg_type, req_id, header, len(payload), flags) + bytes(payload)


class FrameDecoder:
    """Incremental decoder. Feed it bytes; pull frames out.

    Any violation (bad magic, version, flags, reserved bits, oversized header
    or payload, header that is not a msgpack map) raises ``StripefsError`` with
    ``ErrorCode.PROTOCOL`` or ``TOO_BIG``; the connection must then be closed,
    since the stream position is lost.
    """

    def __init__(self, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD):
        self._buf = bytearray()
        self._pos = 0
        self.max_header = max_header
        self.max_payload = max_payload
        self._payload_left = 0
        self._pending: FrameHead | None = None  # head awaiting its payload (next_event path)
        self.broken = False

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self.broken:
            raise protocol_error("decoder is broken after a protocol error")
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    @property
    def payload_left(self) -> int:
        """Payload bytes of the current head that the caller has not moved yet."""
        return self._payload_left

    def head_bytes_needed(self) -> int:
        """Bytes still missing before :meth:`next_head` can return a head (0 if none).

        Readers that move payloads themselves read exactly this much, so payload
        bytes never pass through the decoder's buffer (no extra copy).
        """
        have = self.buffered
        if have < PREFIX.size:
            return PREFIX.size - have
        hlen = PREFIX.unpack_from(self._buf, self._pos)[6]
        return max(0, PREFIX.size + min(hlen, self.max_header + 1) - have)

    def _compact(self) -> None:
        if self._pos and (self._pos > 65536 or self._pos == len(self._buf)):
            del self._buf[: self._pos]
            self._pos = 0

    def _fail(self, exc: StripefsError) -> StripefsError:
        self.broken = True
        return exc

    def next_head(self) -> FrameHead | _NeedData:
        """Parse the next prefix + header, leaving the payload to the caller."""
        if self._payload_left:
            raise protocol_error("previous frame's payload has not been consumed")
        if self.broken:
            raise protocol_error("decoder is broken after a protocol error")
        buf, pos = self._buf, self._pos
        have = len(buf) - pos
        if have < _PREFIX_SIZE:
            return NEED_DATA
        magic, version, flags, msg_type, reserved, req_id, hlen, plen = _unpack_prefix(buf, pos)
        if (magic != MAGIC or version != VERSION or flags & ~_KNOWN_FLAGS or reserved or hlen > self.max_header
                or plen > self.max_payload):
            raise self._fail(self._bad_prefix(magic, version, flags, reserved, hlen, plen))
        if have < _PREFIX_SIZE + hlen:
            return NEED_DATA
        start = pos + _PREFIX_SIZE
        end = start + hlen
        try:
            # A slice copies the header (not the payload): cheaper than a memoryview for the
            # small headers of nearly every frame, and a negligible cost next to unpacking a large one.
            header = _unpackb(buf[start:end], raw=False, strict_map_key=True, unicode_errors="surrogateescape")
        except Exception as exc:  # msgpack raises several unrelated types
            raise self._fail(protocol_error(f"header is not valid msgpack: {exc}")) from exc
        if not isinstance(header, dict):
            raise self._fail(protocol_error("header must be a msgpack map"))
        self._payload_left = plen
        if end == len(buf) or end > 65536:  # _compact, inline: this runs once per frame
            del buf[:end]
            self._pos = 0
        else:
            self._pos = end
        return _new_head(msg_type, req_id, flags, header, plen)  # type: ignore[no-any-return]

    def _bad_prefix(self, magic: bytes, version: int, flags: int, reserved: int, hlen: int, plen: int) -> StripefsError:
        """The error for a prefix that breaks a rule (the first rule, in this order)."""
        if magic != MAGIC:
            return protocol_error(f"bad magic {bytes(magic)!r}")
        if version != VERSION:
            return protocol_error(f"unsupported protocol version {version}")
        if flags & ~_KNOWN_FLAGS or reserved:
            return protocol_error("unknown flags or reserved bits set")
        if hlen > self.max_header:
            return StripefsError(ErrorCode.TOO_BIG, f"header of {hlen} bytes exceeds {self.max_header}")
        return StripefsError(ErrorCode.TOO_BIG, f"payload of {plen} bytes exceeds {self.max_payload}")

    def take_payload(self, dest: memoryview | bytearray | None = None) -> int:
        """Move buffered payload bytes of the current head into ``dest``.

        Returns how many bytes were moved (at most ``len(dest)`` and at most
        :attr:`payload_left`). With ``dest=None`` the bytes are discarded.
        """
        n = min(self._payload_left, self.buffered)
        if dest is not None:
            n = min(n, len(dest))
            memoryview(dest)[:n] = memoryview(self._buf)[self._pos : self._pos + n]
        self._pos += n
        self._payload_left -= n
        self._compact()
        return n

    def payload_received(self, n: int) -> None:
        """Tell the decoder the caller read ``n`` payload bytes from the stream itself."""
        if n < 0 or n > self._payload_left:
            raise protocol_error("more payload reported than the frame carries")
        if self.buffered and n:
            raise protocol_error("payload must be drained from the buffer before reading the stream")
        self._payload_left -= n

    def next_event(self) -> Frame | _NeedData:
        """The next whole frame, or NEED_DATA."""
        if self._pending is None:
            head = self.next_head()
            if head is NEED_DATA:
                return NEED_DATA
            assert isinstance(head, FrameHead)
            self._pending = head
        head = self._pending
        if self.buffered < self._payload_left:
            return NEED_DATA
        payload = bytes(memoryview(self._buf)[self._pos : self._pos + head.payload_len])
        self._pos += head.payload_len
        self._payload_left = 0
        self._pending = None
        self._compact()
        return Frame(head, payload)
