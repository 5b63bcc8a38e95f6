"""The numbered message table (3FS ``Service.h`` style), requests and their replies.

Each request is a small frozen dataclass with a stable numeric id, declared as
``class GetAttr(Message[AttrReply])``: the type argument is the request's reply
type, which the decorator records as ``GetAttr.Reply`` (and type checkers see,
so ``ClientCore.call(m.GetAttr(...))`` is an ``AttrReply``). The reply travels
under the request's id with the RESPONSE flag; an error response carries
``{"code", "message"}`` with the ERROR flag. Bulk bytes (chunk data) travel as
the frame payload, never inside these headers.

Replies are frozen dataclasses too. ``to_header()`` gives the msgpack map sent
on the wire (value types such as :class:`Attr` as their ``to_wire`` maps), and
:func:`decode_reply` rebuilds and validates one -- the transports in ``rpc``
hand headers up as plain dicts and the caller that knows the request decodes.

Numbers are stable: never renumber, only append. ``docs/protocol.md`` lists
the table.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, ClassVar, Generic, TypeVar

from ._build import positional_builder
from ._errors import ErrorCode, StripefsError
from ._types import Attr, DirEntry, ListingPage, Routing, ServerInfo, dir_columns, dir_entries_from_columns

__all__ = [
    "Message", "ReplyMessage", "MESSAGES", "message", "reply", "decode_message", "decode_reply", "encode_fields",
]

T = TypeVar("T", bound="Message[Any]")
RT = TypeVar("RT", bound="ReplyMessage")
R = TypeVar("R", bound="ReplyMessage", covariant=True)
MESSAGES: dict[int, type["Message[Any]"]] = {}

_PRIMS: dict[Any, tuple[type, ...]] = {
    int: (int,),
    float: (float, int),
    str: (str,),
    bytes: (bytes,),
    bool: (bool,),
    dict: (dict,),
    list: (list, tuple),
}
# int64: what every store keeps (SQLite INTEGER, PostgreSQL BIGINT). msgpack could carry
# uint64 too, but such a value would only fail later, as an internal error in a store.
_INT_MIN = -(1 << 63)
_INT_END = 1 << 63
_ABSENT: Any = object()  # a field the header does not carry
# What a value type's from_wire raises on a malformed map besides StripefsError (anything
# else is a bug, not bad input); OverflowError: int() of an infinity, which msgpack carries.
_VALUE_ERRORS = (TypeError, ValueError, OverflowError, KeyError, AttributeError)
_DECODE_ERRORS = (StripefsError, *_VALUE_ERRORS)

# One field of a class's decode plan, built once when the class is declared:
# (name, the exact value types accepted as they are (None: any), a converter for value
# types (from_wire) or None, required, default).
_Field = tuple[str, "tuple[type, ...] | None", "Callable[[Any], Any] | None", bool, Any]


def _fast_types(tp: Any) -> tuple[type, ...] | None:
    """The exact types :func:`_check` passes through unchanged for ``tp``; None: any value.

    Exact types only (``type(v) is int``, not ``isinstance``): a bool, an int subclass
    or a float where an int is due goes to the checked path, which decides.
    """
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        out: list[type] = []
        for arg in typing.get_args(tp):
            sub = (type(None),) if arg is type(None) else _fast_types(arg)
            if sub is None:
                return None
            out += sub
        return tuple(out)
    return _PRIMS.get(typing.get_origin(tp) or tp)


def _decode_plan(cls: type, hints: dict[str, Any], convert: Callable[[str, Any], Callable[[Any], Any] | None]) -> tuple[_Field, ...]:
    """The decode plan of a dataclass: its fields in order (see :func:`_fast_values`)."""
    plan = []
    for f in dataclasses.fields(cls):
        conv = convert(f.name, hints[f.name])
        # A default_factory field counts as required here: the checked path builds its default.
        plan.append((f.name, None if conv is not None else _fast_types(hints[f.name]), conv,
                     f.default is dataclasses.MISSING, f.default))
    return tuple(plan)


def _fast_values(plan: tuple[_Field, ...], header: dict[Any, Any]) -> list[Any] | None:
    """The constructor arguments for ``header`` when every value has its field's exact type.

    None when anything is off (a missing required field, an extra one, a value of
    another type or past int64, a value type that does not rebuild): the caller then
    runs the checked path, which accepts or raises exactly as it always did. Values
    accepted here are the ones the checked path would return unchanged.
    """
    values = []
    found = 0
    for name, exact, convert, required, default in plan:
        v = header.get(name, _ABSENT)
        if v is _ABSENT:
            if required:
                return None
            values.append(default)
            continue
        tv = type(v)
        if exact is not None and tv not in exact or tv is int and not _INT_MIN <= v < _INT_END:
            return None
        if convert is not None:
            try:
                v = convert(v)
            except _DECODE_ERRORS:
                return None
        values.append(v)
        found += 1
    return values if found == len(header) else None  # found == len: no key is extra


def _sparse(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(name, default)`` of each field the class lists in ``SPARSE``."""
    defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)}
    return tuple((name, defaults[name]) for name in cls.SPARSE)  # type: ignore[attr-defined]


def _drop_sparse(header: dict[str, Any], sparse: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    for name, default in sparse:
        if header[name] == default:
            del header[name]
    return header


class ReplyMessage:
    """Base of every reply. Subclasses are frozen dataclasses made by :func:`reply`."""

    # Fields left off the wire while at their default (a lease a client did not ask for):
    # peers that know nothing of them see the map they always did.
    SPARSE: ClassVar[tuple[str, ...]] = ()
    _sparse: ClassVar[tuple[tuple[str, Any], ...]]

    # Set by @reply: how each field is decoded and encoded (see _field_codec), and the
    # decode plan of the fast path of from_header (see _fast_values).
    _codecs: ClassVar[tuple[tuple[str, Callable[[Any], Any], Callable[[Any], Any] | None, bool], ...]]
    _plan: ClassVar[tuple[_Field, ...]]
    _build: ClassVar[Callable[..., Any]]  # cls(*values) with every field, unrolled (wire._build)

    def to_header(self) -> dict[str, Any]:
        """The msgpack map sent on the wire for this reply."""
        header = {name: getattr(self, name) if enc is None else enc(getattr(self, name))
                  for name, _dec, enc, _req in self._codecs}
        return _drop_sparse(header, self._sparse) if self._sparse else header

    @classmethod
    def from_header(cls: type[RT], header: dict[str, Any]) -> RT:
        """Build and validate this reply from a decoded response header.

        Fields this version does not know are ignored (a newer peer's additions).

        Raises:
            StripefsError: PROTOCOL for a header that is not a map, or has
                missing or mistyped fields (the peer broke the protocol).
        """
        if type(header) is dict:
            values = _fast_values(cls._plan, header)
            if values is not None:
                return cls._build(*values)
        return cls._decode_checked(header)

    @classmethod
    def _decode_checked(cls: type[RT], header: Any) -> RT:
        name = cls.__name__
        if not isinstance(header, dict):
            raise StripefsError(ErrorCode.PROTOCOL, f"{name}: reply header is not a map")
        kwargs: dict[str, Any] = {}
        for field, dec, _enc, required in cls._codecs:
            if field in header:
                try:
                    kwargs[field] = dec(header[field])
                except StripefsError as exc:  # the decoders name the field
                    raise StripefsError(ErrorCode.PROTOCOL, f"{name}: {exc.message}") from None
                except _VALUE_ERRORS as exc:  # a value type's from_wire choked
                    raise StripefsError(ErrorCode.PROTOCOL, f"{name}: field {field!r}: {exc}") from None
            elif required:
                raise StripefsError(ErrorCode.PROTOCOL, f"{name}: missing field {field!r}")
        # A field this version does not know is ignored: a newer peer's advisory addition
        # (docs/protocol.md, "Versions"), which the fields it does know do without.
        return cls(**kwargs)


def _field_codec(name: str, tp: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any] | None]:
    """``(decode, encode)`` of one reply field; ``encode`` None means "sent as is".

    Value types (``Attr``, ``Routing``, ...) travel as their ``to_wire`` form and
    are rebuilt with ``from_wire`` (which validates); so do lists of them. A
    decoder's StripefsError names the field.
    """

    def rebuild(from_wire: Callable[[Any], Any], v: Any) -> Any:
        try:
            return from_wire(v)
        except StripefsError as exc:
            raise StripefsError(ErrorCode.INVALID, f"field {name!r}: {exc.message}") from None

    if isinstance(tp, type) and hasattr(tp, "from_wire"):
        return (lambda v: rebuild(tp.from_wire, v)), (lambda v: v.to_wire())
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(item, type) and hasattr(item, "from_wire"):
            def decode_list(v: Any) -> list[Any]:
                if not isinstance(v, (list, tuple)):
                    raise StripefsError(ErrorCode.INVALID, f"field {name!r}: expected a list, got {type(v).__name__}")
                return [rebuild(item.from_wire, x) for x in v]

            return decode_list, (lambda v: [x.to_wire() for x in v])
    return (lambda v: _check(name, v, tp)), None


def _fast_convert(name: str, tp: Any) -> Callable[[Any], Any] | None:
    """The fast path's rebuild of a value-type field (None for plain fields).

    It may raise any of ``_DECODE_ERRORS``: the fast path then gives way to the
    checked one, which reports the error.
    """
    if isinstance(tp, type) and hasattr(tp, "from_wire"):
        return tp.from_wire  # type: ignore[no-any-return]
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(item, type) and hasattr(item, "from_wire"):
            from_wire = item.from_wire

            def rebuild_list(v: Any) -> list[Any]:
                if type(v) is not list and type(v) is not tuple:
                    raise TypeError("not a list")
                return [from_wire(x) for x in v]

            return rebuild_list
    return None


@typing.dataclass_transform(frozen_default=True)  # type checkers see the fields as __init__ arguments
def reply(cls: type[RT]) -> type[RT]:
    """Class decorator: make a frozen dataclass usable as a reply (see :class:`ReplyMessage`)."""
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    hints = typing.get_type_hints(cls)
    codecs = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        dec, enc = _field_codec(f.name, hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        codecs.append((f.name, dec, enc, required))
    cls._codecs = tuple(codecs)
    cls._plan = _decode_plan(cls, hints, _fast_convert)
    cls._build = staticmethod(positional_builder(cls))  # type: ignore[assignment]
    cls._sparse = _sparse(cls)
    return cls


class Message(Generic[R]):
    """Base of every request. Subclasses are frozen dataclasses, ``Message[TheirReply]``."""

    MSG_ID: ClassVar[int]
    MUTATES: ClassVar[bool] = False  # replayed responses are cached for retried mutations
    # Only a peer that authenticated with the server credential may send it (membership,
    # sync and chunk management); a client connection gets ACCESS and nothing happens.
    SERVER_ONLY: ClassVar[bool] = False
    # The reply type (the class's type argument); None only for the server's Challenge,
    # which is never answered with a response of its own.
    Reply: ClassVar[type[ReplyMessage] | None]
    # Fields left off the wire while at their default (``lease``: services that know no
    # leases still understand a client that does not ask for one).
    SPARSE: ClassVar[tuple[str, ...]] = ()
    _sparse: ClassVar[tuple[tuple[str, Any], ...]]
    # Set by @message, once: the field names in order, and the decode plan (_fast_values).
    _names: ClassVar[tuple[str, ...]]
    _plan: ClassVar[tuple[_Field, ...]]
    _build: ClassVar[Callable[..., Any]]  # cls(*values) with every field, unrolled (wire._build)

    def to_header(self) -> dict[str, Any]:
        header = {name: getattr(self, name) for name in self._names}
        return _drop_sparse(header, self._sparse) if self._sparse else header

    def needs_server_role(self) -> bool:
        """Must the sender have authenticated as a server? (:attr:`SERVER_ONLY`, or a field says so.)"""
        return self.SERVER_ONLY


def encode_fields(msg: object) -> dict[str, Any]:
    """The header map of a dataclass message: its fields by name, in order (for a request,
    its ``to_header``: without its ``SPARSE`` fields at their defaults)."""
    if isinstance(msg, Message):
        return msg.to_header()
    names = getattr(type(msg), "_names", None)
    if names is None:
        names = [f.name for f in dataclasses.fields(msg)]  # type: ignore[arg-type]
    return {name: getattr(msg, name) for name in names}


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
    if base is int and not _INT_MIN <= value < _INT_END:
        raise StripefsError(ErrorCode.INVALID, f"field {name!r}: integer out of range")
    return value


@typing.dataclass_transform(frozen_default=True)
def message(msg_id: int, *, mutates: bool = False, answered: bool = True,
            server_only: bool = False) -> Callable[[type[T]], type[T]]:
    """Class decorator: make a frozen dataclass and register it under ``msg_id``.

    The class must name its reply type as ``Message[ReplyType]``; ``answered=False``
    is for the one message that gets no response (the server's Challenge);
    ``server_only`` for messages only servers of the cluster may send.
    """

    def wrap(cls: type[T]) -> type[T]:
        if msg_id in MESSAGES:
            raise RuntimeError(f"message id {msg_id} registered twice")
        reply_cls = None
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is Message:
                (reply_cls,) = typing.get_args(base)
        if answered != (reply_cls is not None) or (reply_cls is not None and not issubclass(reply_cls, ReplyMessage)):
            raise RuntimeError(f"{cls.__name__}: declare the reply type as Message[SomeReply]"
                               if answered else f"{cls.__name__}: an unanswered message has no reply type")
        cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
        cls.MSG_ID = msg_id
        cls.MUTATES = mutates
        cls.SERVER_ONLY = server_only
        cls.Reply = reply_cls
        cls._hints = typing.get_type_hints(cls)  # type: ignore[attr-defined]
        cls._names = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        cls._plan = _decode_plan(cls, cls._hints, lambda _name, _tp: None)  # type: ignore[attr-defined]
        cls._build = staticmethod(positional_builder(cls))  # type: ignore[assignment]
        cls._sparse = _sparse(cls)  # type: ignore[attr-defined]
        MESSAGES[msg_id] = cls
        return cls

    return wrap


def decode_message(msg_type: int, header: dict[str, Any]) -> Message[Any]:
    """Build and validate the request for ``msg_type`` from a decoded header.

    Raises:
        StripefsError: PROTOCOL for an unknown id, INVALID for missing, extra
        or mistyped fields.
    """
    cls = MESSAGES.get(msg_type)
    if cls is None:
        raise StripefsError(ErrorCode.PROTOCOL, f"unknown message type {msg_type}")
    if type(header) is dict:
        values = _fast_values(cls._plan, header)
        if values is not None:
            return cls._build(*values)
    return _decode_checked(cls, header)


def _decode_checked(cls: type[Message[Any]], header: Any) -> Message[Any]:
    """decode_message's checked path: every rule, by reflection, and the error that names the first broken one."""
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


def decode_reply(request: "Message[RT] | type[Message[RT]]", header: dict[str, Any]) -> RT:
    """Build and validate the reply to ``request`` (a request or its class) from a response header.

    Args:
        request: the request that was answered, or its class.
        header: the decoded msgpack header of the (non-error) response.

    Returns:
        The typed reply, e.g. an :class:`AttrReply` for a :class:`GetAttr`.

    Raises:
        StripefsError: PROTOCOL for a header with missing or mistyped fields
            (unknown ones are ignored), or for a message that is never answered.
    """
    cls = request.Reply
    if cls is None:
        name = request.__name__ if isinstance(request, type) else type(request).__name__
        raise StripefsError(ErrorCode.PROTOCOL, f"{name} is never answered")
    return cls.from_header(header)  # type: ignore[return-value]


# --- replies -------------------------------------------------------------------------------
# Field names are the wire keys; docs/protocol.md lists which request gets which reply.


@reply
class EmptyReply(ReplyMessage):
    """The answer of requests that return nothing but success (``{}``)."""


@reply
class AuthenticateReply(ReplyMessage):
    proof: bytes  # HMAC-SHA256(secret, "server" | client nonce | server nonce)


@reply
class StatfsReply(ReplyMessage):
    capacity: int  # bytes, over the serving storage servers
    used: int
    free: int
    files: int  # inodes


@reply
class AttrReply(ReplyMessage):
    """The inode's attributes after the operation (Unlink: ``nlink`` after it).

    ``lease_id``/``lease_ms``: only in the answer to a ``Resolve`` that asked for a lease
    (``lease=True``) and got one: the client may answer this path's ``stat`` from its cache
    for ``lease_ms`` milliseconds (counted from before it sent the request) unless a
    ``WatchLeases`` answer names ``lease_id`` first. Absent (0) otherwise, so clients
    that never ask see the map they always did.
    """

    attr: Attr
    lease_id: int = 0
    lease_ms: int = 0
    SPARSE = ("lease_id", "lease_ms")


@reply
class CreateReply(ReplyMessage):
    attr: Attr
    created: bool  # False: the name existed (not exclusive) and was opened


@reply
class ReadlinkReply(ReplyMessage):
    target: str


@reply
class ReaddirReply(ReplyMessage):
    """``lease_id``/``lease_ms``: only in the answer to a ``Readdir`` that asked for a lease
    on a whole listing (the first page, and no more after it), or on each page
    (``lease_each_page``): as :class:`AttrReply`'s, on the directory's attributes (every
    create, unlink or rename in it changes them), and, for a listing with attributes and
    layouts, on the page's files' attributes too."""

    # On the wire by columns (see dir_columns), or [name, ino, mode, attr or None] each. A
    # sender may give a ListingPage made from its own columns (ListingPage.of_rows): sent as is.
    entries: list[DirEntry]
    more: bool  # another page follows (ask again with after=<last name>)
    lease_id: int = 0
    lease_ms: int = 0
    SPARSE = ("lease_id", "lease_ms")

    def to_header(self) -> dict[str, Any]:
        page = self.entries
        columns = page.wire if type(page) is ListingPage and page.wire is not None else dir_columns(page)
        header: dict[str, Any] = ({"columns": columns} if columns is not None
                                  else {"entries": [e.to_wire() for e in self.entries]})
        header.update(more=self.more, lease_id=self.lease_id, lease_ms=self.lease_ms)
        return _drop_sparse(header, self._sparse)

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> ReaddirReply:
        """As :meth:`ReplyMessage.from_header`; a page by columns (``"columns"`` in place
        of ``"entries"``) is rebuilt by :func:`dir_entries_from_columns`."""
        if type(header) is not dict or "columns" not in header:
            return ReplyMessage.from_header.__func__(cls, header)  # type: ignore[attr-defined,no-any-return]
        if "entries" in header:
            raise StripefsError(ErrorCode.PROTOCOL, "ReaddirReply: both 'columns' and 'entries'")
        try:
            entries = dir_entries_from_columns(header["columns"])
        except StripefsError as exc:
            raise StripefsError(ErrorCode.PROTOCOL, f"ReaddirReply: {exc.message}") from None
        rest = ReplyMessage.from_header.__func__(  # type: ignore[attr-defined]
            cls, {k: v for k, v in header.items() if k != "columns"} | {"entries": []})
        return dataclasses.replace(rest, entries=entries)  # type: ignore[no-any-return]

    @classmethod
    def with_page(cls, header: dict[str, Any]) -> tuple[ReaddirReply, ListingPage]:
        """The reply with its ``entries`` left empty, and its page, checked as
        :meth:`from_header` checks it but with the entries not made yet
        (:class:`ListingPage`: made one at a time, as a client keeping the listing needs them).

        Raises:
            StripefsError: PROTOCOL, as :meth:`from_header`.
        """
        if type(header) is not dict or "columns" not in header:
            whole = cls.from_header(header)
            return dataclasses.replace(whole, entries=[]), ListingPage.of(whole.entries)
        if "entries" in header:
            raise StripefsError(ErrorCode.PROTOCOL, "ReaddirReply: both 'columns' and 'entries'")
        try:
            page = ListingPage.from_columns(header["columns"])
        except StripefsError as exc:
            raise StripefsError(ErrorCode.PROTOCOL, f"ReaddirReply: {exc.message}") from None
        rest = ReplyMessage.from_header.__func__(  # type: ignore[attr-defined]
            cls, {k: v for k, v in header.items() if k != "columns"} | {"entries": []})
        return rest, page


@reply
class LayoutReply(ReplyMessage):
    layout: dict[str, int]  # a directory's defaults: {"chunk_size": n, "stripe": n}


@reply
class RoutingReply(ReplyMessage):
    routing: Routing


@reply
class ClusterStatusReply(ReplyMessage):
    metadata: dict[str, Any]  # {"pid", "uptime", and the store's counts, e.g. "inodes"}
    servers: list[ServerInfo]
    chains: list[dict[str, Any]]  # [{"chain_id", "targets", "states"}], by chain id
    replicas: int
    routing_version: int


@reply
class RegisterServerReply(ReplyMessage):
    server_id: int
    state: str  # pending (not admitted yet) | joining | serving | syncing
    routing_version: int


@reply
class HeartbeatReply(ReplyMessage):
    state: str
    routing_version: int


@reply
class SyncDoneReply(ReplyMessage):
    routing_version: int


@reply
class WriteChunkReply(ReplyMessage):
    """``queued_us``: how long the write waited for a slot of its class at the server
    (storage/_qos.py), sent only when it waited: what a background writer paces itself on."""

    length: int  # the chunk's length after the write
    version: int  # the chunk's version after the write
    queued_us: int = 0
    SPARSE = ("queued_us",)


@reply
class ReadChunkReply(ReplyMessage):
    """Header of a chunk read; the bytes are the payload."""

    length: int  # bytes in the payload (fewer than asked at a chunk's end, 0 for a hole)
    chunk_length: int  # the chunk's stored length
    # CRC32C of each payload segment cut at 64 KiB chunk offsets (wire._checksums); None
    # from servers that predate end-to-end checks.
    crcs: list[int] | None = None


@reply
class RemovedReply(ReplyMessage):
    """``applied``/``failed``: only in the answer to a cut sent through a chain
    (:class:`RemoveChunks` with ``chain``): the targets that applied it, head first, and
    the one that did not answer it (0: none; those after it in the chain lack it too)."""

    removed: int  # chunks removed
    applied: list[int] | None = None
    failed: int = 0
    SPARSE = ("applied", "failed")


@reply
class StatChunkReply(ReplyMessage):
    length: int
    version: int
    crcs: list[int]  # CRC32C of each 64 KiB block


@reply
class TargetInfoReply(ReplyMessage):
    server_id: int | None  # None before the server registered
    capacity: int
    free: int
    used: int
    chunks: int
    root: str
    syncing: bool
    sync_progress: dict[str, int]  # {"chain", "total", "done"} of the running resync; {} when none ran


@reply
class ListChunksReply(ReplyMessage):
    chunks: list[list[int]]  # [[ino, index, version, length], ...], in (ino, index) order
    # The content digest of each chunk in ``chunks`` (storage ChunkMeta.digest), so a resync
    # copies a chunk whose bytes differ at the same version; None from older servers.
    digests: list[int] | None = None
    more: bool = False  # a page (ListChunks.limit): ask again after the last entry


@reply
class FetchChunkReply(ReplyMessage):
    """Header of a whole-chunk copy; the chunk's bytes are the payload."""

    version: int
    chain: int
    length: int
    # Whether the source holds the chunk as a record of its container logs (the copy goes
    # where the source's is); None from older servers.
    logged: bool | None = None


@reply
class RemoveServerReply(ReplyMessage):
    state: str  # "draining" (slots still moving) | "removed"
    chains: list[int]  # the server's chains when asked (moving, or with --force lost)
    lost: list[int]  # chains left without any target (force only)
    routing_version: int


@reply
class XattrReply(ReplyMessage):
    value: bytes


@reply
class XattrNamesReply(ReplyMessage):
    names: list[bytes]  # sorted


@reply
class LockReply(ReplyMessage):
    token: int  # fencing token: larger for every new holder
    expires_ns: int  # on the metadata service's clock


@reply
class ReleaseLockReply(ReplyMessage):
    released: bool  # False: the owner did not hold it (expired, taken over)


@reply
class ScrubReply(ReplyMessage):
    checked: int
    bad: list[list[int]]  # [[ino, index, chain], ...] that failed verification
    repaired: int


# --- handshake (1-9) -------------------------------------------------------------------


@message(1, answered=False)
class Challenge(Message):
    """Server -> client on connect: prove you know the cluster secret."""

    nonce: bytes
    role: str  # "metadata" | "storage"
    cluster_id: str


@message(2)
class Authenticate(Message[AuthenticateReply]):
    client_id: bytes  # 16 random bytes, stable per client process
    nonce: bytes
    proof: bytes  # HMAC-SHA256(credential of ``role``, "client" | server nonce | client nonce)
    role: str = "client"  # "client" (applications) or "server" (servers of the cluster)


@message(3)
class Ping(Message[EmptyReply]):
    pass


# --- metadata service (10-39) ------------------------------------------------------------


@message(10)
class Statfs(Message[StatfsReply]):
    pass


@message(11)
class GetAttr(Message[AttrReply]):
    """``lease`` as :class:`Resolve`'s (sent only when true)."""

    ino: int
    lease: bool = False
    SPARSE = ("lease",)


@message(12)
class Lookup(Message[AttrReply]):
    """``lease`` as :class:`Resolve`'s (sent only when true): the lease covers the entry
    and the inode it names."""

    parent: int
    name: str
    lease: bool = False
    SPARSE = ("lease",)


@message(13)
class Resolve(Message[AttrReply]):
    """The attributes of the inode ``path`` leads to. ``lease``: ask for a lease on the
    answer (see :class:`AttrReply`, :class:`WatchLeases`); sent only when true, so services
    that know no leases still understand the request of a client that does not ask."""

    path: str
    follow: bool = True
    lease: bool = False
    SPARSE = ("lease",)


@message(14, mutates=True)
class Create(Message[CreateReply]):
    parent: int
    name: str
    mode: int
    uid: int = 0
    gid: int = 0
    exclusive: bool = False
    truncate: bool = False


@message(15, mutates=True)
class Mkdir(Message[AttrReply]):
    parent: int
    name: str
    mode: int
    uid: int = 0
    gid: int = 0


@message(16, mutates=True)
class Symlink(Message[AttrReply]):
    parent: int
    name: str
    target: str
    uid: int = 0
    gid: int = 0


@message(17)
class Readlink(Message[ReadlinkReply]):
    ino: int


@message(18, mutates=True)
class Link(Message[AttrReply]):
    ino: int
    new_parent: int
    new_name: str


@message(19)
class Readdir(Message[ReaddirReply]):
    """A page of a directory's entries; ``plus`` adds each entry's attributes, and
    ``layouts=False`` leaves files' layouts out of those (a FUSE daemon hands the kernel
    attributes only: the layouts are most of a page's bytes and decoding). ``lease``: as
    ``Resolve``'s (sent only when true), granted for a whole listing only (see
    :class:`ReaddirReply`) -- or for every page with ``lease_each_page`` (a client that
    fetches a large listing page by page, so that no one page holds the service or the
    client for long, and keeps it only when no invalidation came between its pages)."""

    ino: int
    after: str = ""
    limit: int = 1000
    plus: bool = False
    layouts: bool = True
    lease: bool = False
    lease_each_page: bool = False
    SPARSE = ("lease", "lease_each_page")


@message(20, mutates=True)
class Unlink(Message[AttrReply]):
    parent: int
    name: str


@message(21, mutates=True)
class Rmdir(Message[EmptyReply]):
    parent: int
    name: str


@message(22, mutates=True)
class Rename(Message[EmptyReply]):
    parent: int
    name: str
    new_parent: int
    new_name: str
    flags: int = 0


@message(23, mutates=True)
class SetAttr(Message[AttrReply]):
    ino: int
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    size: int | None = None


@message(24, mutates=True)
class CommitLength(Message[AttrReply]):
    ino: int
    length: int
    mtime_ns: int | None = None
    # Attr.truncations as the writer last saw it; when the file was truncated since,
    # the commit does not extend the size (the writer's bytes past it were dropped).
    truncations: int | None = None


@message(25, mutates=True)
class SetLayout(Message[EmptyReply]):
    ino: int
    chunk_size: int | None = None
    stripe: int | None = None


@message(26)
class GetRouting(Message[RoutingReply]):
    pass


@message(27)
class ClusterStatus(Message[ClusterStatusReply]):
    pass


@message(28, mutates=True, server_only=True)
class RegisterServer(Message[RegisterServerReply]):
    host: str
    port: int
    root: str
    server_id: int | None = None
    capacity: int = 0
    used: int = 0
    pid: int = 0
    # The data directory's identity: a random secret created once per storage root
    # (``ROOT/target.json``). A server id is bound to it at its first admission, and only
    # its holder may re-register, heartbeat or report SyncDone under that id.
    token: str = ""


@message(29, server_only=True)
class Heartbeat(Message[HeartbeatReply]):
    server_id: int
    capacity: int = 0
    used: int = 0
    chunks: int = 0
    token: str = ""  # the data directory's identity (see RegisterServer)
    # The file system holding the target: its free bytes (-1: not sent, an older server) and
    # an id that servers sharing one file system share (``statfs`` counts that space once).
    free: int = -1
    fsid: str = ""


@message(30)
class GetLayout(Message[LayoutReply]):
    ino: int


@message(31, mutates=True)
class Mknod(Message[AttrReply]):
    """A FIFO, socket, character or block device node (or an empty regular file).

    ``mode`` carries the type bits (``S_IFIFO``, ``S_IFSOCK``, ``S_IFCHR``, ``S_IFBLK``,
    ``S_IFREG``); ``rdev`` is kept for device nodes only. The file system stores the
    node; the kernel gives it its behaviour.
    """

    parent: int
    name: str
    mode: int
    rdev: int = 0
    uid: int = 0
    gid: int = 0
    # response: {"attr"}


@message(32)
class GetXattr(Message[XattrReply]):
    ino: int
    name: bytes
    # response: {"value"}


@message(33, mutates=True)
class SetXattr(Message[AttrReply]):
    """``flags``: 1 XATTR_CREATE (must not exist), 2 XATTR_REPLACE (must exist)."""

    ino: int
    name: bytes
    value: bytes
    flags: int = 0
    # response: {"attr"}


@message(34)
class ListXattr(Message[XattrNamesReply]):
    ino: int
    # response: {"names": [bytes, ...]}


@message(35, mutates=True)
class RemoveXattr(Message[AttrReply]):
    ino: int
    name: bytes
    # response: {"attr"}


@message(36, mutates=True)
class AcquireLock(Message[LockReply]):
    """Take or renew an advisory lease lock (``key`` is any text, e.g. a path)."""

    key: str
    owner: bytes  # the client session
    ttl_ms: int
    # response: {"token", "expires_ns"}; WOULD_BLOCK while another owner holds it


@message(37, mutates=True)
class ReleaseLock(Message[ReleaseLockReply]):
    key: str
    owner: bytes
    # response: {"released": bool}


# --- storage servers (40-59) -------------------------------------------------------------


# Traffic classes of chunk writes (``WriteChunk.qos``; how a server schedules each:
# storage/_qos.py). By size: a write of at least 1 MiB is bulk, smaller ones go first.
QOS_BY_SIZE, QOS_BULK, QOS_BACKGROUND = 0, 1, 2
QOS_CLASSES = {"interactive": QOS_BY_SIZE, "bulk": QOS_BULK, "background": QOS_BACKGROUND}


@message(40, mutates=True)
class WriteChunk(Message[WriteChunkReply]):
    """Payload: the bytes. ``crc`` is CRC32C of the payload (end-to-end check).

    ``qos``: the write's traffic class (:data:`QOS_CLASSES`), sent only when not by size,
    so the map of an ordinary write is what it always was."""

    ino: int
    index: int
    offset: int
    crc: int
    chunk_size: int
    chain: int = 0  # the chain the chunk belongs to (replicated writes go head -> tail)
    routing_version: int = 0  # the sender's routing table version (STALE_ROUTING if it differs)
    version: int | None = None  # set by the chain head when it forwards to the next replica
    # Set with ``version``: the digest of the chunk once this write is applied (storage
    # ChunkMeta.digest). A replica whose copy at that version differs (it applied another
    # write as the same version before a failure) replaces it from its predecessor rather
    # than acknowledging bytes the chain does not hold.
    digest: int | None = None
    qos: int = QOS_BY_SIZE
    SPARSE = ("qos",)

    def needs_server_role(self) -> bool:
        # A write carrying a version is a replica forwarding along its chain: applied as
        # is, below the head. One naming no chain is stored as is by any server, outside
        # chain replication. Clients write to a chain's head only, without a version.
        return self.version is not None or self.digest is not None or self.chain == 0


@message(41)
class ReadChunk(Message[ReadChunkReply]):
    """Response payload: up to ``length`` bytes (fewer at the chunk's end; holes are short)."""

    ino: int
    index: int
    offset: int
    length: int
    chain: int = 0  # when set, a server that no longer serves the chain answers STALE_ROUTING
    routing_version: int = 0  # the sender's routing version: a server behind it refreshes first


@message(42, mutates=True, server_only=True)
class RemoveChunks(Message[RemovedReply]):
    """Remove every chunk of ``ino`` with index >= ``from_index`` (GC, truncate).

    ``forget``: the file itself is gone (its last name was removed and the grace
    period passed): the server keeps a tombstone, so a late read or write of the
    inode fails with STALE_FILE instead of reading a hole or recreating chunks.

    ``chain`` (a truncation's cut, sent to the chain's head): only that chain's chunks,
    and, with ``part`` = ``[index, length]``, that chunk cut to ``length`` too; the head
    applies it under the lock its writes to the inode take and forwards it down the chain
    (``forwarded``, with its ``routing_version``) like a write, so every replica sees the
    cut and the chain's writes in one order. Sent only when set, so the map of a plain
    removal is what it always was.
    """

    ino: int
    from_index: int = 0
    forget: bool = False
    chain: int = 0
    routing_version: int = 0
    forwarded: bool = False
    part: list[int] | None = None
    SPARSE = ("chain", "routing_version", "forwarded", "part")


@message(43, mutates=True, server_only=True)
class TruncateChunk(Message[EmptyReply]):
    ino: int
    index: int
    length: int


@message(44)
class StatChunk(Message[StatChunkReply]):
    ino: int
    index: int


@message(45)
class TargetInfo(Message[TargetInfoReply]):
    pass


@message(46, server_only=True)
class ListChunks(Message[ListChunksReply]):
    """Chunks of one chain held by a storage server (resync compares versions and digests).

    Paged: with ``limit`` > 0 at most ``limit`` chunks after ``after`` (``[ino, index]``)
    come back, and the reply says whether more follow; ``limit`` 0 lists them all (the
    old form, which past ~88k chunks overflows a frame).
    """

    chain: int
    after: list[int] | None = None
    limit: int = 0


@message(47, server_only=True)
class FetchChunk(Message[FetchChunkReply]):
    """A whole chunk, verified, with its version (payload), for a replica to copy."""

    ino: int
    index: int


@message(48, server_only=True)
class SyncDone(Message[SyncDoneReply]):
    """Storage -> metadata: this server has caught up with its chains."""

    server_id: int
    token: str = ""  # the data directory's identity (see RegisterServer)


@message(49)
class Scrub(Message[ScrubReply]):
    """Verify every chunk on the server; repair bad ones from a replica."""

    repair: bool = True


@message(50, mutates=True, server_only=True)
class DropChain(Message[RemovedReply]):
    """Metadata -> storage: this server left ``chain`` (its data moved): delete its chunks."""

    chain: int


@message(51, mutates=True, server_only=True)
class RemoveServer(Message[RemoveServerReply]):
    """Admin -> metadata: take a storage server out of the cluster for good.

    With every chain of the server served by another replica it is drained: each
    of its chain slots moves to another serving server (resync), then it is
    ``removed``. A chain that only it serves would be lost: refused (PERMISSION,
    naming the chains) unless ``force``, which removes it at once.
    """

    server_id: int
    force: bool = False


# --- path-addressed and batched metadata requests (60-69) ---------------------------------
# One round trip where the per-inode requests need two (resolve the parent, then act), or one
# for many paths. The service resolves and acts in the same batch of its store thread.


@reply
class StatManyReply(ReplyMessage):
    """``attrs`` holds the attributes of the paths that resolved, in request order;
    ``failed`` the indexes of the others and ``codes`` their error codes (same order).

    ``lease_ids``/``lease_ms``: only in the answer to a ``StatMany`` that asked for leases
    (see :class:`AttrReply`): one lease id per attribute of ``attrs`` (0: none for that
    one), all for ``lease_ms``. Absent otherwise."""

    attrs: list[Attr]
    failed: list[int]
    codes: list[int]
    lease_ids: list[int] | None = None
    lease_ms: int = 0
    SPARSE = ("lease_ids", "lease_ms")

    def per_item(self, names: list[str], what: str) -> "list[Attr | StripefsError]":
        """Per name asked (in order): its attributes, or its error (returned, not raised).

        Raises:
            StripefsError: PROTOCOL when the answer does not match ``names`` (``what``: the
                request, for the message).
        """
        n = len(names)
        if (len(self.attrs) + len(self.failed) != n or len(self.codes) != len(self.failed)
                or len(set(self.failed)) != len(self.failed) or not all(0 <= i < n for i in self.failed)):
            raise StripefsError(ErrorCode.PROTOCOL, f"{what}: answer does not match the names asked")
        attrs, errors = iter(self.attrs), dict(zip(self.failed, self.codes))
        return [StripefsError(errors[i], "", names[i]) if i in errors else next(attrs) for i in range(n)]


@message(60, mutates=True)
class CreatePath(Message[CreateReply]):
    """``Create`` of the last component of ``path`` in the directory its head resolves to."""

    path: str
    mode: int
    uid: int = 0
    gid: int = 0
    exclusive: bool = False
    truncate: bool = False


@message(61, mutates=True)
class UnlinkPath(Message[AttrReply]):
    """``Unlink`` of the last component of ``path``."""

    path: str


@message(62)
class StatMany(Message[StatManyReply]):
    """``Resolve`` of up to 200 paths in one round trip (one read transaction); ``lease``
    as ``Resolve``'s (sent only when true)."""

    paths: list[str]
    follow: bool = True
    lease: bool = False
    SPARSE = ("lease",)


@reply
class NamesReply(ReplyMessage):
    """``lease_id``/``lease_ms``: only in the answer to a ``ListNames`` that asked for a lease
    on a whole listing (the first page, and no more after it): as :class:`AttrReply`'s."""

    names: list[str]  # in name (UTF-8 byte) order
    more: bool  # another page follows (ask again with after=<last name>)
    lease_id: int = 0
    lease_ms: int = 0
    SPARSE = ("lease_id", "lease_ms")


@message(63)
class ListNames(Message[NamesReply]):
    """The names in the directory ``path`` resolves to (symlinks followed), one page
    of at most 2000: what ``listdir`` needs, in one round trip and without a
    per-entry record to build on either side. ``lease``: as ``Resolve``'s (sent only when
    true), granted for a whole listing only."""

    path: str
    after: str = ""
    limit: int = 1000
    lease: bool = False
    SPARSE = ("lease",)


@message(64, mutates=True)
class CreateMany(Message[StatManyReply]):
    """``CreatePath`` of up to 200 paths in one round trip and one store transaction: empty
    regular files, each with ``mode``, ``uid``, ``gid``. ``exclusive``: an existing name is
    EEXIST; otherwise an existing file is answered as it is (never truncated). Answered like
    ``StatMany``: the attributes of each path that succeeded, in order, the indexes of the
    others and their error codes. More than 200 paths, or a path that is not text, refuse the
    whole request (EINVAL); a bad path (missing parent, name too long...) fails alone."""

    paths: list[str]
    mode: int
    uid: int = 0
    gid: int = 0
    exclusive: bool = True


@message(65, mutates=True)
class UnlinkMany(Message[StatManyReply]):
    """``UnlinkPath`` of up to 200 paths in one round trip and one store transaction,
    answered like ``CreateMany`` (each attribute with its new link count)."""

    paths: list[str]


@reply
class WatchLeasesReply(ReplyMessage):
    """Invalidations for the asking client: ``lease_ids`` (its leases whose keys changed) up
    to ``seq``; none after the service's wait (``seq`` unchanged). ``reset``: the service does
    not know the leases this client holds (it restarted): drop every lease-held entry.
    ``session_ms``: the watch asked for a session and has one of this length (the client
    trusts its leases only within it of sending a watch that was answered); 0: none."""

    seq: int
    lease_ids: list[int]
    reset: bool = False
    session_ms: int = 0
    SPARSE = ("session_ms",)


@message(66)
class WatchLeases(Message[WatchLeasesReply]):
    """Long poll for lease invalidations, on a connection of its own. ``after``: the last
    ``seq`` the client processed (it acknowledges every invalidation up to it); 0 starts a
    watch (answered at once). Answered as soon as an invalidation past ``after`` is queued for
    this client, else after about ``wait_ms`` milliseconds with none. ``session``: ask for a
    session (answers at least every third of its length while leases are held; a change
    waits at most its length for this client). ``done``: lease ids past ``after`` whose
    invalidation the client finished (acknowledged out of order). Both sent only when set."""

    after: int
    wait_ms: int = 10_000
    session: bool = False
    done: list[int] = dataclasses.field(default_factory=list)
    SPARSE = ("session", "done")


@reply
class ReserveFilesReply(ReplyMessage):
    """``count`` reservations: ``inos[i]`` with its reservation id ``ids[i]`` and its layout
    (``chunk_sizes[i]``, ``chains[i]``), for a client to write chunks of files that do not
    exist yet (``CommitFiles`` makes them)."""

    inos: list[int]
    ids: list[int]
    chunk_sizes: list[int]
    chains: list[list[int]]


@message(67, mutates=True)
class ReserveFiles(Message[ReserveFilesReply]):
    """Reserve ``count`` (1..200) inode numbers, each with the layout a new file in the
    directory ``parent`` (a path; or the directory inode ``parent_ino`` when it is not 0:
    a mount, which knows inodes, not paths) would get. A reservation not committed within
    the service's grace (minutes) is garbage: its chunks are dropped and the inode number
    is never used."""

    parent: str
    count: int
    parent_ino: int = 0

    SPARSE = ("parent_ino",)  # left out at 0: a client by path still speaks to older services


@message(68, mutates=True)
class CommitFiles(Message[StatManyReply]):
    """Make up to 200 whole files from reservations, in one transaction: ``paths[i]`` becomes
    the regular file ``inos[i]`` (reservation ``ids[i]``), ``lengths[i]`` bytes long (the
    client wrote them, durably, first), with ``mode``/``uid``/``gid`` and mtime ``mtime_ns``
    (0: now). An existing regular file at a path is replaced, as a rename over it would
    (``exclusive``: EEXIST instead). Answered like ``CreateMany``; a path fails alone
    (ESTALE: its reservation expired, write it again). With ``parent_ino`` (not 0) each
    ``paths[i]`` is a name in that directory (a mount's files, known by inode)."""

    paths: list[str]
    inos: list[int]
    ids: list[int]
    lengths: list[int]
    mode: int
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    exclusive: bool = False
    parent_ino: int = 0

    SPARSE = ("parent_ino",)  # left out at 0: a client by path still speaks to older services


@message(69, mutates=True)
class SymlinkMany(Message[StatManyReply]):
    """``Symlink`` of up to 200 names in directory ``parent``, in one round trip and one
    store transaction: ``names[i]`` -> ``targets[i]``. ``replace``: a name that is a symlink
    already is pointed at the new target (its old inode goes, atomically with the new one's
    making; any other type stays and fails EEXIST). Answered like ``CreateMany``; a name
    fails alone."""

    parent: int
    names: list[str]
    targets: list[str]
    uid: int = 0
    gid: int = 0
    replace: bool = False
