"""The message table, validation, error mapping and auth proofs."""

from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import typing
from typing import Any

import crc32c
import pytest
from hypothesis import given, settings, strategies as st

from stripefs import wire
from stripefs.wire import ErrorCode, StripefsError, decode_message, messages as m


def test_message_ids_are_unique_and_stable() -> None:
    assert m.ReadChunk.MSG_ID == 41 and m.WriteChunk.MSG_ID == 40 and m.Create.MSG_ID == 14
    assert len({cls.MSG_ID for cls in wire.MESSAGES.values()}) == len(wire.MESSAGES)


def test_roundtrip_through_header() -> None:
    msg = m.Create(parent=1, name="x", mode=0o644, exclusive=True)
    assert decode_message(msg.MSG_ID, msg.to_header()) == msg
    assert m.Create.MUTATES and not m.GetAttr.MUTATES


@pytest.mark.parametrize(
    "msg_type, header",
    [
        (11, {}),  # missing field
        (11, {"ino": "1"}),  # wrong type
        (11, {"ino": True}),  # bool is not an int here
        (11, {"ino": 1, "extra": 2}),  # unknown field
        (11, {"ino": 2**70}),  # out of range
        (23, {"ino": 1, "size": "big"}),
    ],
)
def test_invalid_fields(msg_type: int, header: dict) -> None:
    with pytest.raises(StripefsError) as exc:
        decode_message(msg_type, header)
    assert exc.value.errno == errno.EINVAL


def test_unknown_message_type() -> None:
    with pytest.raises(StripefsError) as exc:
        decode_message(9999, {})
    assert exc.value.code == ErrorCode.PROTOCOL


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(wire.MESSAGES)), st.dictionaries(st.text(max_size=10), st.one_of(st.none(), st.integers(), st.text(max_size=5), st.booleans(), st.binary(max_size=5))))
def test_fuzz_decode_message(msg_type: int, header: dict) -> None:
    try:
        decode_message(msg_type, header)
    except StripefsError as exc:
        assert exc.code in (ErrorCode.INVALID, ErrorCode.PROTOCOL)


@pytest.mark.parametrize(
    "code, builtin",
    [
        (ErrorCode.NOT_FOUND, FileNotFoundError),
        (ErrorCode.EXISTS, FileExistsError),
        (ErrorCode.IS_DIR, IsADirectoryError),
        (ErrorCode.NOT_DIR, NotADirectoryError),
        (ErrorCode.PERMISSION, PermissionError),
        (ErrorCode.TIMEOUT, TimeoutError),
    ],
)
def test_errors_are_builtin_oserrors(code: ErrorCode, builtin: type) -> None:
    exc = StripefsError(code, "boom", "/p")
    assert isinstance(exc, builtin) and isinstance(exc, StripefsError)
    assert exc.errno == code.errno and exc.filename == "/p"
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and again.code == code
    wired = StripefsError.from_wire(exc.to_wire())
    assert wired.code == code and wired.message == "boom"


def test_every_code_has_an_errno() -> None:
    for code in ErrorCode:
        assert isinstance(code.errno, int)
    assert ErrorCode.NOT_EMPTY.errno == errno.ENOTEMPTY and ErrorCode.NAME_TOO_LONG.errno == errno.ENAMETOOLONG
    assert wire.error_from_oserror(OSError(errno.ENOSPC, "full")).code == ErrorCode.NO_SPACE


def test_auth_proofs() -> None:
    s, c = wire.new_nonce(), wire.new_nonce()
    proof = wire.client_proof("secret", s, c)
    assert wire.check_proof(wire.client_proof("secret", s, c), proof)
    assert not wire.check_proof(wire.client_proof("other", s, c), proof)
    assert not wire.check_proof(wire.server_proof("secret", s, c), proof)  # roles differ
    assert not wire.check_proof(proof, "not bytes")


# --- replies ---------------------------------------------------------------------------------

# The reply type of every request: pinned, because it is part of the protocol.
REPLY_OF = {
    "Challenge": None, "Authenticate": "AuthenticateReply", "Ping": "EmptyReply", "Statfs": "StatfsReply",
    "GetAttr": "AttrReply", "Lookup": "AttrReply", "Resolve": "AttrReply", "Create": "CreateReply",
    "Mkdir": "AttrReply", "Symlink": "AttrReply", "Readlink": "ReadlinkReply", "Link": "AttrReply",
    "Readdir": "ReaddirReply", "Unlink": "AttrReply", "Rmdir": "EmptyReply", "Rename": "EmptyReply",
    "SetAttr": "AttrReply", "CommitLength": "AttrReply", "SetLayout": "EmptyReply", "GetRouting": "RoutingReply",
    "ClusterStatus": "ClusterStatusReply", "RegisterServer": "RegisterServerReply", "Heartbeat": "HeartbeatReply",
    "GetLayout": "LayoutReply", "WriteChunk": "WriteChunkReply", "ReadChunk": "ReadChunkReply",
    "RemoveChunks": "RemovedReply", "TruncateChunk": "EmptyReply", "StatChunk": "StatChunkReply",
    "TargetInfo": "TargetInfoReply", "ListChunks": "ListChunksReply", "FetchChunk": "FetchChunkReply",
    "SyncDone": "SyncDoneReply", "Scrub": "ScrubReply", "DropChain": "RemovedReply",
    "RemoveServer": "RemoveServerReply",
    "Mknod": "AttrReply", "GetXattr": "XattrReply", "SetXattr": "AttrReply", "ListXattr": "XattrNamesReply",
    "RemoveXattr": "AttrReply", "AcquireLock": "LockReply", "ReleaseLock": "ReleaseLockReply",
    "CreatePath": "CreateReply", "UnlinkPath": "AttrReply", "StatMany": "StatManyReply",
    "ListNames": "NamesReply", "CreateMany": "StatManyReply", "UnlinkMany": "StatManyReply",
    "SymlinkMany": "StatManyReply",
    "WatchLeases": "WatchLeasesReply", "ReserveFiles": "ReserveFilesReply", "CommitFiles": "StatManyReply",
}

LAYOUT = wire.Layout(1 << 20, (3, 1, 2))
ATTR = wire.Attr(7, 0o100644, 1, 1000, 1000, 12345, 1, 2, 3, LAYOUT)
SERVER = wire.ServerInfo(1, "127.0.0.1", 4000, "serving", 100, 10, 42, 1.5)
ROUTING = wire.Routing(3, {1: (1, 2)}, {1: SERVER}, {1: ((1, "serving"), (2, "syncing"))}, 2)

# One instance of every reply type, with the header map it must travel as (the wire format).
SAMPLES: list[tuple[m.ReplyMessage, dict]] = [
    (m.EmptyReply(), {}),
    (m.AuthenticateReply(proof=b"p" * 32), {"proof": b"p" * 32}),
    (m.StatfsReply(capacity=100, used=10, free=90, files=3), {"capacity": 100, "used": 10, "free": 90, "files": 3}),
    (m.AttrReply(attr=ATTR), {"attr": ATTR.to_wire()}),
    (m.AttrReply(attr=ATTR, lease_id=9, lease_ms=5000), {"attr": ATTR.to_wire(), "lease_id": 9, "lease_ms": 5000}),
    (m.CreateReply(attr=ATTR, created=True), {"attr": ATTR.to_wire(), "created": True}),
    (m.ReadlinkReply(target="/x"), {"target": "/x"}),
    (m.ReaddirReply(entries=[wire.DirEntry("a", 7, 0o100644, ATTR), wire.DirEntry("b", 8, 0o40755)], more=False),
     {"entries": [["a", 7, 0o100644, ATTR.to_wire()], ["b", 8, 0o40755, None]], "more": False}),
    (m.LayoutReply(layout={"chunk_size": 1 << 20, "stripe": 4}), {"layout": {"chunk_size": 1 << 20, "stripe": 4}}),
    (m.RoutingReply(routing=ROUTING), {"routing": ROUTING.to_wire()}),
    (m.ClusterStatusReply(metadata={"pid": 1, "inodes": 2}, servers=[SERVER],
                          chains=[{"chain_id": 1, "targets": [1, 2], "states": ["serving", "syncing"]}],
                          replicas=2, routing_version=3),
     {"metadata": {"pid": 1, "inodes": 2}, "servers": [SERVER.to_wire()],
      "chains": [{"chain_id": 1, "targets": [1, 2], "states": ["serving", "syncing"]}], "replicas": 2, "routing_version": 3}),
    (m.RegisterServerReply(server_id=1, state="serving", routing_version=3), {"server_id": 1, "state": "serving", "routing_version": 3}),
    (m.HeartbeatReply(state="syncing", routing_version=4), {"state": "syncing", "routing_version": 4}),
    (m.SyncDoneReply(routing_version=5), {"routing_version": 5}),
    (m.WriteChunkReply(length=4096, version=2), {"length": 4096, "version": 2}),
    (m.ReadChunkReply(length=100, chunk_length=4096, crcs=[7]), {"length": 100, "chunk_length": 4096, "crcs": [7]}),
    (m.RemovedReply(removed=3), {"removed": 3}),
    (m.StatChunkReply(length=10, version=1, crcs=[1, 2]), {"length": 10, "version": 1, "crcs": [1, 2]}),
    (m.TargetInfoReply(server_id=None, capacity=10, free=5, used=5, chunks=1, root="/r", syncing=False, sync_progress={}),
     {"server_id": None, "capacity": 10, "free": 5, "used": 5, "chunks": 1, "root": "/r", "syncing": False, "sync_progress": {}}),
    (m.ListChunksReply(chunks=[[7, 0, 1, 100]], digests=[9], more=True),
     {"chunks": [[7, 0, 1, 100]], "digests": [9], "more": True}),
    (m.FetchChunkReply(version=1, chain=2, length=100), {"version": 1, "chain": 2, "length": 100, "logged": None}),
    (m.FetchChunkReply(version=1, chain=2, length=100, logged=True),
     {"version": 1, "chain": 2, "length": 100, "logged": True}),
    (m.ScrubReply(checked=4, bad=[[7, 0, 1]], repaired=1), {"checked": 4, "bad": [[7, 0, 1]], "repaired": 1}),
    (m.XattrReply(value=b"\x00v"), {"value": b"\x00v"}),
    (m.XattrNamesReply(names=[b"user.a", b"user.b"]), {"names": [b"user.a", b"user.b"]}),
    (m.LockReply(token=3, expires_ns=10**18), {"token": 3, "expires_ns": 10**18}),
    (m.ReleaseLockReply(released=True), {"released": True}),
    (m.RemoveServerReply(state="draining", chains=[1, 5], lost=[], routing_version=6),
     {"state": "draining", "chains": [1, 5], "lost": [], "routing_version": 6}),
    (m.StatManyReply(attrs=[ATTR], failed=[0], codes=[1]), {"attrs": [ATTR.to_wire()], "failed": [0], "codes": [1]}),
    (m.NamesReply(names=["a", "b"], more=True), {"names": ["a", "b"], "more": True}),
    (m.WatchLeasesReply(seq=4, lease_ids=[7, 9]), {"seq": 4, "lease_ids": [7, 9], "reset": False}),
    (m.ReserveFilesReply(inos=[7], ids=[2], chunk_sizes=[1 << 20], chains=[[3, 1]]),
     {"inos": [7], "ids": [2], "chunk_sizes": [1 << 20], "chains": [[3, 1]]}),
    (m.StatManyReply(attrs=[ATTR], failed=[], codes=[], lease_ids=[3], lease_ms=5000),
     {"attrs": [ATTR.to_wire()], "failed": [], "codes": [], "lease_ids": [3], "lease_ms": 5000}),
]


def _over_the_wire(header: dict) -> dict:
    """A header after msgpack encoding and decoding, as a response frame (tuples become lists)."""
    dec = wire.FrameDecoder()
    dec.feed(wire.encode_frame(41, 9, header, flags=wire.FLAG_RESPONSE))
    frame = dec.next_event()
    assert isinstance(frame, wire.Frame) and frame.head.is_response
    return frame.head.header


def test_every_request_names_its_reply_type() -> None:
    assert {cls.__name__: cls.Reply and cls.Reply.__name__ for cls in wire.MESSAGES.values()} == REPLY_OF
    for cls in wire.MESSAGES.values():
        assert cls.Reply is None or issubclass(cls.Reply, wire.ReplyMessage)
    assert m.GetAttr(ino=1).Reply is m.AttrReply  # on instances too


def test_every_reply_type_has_a_sample() -> None:
    used = {cls.Reply for cls in wire.MESSAGES.values() if cls.Reply is not None}
    assert used == {type(r) for r, _ in SAMPLES}


@pytest.mark.parametrize("reply, header", SAMPLES, ids=[type(r).__name__ for r, _ in SAMPLES])
def test_reply_roundtrip_keeps_the_wire_format(reply: m.ReplyMessage, header: dict) -> None:
    assert reply.to_header() == header  # the keys (and value encodings) on the wire are unchanged
    request = next(cls for cls in wire.MESSAGES.values() if cls.Reply is type(reply))
    assert wire.decode_reply(request, _over_the_wire(reply.to_header())) == reply
    assert type(reply).from_header(header) == reply


def test_typed_fields_are_value_types() -> None:
    r = wire.decode_reply(m.Readdir, _over_the_wire(SAMPLES[7][1]))
    assert r.entries[0].attr == ATTR and r.entries[0].attr.layout.chains == (3, 1, 2) and r.more is False
    assert wire.decode_reply(m.GetRouting, _over_the_wire({"routing": ROUTING.to_wire()})).routing.chains == {1: (1, 2)}
    assert wire.decode_reply(m.ClusterStatus, SAMPLES[10][1]).servers[0].pid == 42


@pytest.mark.parametrize(
    "request_cls, header",
    [
        (m.ReadChunk, {"length": 1}),  # missing field
        (m.ReadChunk, {"length": "1", "chunk_length": 2}),  # wrong type
        (m.ReadChunk, {"length": True, "chunk_length": 2}),  # bool is not an int here
        (m.ReadChunk, {"length": 2**70, "chunk_length": 2}),  # out of range
        (m.ReadChunk, {"length": None, "chunk_length": 2}),
        (m.ReadChunk, [1, 2]),  # not a map
        (m.WriteChunk, {}),
        (m.GetAttr, {"attr": "not a map"}),  # a value type that does not decode
        (m.GetAttr, {"attr": {"ino": 1}}),
        (m.Readdir, {"entries": [["a", 1]], "more": False}),
        (m.Readdir, {"entries": "no", "more": False}),
        (m.Readdir, {"entries": [["a", "x", 1, None]], "more": False}),  # from_wire raising ValueError
        (m.GetRouting, {"routing": {"version": 1}}),
        (m.Create, {"attr": ATTR.to_wire(), "created": 1}),
        (m.TargetInfo, {**SAMPLES[18][1], "server_id": "1"}),
        (m.StatChunk, {"length": 1, "version": 1, "crcs": 5}),
        (m.Challenge, {}),  # never answered
    ],
)
def test_invalid_replies_are_protocol_errors(request_cls: type, header: object) -> None:
    with pytest.raises(StripefsError) as exc:
        wire.decode_reply(request_cls, header)  # type: ignore[arg-type]
    assert exc.value.code == ErrorCode.PROTOCOL and exc.value.errno == errno.EPROTO


def test_a_reply_field_this_version_does_not_know_is_ignored() -> None:
    """A newer peer's addition to a reply (an advisory field) is dropped, on both decode
    paths, and the fields this version knows still have to be there and right."""
    got = wire.decode_reply(m.ReadChunk, {"length": 1, "chunk_length": 2, "from_the_future": [1, {"x": 2}]})
    assert (got.length, got.chunk_length) == (1, 2)
    copy = wire.decode_reply(m.FetchChunk, {"version": 3, "chain": 1, "length": 9, "logged": True, "newer": 1})
    assert copy.logged is True and copy.length == 9
    with pytest.raises(StripefsError) as exc:
        wire.decode_reply(m.ReadChunk, {"chunk_length": 2, "from_the_future": 1})  # still missing "length"
    assert exc.value.code == ErrorCode.PROTOCOL


def test_optional_reply_field_accepts_none_and_its_type() -> None:
    header = SAMPLES[18][1]
    assert wire.decode_reply(m.TargetInfo, header).server_id is None
    assert wire.decode_reply(m.TargetInfo, {**header, "server_id": 3}).server_id == 3


_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)
_INT = st.integers(-(2**63), 2**63 - 1)  # int64, what every store keeps
_U32 = st.integers(0, 2**32 - 1)
_LAYOUT = st.builds(wire.Layout, st.sampled_from([1 << 16, 1 << 20, 1 << 26]), st.lists(_U32, min_size=1, max_size=4).map(tuple))
_ATTR = st.builds(wire.Attr, _INT, _INT, _INT, _INT, _INT, _INT, _INT, _INT, _INT, st.none() | _LAYOUT, st.none() | _TEXT)
_SERVER = st.builds(wire.ServerInfo, _INT, _TEXT, _INT, _TEXT, _INT, _INT, _INT, st.floats(allow_nan=False))
_ROUTING = st.builds(
    wire.Routing, _INT,
    st.dictionaries(_U32, st.lists(_U32, max_size=3).map(tuple), max_size=3),
    st.lists(_SERVER, max_size=3, unique_by=lambda s: s.server_id).map(lambda ss: {s.server_id: s for s in ss}),
    st.dictionaries(_U32, st.lists(st.tuples(_U32, _TEXT), max_size=3).map(tuple), max_size=3),
    _INT,
)
_SCALAR = st.none() | _INT | _TEXT | st.booleans()
_FIELD: dict[object, st.SearchStrategy] = {
    int: _INT, str: _TEXT, bool: st.booleans(), bool | None: st.none() | st.booleans(), bytes: st.binary(max_size=8),
    int | None: st.none() | _INT,
    wire.Attr: _ATTR, list[wire.Attr]: st.lists(_ATTR, max_size=3), wire.Routing: _ROUTING, list[wire.ServerInfo]: st.lists(_SERVER, max_size=3),
    list[wire.DirEntry]: st.lists(st.builds(wire.DirEntry, _TEXT, _INT, _INT, st.none() | _ATTR), max_size=3),
    list[int]: st.lists(_INT, max_size=4), list[str]: st.lists(_TEXT, max_size=3), list[int] | None: st.none() | st.lists(_INT, max_size=4), list[bytes]: st.lists(st.binary(max_size=8), max_size=3), list[list[int]]: st.lists(st.lists(_INT, max_size=4), max_size=3),
    dict[str, int]: st.dictionaries(_TEXT, _INT, max_size=3), dict[str, Any]: st.dictionaries(_TEXT, _SCALAR, max_size=3),
    list[dict[str, Any]]: st.lists(st.dictionaries(_TEXT, _SCALAR, max_size=3), max_size=3),
}


def _replies() -> st.SearchStrategy:
    strategies = []
    for cls in sorted({c.Reply for c in wire.MESSAGES.values() if c.Reply is not None}, key=lambda c: c.__name__):
        hints = typing.get_type_hints(cls)
        fields = {f.name: _FIELD[hints[f.name]] for f in dataclasses.fields(cls)}
        strategies.append(st.builds(cls, **fields))
    return st.one_of(strategies)


@settings(max_examples=300, deadline=None)
@given(_replies())
def test_hypothesis_reply_roundtrip(reply: m.ReplyMessage) -> None:
    request = next(cls for cls in wire.MESSAGES.values() if cls.Reply is type(reply))
    assert wire.decode_reply(request, _over_the_wire(reply.to_header())) == reply


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([c for c in sorted(wire.MESSAGES) if wire.MESSAGES[c].Reply is not None]),
       st.dictionaries(st.text(max_size=10), st.one_of(st.none(), st.integers(), st.text(max_size=5), st.booleans(),
                                                       st.binary(max_size=5), st.lists(st.integers(), max_size=3))))
def test_fuzz_decode_reply(msg_type: int, header: dict) -> None:
    try:
        wire.decode_reply(wire.MESSAGES[msg_type], header)
    except StripefsError as exc:
        assert exc.code == ErrorCode.PROTOCOL


def test_integers_are_int64_at_the_boundary() -> None:
    # Every store keeps 64-bit signed integers: a value past them is a bad request here,
    # not an "internal error" from the database later.
    for bad in (1 << 63, (1 << 64) - 1, -(1 << 63) - 1):
        with pytest.raises(StripefsError) as info:
            wire.decode_message(m.GetAttr.MSG_ID, {"ino": bad})
        assert info.value.code == ErrorCode.INVALID
    assert wire.decode_message(m.GetAttr.MSG_ID, {"ino": (1 << 63) - 1}) == m.GetAttr(ino=(1 << 63) - 1)


def test_names_that_are_not_utf8_cross_the_wire_unchanged() -> None:
    # Linux names are bytes; Python carries undecodable ones as surrogate escapes.
    name = os.fsdecode(b"caf\xe9-\xff")
    frame = wire.encode_frame(m.Lookup.MSG_ID, 1, m.Lookup(parent=1, name=name).to_header())
    dec = wire.FrameDecoder()
    dec.feed(frame)
    ev = dec.next_event()
    assert wire.decode_message(ev.head.msg_type, ev.head.header) == m.Lookup(parent=1, name=name)
    assert os.fsencode(name) == b"caf\xe9-\xff"


def test_segments_cut_at_block_boundaries_and_check() -> None:
    B = wire.CRC_BLOCK
    assert list(wire.segments(0, 3 * B)) == [(0, B), (B, 2 * B), (2 * B, 3 * B)]
    assert list(wire.segments(B - 10, 30)) == [(B - 10, B), (B, B + 20)]
    assert list(wire.segments(5, 10)) == [(5, 15)]
    data = memoryview(os.urandom(B + 50))
    crcs = [crc32c.crc32c(data[:B - 10]), crc32c.crc32c(data[B - 10:])]
    wire.check_segments(data, 10, crcs)
    bad = bytearray(data)
    bad[B + 3] ^= 1
    for payload, sums in ((memoryview(bad), crcs), (data, crcs[:1])):
        with pytest.raises(StripefsError) as info:
            wire.check_segments(payload, 10, sums)
        assert info.value.code == ErrorCode.CHECKSUM


@pytest.mark.parametrize("request_cls, header", [
    (m.GetAttr, {"attr": {**ATTR.to_wire(), "size": float("inf")}}),
    (m.GetAttr, {"attr": {**ATTR.to_wire(), "layout": {"chunk_size": float("inf"), "chains": [1]}}}),
    (m.Readdir, {"entries": [["a", float("inf"), 0o100644, None]], "more": False}),
    (m.Readdir, {"entries": [["a", 7, 0o100644, {**ATTR.to_wire(), "ino": float("-inf")}]], "more": False}),
])
def test_an_infinite_number_where_an_int_is_due_is_a_protocol_error(request_cls: type, header: dict) -> None:
    # msgpack carries IEEE floats, infinities included; int() of one raises OverflowError.
    with pytest.raises(StripefsError) as exc:
        wire.decode_reply(request_cls, _over_the_wire(header))
    assert exc.value.code == ErrorCode.PROTOCOL


@pytest.mark.parametrize("args, cls_name, code, errno_, message, strerror, filename", [
    ((ErrorCode.NOT_FOUND,), "StripefsFileNotFoundError", ErrorCode.NOT_FOUND, errno.ENOENT, "not found", "not found", None),
    ((2, "x", "/p"), "StripefsFileExistsError", ErrorCode.EXISTS, errno.EEXIST, "x", "x", "/p"),
    ((ErrorCode.NAME_TOO_LONG, ""), "StripefsError", ErrorCode.NAME_TOO_LONG, errno.ENAMETOOLONG, "name too long",
     "name too long", None),
    ((999,), "StripefsError", ErrorCode.IO, errno.EIO, "io", "i/o error", None),  # an unknown code is an I/O error
    ((999, "m"), "StripefsError", ErrorCode.IO, errno.EIO, "m", "m", None),
    ((True,), "StripefsFileNotFoundError", ErrorCode.NOT_FOUND, errno.ENOENT, "not found", "not found", None),
    ((2.0,), "StripefsFileExistsError", ErrorCode.EXISTS, errno.EEXIST, "exists", "exists", None),
])
def test_error_construction(args: tuple, cls_name: str, code: ErrorCode, errno_: int, message: str, strerror: str,
                            filename: str | None) -> None:
    exc = StripefsError(*args)
    assert type(exc).__name__ == cls_name and type(exc.code) is ErrorCode and exc.code == code
    assert (exc.errno, exc.message, exc.strerror, exc.filename) == (errno_, message, strerror, filename)
    assert exc.args == (errno_, strerror)


def test_every_code_builds_its_error_and_crosses_the_wire() -> None:
    for code in ErrorCode:
        exc = StripefsError(code)
        assert exc.code is code and exc.errno == code.errno and exc.message == code.name.lower().replace("_", " ")
        back = StripefsError.from_wire(exc.to_wire())
        assert type(back) is type(exc) and back.code is code and back.message == exc.message
    assert StripefsError.from_wire({}).code is ErrorCode.IO
    assert StripefsError.from_wire({"code": "2", "message": 5}).message == "5"  # a bad code is an I/O error
    assert StripefsError.from_wire({"code": "2"}).code is ErrorCode.IO
    with pytest.raises(TypeError):
        StripefsError([1])  # type: ignore[arg-type]


def test_a_directory_inode_travels_only_when_given() -> None:
    """``ReserveFiles``/``CommitFiles`` by path carry no ``parent_ino`` (an older metadata
    service refuses fields it does not know); by inode (a mount's) they do, and decode back."""
    by_path = m.ReserveFiles(parent="/d", count=3)
    assert "parent_ino" not in by_path.to_header()
    commit = m.CommitFiles(paths=["/d/a"], inos=[9], ids=[1], lengths=[5], mode=0o644)
    assert "parent_ino" not in commit.to_header()
    by_ino = m.CommitFiles(paths=["a"], inos=[9], ids=[1], lengths=[5], mode=0o644, parent_ino=7)
    assert by_ino.to_header()["parent_ino"] == 7
    assert decode_message(m.CommitFiles.MSG_ID, by_ino.to_header()) == by_ino
    assert decode_message(m.ReserveFiles.MSG_ID, by_path.to_header()) == by_path
