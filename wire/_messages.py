"""The numbered message table (3FS ``Service.h`` style).

Each request is a small frozen dataclass with a stable numeric id. Its
response travels under the same id with the RESPONSE flag; an error response
carries ``{"code", "message"}`` with the ERROR flag. Bulk bytes (chunk data)
travel as the frame payload, never inside these headers.

Numbers are stable: never renumber, only append. ``docs/protocol.md`` lists
the table.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, TypeVar

from ._errors import ErrorCode, StripefsError

__all__ = ["Message", "MESSAGES", "message", "decode_message", "encode_fields"]

T = TypeVar("T", bound="Message")
MESSAGES: dict[int, type["Message"]] = {}

_PRIMS: dict[Any, tuple[type, ...]] = {
    int: (int,),
    float: (float, int),
    str: (str,),
    bytes: (bytes,),
    bool: (bool,),
    dict: (dict,),
    list: (list, tuple),
}


class Message:
    """Base of every request. Subclasses are frozen dataclasses."""

    MSG_ID: ClassVar[int]
    MUTATES: ClassVar[bool] = False  # replayed responses are cached for retried mutations

    def to_header(self) -> dict[str, Any]:
        return encode_fields(self)


def encode_fields(msg: object) -> dict[str, Any]:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}  # type: ignore[arg-type]


def _check(name: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(name, value, arg)
            except StripefsError:
                continue
        raise StripefsError(ErrorCode.INVALID, f"field {name!r}: unexpected {type(value).__name__}")
    base = origin or tp
    allowed = _PRIMS.get(base)
    if allowed is None:
        return value
    if base is int and isinstance(value, bool):
        raise StripefsError(ErrorCode.INVALID, f"field {name!r}: expected int, got bool")
    if not isinstance(value, allowed):
        raise StripefsError(ErrorCode.INVALID, f"field {name!r}: expected {base.__name__}, got {type(value).__name__}")
    if base is int and not -(1 << 63) <= value < 1 << 64:
        raise StripefsError(ErrorCode.INVALID, f"field {name!r}: integer out of range")
    return value


def message(msg_id: int, *, mutates: bool = False):
    """Class decorator: make a frozen dataclass and register it under ``msg_id``."""

    def wrap(cls: type[T]) -> type[T]:
        if msg_id in MESSAGES:
            raise RuntimeError(f"message id {msg_id} registered twice")
        cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
        cls.MSG_ID = msg_id
        cls.MUTATES = mutates
        cls._hints = typing.get_type_hints(cls)  # type: ignore[attr-defined]
        MESSAGES[msg_id] = cls
        return cls

    return wrap


def decode_message(msg_type: int, header: dict[str, Any]) -> Message:
    """Build and validate the request for ``msg_type`` from a decoded header.

    Raises:
        StripefsError: PROTOCOL for an unknown id, INVALID for missing, extra
        or mistyped fields.
    """
    cls = MESSAGES.get(msg_type)
    if cls is None:
        raise StripefsError(ErrorCode.PROTOCOL, f"unknown message type {msg_type}")
    hints = cls._hints  # type: ignore[attr-defined]
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in header:
            kwargs[f.name] = _check(f.name, header[f.name], hints[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise StripefsError(ErrorCode.INVALID, f"{cls.__name__}: missing field {f.name!r}")
    extra = set(header) - set(kwargs) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if extra:
        raise StripefsError(ErrorCode.INVALID, f"{cls.__name__}: unknown fields {sorted(extra)}")
    return cls(**kwargs)


# --- handshake (1-9) -------------------------------------------------------------------


@message(1)
class Challenge(Message):
    """Server -> client on connect: prove you know the cluster secret."""

    nonce: bytes
    role: str  # "metadata" | "storage"
    cluster_id: str


@message(2)
class Authenticate(Message):
    client_id: bytes  # 16 random bytes, stable per client process
    nonce: bytes
    proof: bytes  # HMAC-SHA256(secret, "client" | server nonce | client nonce)
    # response: {"proof": HMAC-SHA256(secret, "server" | client nonce | server nonce)}


@message(3)
class Ping(Message):
    pass


# --- metadata service (10-39) ------------------------------------------------------------


@message(10)
class Statfs(Message):
    pass


@message(11)
class GetAttr(Message):
    ino: int


@message(12)
class Lookup(Message):
    parent: int
    name: str


@message(13)
class Resolve(Message):
    path: str
    follow: bool = True


@message(14, mutates=True)
class Create(Message):
    parent: int
    name: str
    mode: int
    uid: int = 0
    gid: int = 0
    exclusive: bool = False
    truncate: bool = False


@message(15, mutates=True)
class Mkdir(Message):
    parent: int
    name: str
    mode: int
    uid: int = 0
    gid: int = 0


@message(16, mutates=True)
class Symlink(Message):
    parent: int
    name: str
    target: str
    uid: int = 0
    gid: int = 0


@message(17)
class Readlink(Message):
    ino: int


@message(18, mutates=True)
class Link(Message):
    ino: int
    new_parent: int
    new_name: str


@message(19)
class Readdir(Message):
    ino: int
    after: str = ""
    limit: int = 1000
    plus: bool = False


@message(20, mutates=True)
class Unlink(Message):
    parent: int
    name: str


@message(21, mutates=True)
class Rmdir(Message):
    parent: int
    name: str


@message(22, mutates=True)
class Rename(Message):
    parent: int
    name: str
    new_parent: int
    new_name: str
    flags: int = 0


@message(23, mutates=True)
class SetAttr(Message):
    ino: int
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    size: int | None = None


@message(24, mutates=True)
class CommitLength(Message):
    ino: int
    length: int
    mtime_ns: int | None = None
    # Attr.truncations as the writer last saw it; when the file was truncated since,
    # the commit does not extend the size (the writer's bytes past it were dropped).
    truncations: int | None = None


@message(25, mutates=True)
class SetLayout(Message):
    ino: int
    chunk_size: int | None = None
    stripe: int | None = None


@message(26)
class GetRouting(Message):
    pass


@message(27)
class ClusterStatus(Message):
    pass


@message(28, mutates=True)
class RegisterServer(Message):
    host: str
    port: int
    root: str
    server_id: int | None = None
    capacity: int = 0
    used: int = 0
    pid: int = 0


@message(29)
class Heartbeat(Message):
    server_id: int
    capacity: int = 0
    used: int = 0
    chunks: int = 0


@message(30)
class GetLayout(Message):
    ino: int


# --- storage servers (40-59) -------------------------------------------------------------


@message(40, mutates=True)
class WriteChunk(Message):
    """Payload: the bytes. ``crc`` is CRC32C of the payload (end-to-end check)."""

    ino: int
    index: int
    offset: int
    crc: int
    chunk_size: int
    chain: int = 0  # the chain the chunk belongs to (replicated writes go head -> tail)
    routing_version: int = 0  # the sender's routing table version (STALE_ROUTING if it differs)
    version: int | None = None  # set by the chain head when it forwards to the next replica
    # response: {"length": chunk length after the write, "version": chunk version}


@message(41)
class ReadChunk(Message):
    """Response payload: up to ``length`` bytes (fewer at the chunk's end; holes are short)."""

    ino: int
    index: int
    offset: int
    length: int
    chain: int = 0  # when set, a server that no longer serves the chain answers STALE_ROUTING
    routing_version: int = 0  # the sender's routing version: a server behind it refreshes first
    # response: {"length": bytes in the payload, "chunk_length": n, "version": v}


@message(42, mutates=True)
class RemoveChunks(Message):
    """Remove every chunk of ``ino`` with index >= ``from_index`` (GC, truncate)."""

    ino: int
    from_index: int = 0


@message(43, mutates=True)
class TruncateChunk(Message):
    ino: int
    index: int
    length: int


@message(44)
class StatChunk(Message):
    ino: int
    index: int
    # response: {"length", "version", "crc"} (crc of the whole chunk, computed)


@message(45)
class TargetInfo(Message):
    pass
    # response: {"server_id", "capacity", "used", "chunks", "root"}


@message(46)
class ListChunks(Message):
    """Chunks of one chain held by a storage server (resync compares versions)."""

    chain: int
    # response: {"chunks": [[ino, index, version, length], ...]}


@message(47)
class FetchChunk(Message):
    """A whole chunk, verified, with its version (payload), for a replica to copy."""

    ino: int
    index: int
    # response: {"version", "chain", "length"} + payload; NOT_FOUND if absent


@message(48)
class SyncDone(Message):
    """Storage -> metadata: this server has caught up with its chains."""

    server_id: int


@message(49)
class Scrub(Message):
    """Verify every chunk on the server; repair bad ones from a replica."""

    repair: bool = True
    # response: {"checked": n, "bad": [[ino, index, chain]], "repaired": n}


@message(50, mutates=True)
class DropChain(Message):
    """Metadata -> storage: this server left ``chain`` (its data moved): delete its chunks."""

    chain: int
    # response: {"removed": n}
