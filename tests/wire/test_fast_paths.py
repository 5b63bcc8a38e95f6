"""The codec's fast paths accept and reject exactly what the checked paths do.

Requests, replies and the value types (``Attr``, ``Layout``, ``DirEntry``) decode
in two steps: a fast path that only accepts values of the exact types msgpack
yields, and the checked (reflective) path for everything else, which raises the
typed error. These tests feed both with the same valid and malformed input and
require the same object or the same error; and pin the bytes on the wire, so a
faster encoder cannot change the format old peers read.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stripefs import wire
from stripefs.wire import StripefsError
from stripefs.wire import messages as m


class _Int(int):
    pass


class _Str(str):
    pass


class _Code(enum.IntEnum):
    SEVEN = 7


# Values of the wrong type, or of the right type but past the limits, or of a subclass of it.
_ODD = st.sampled_from([None, True, False, 1.5, 2.0, "7", b"7", 1 << 63, -(1 << 63) - 1, 1 << 70, [1], (1,), [],
                        {}, {"a": 1}, _Int(3), _Str("x"), _Code.SEVEN, float("inf")])
_INT = st.integers(-(2**63), 2**63 - 1)
_VALID: dict[Any, st.SearchStrategy[Any]] = {
    int: _INT, str: st.text(max_size=6), bool: st.booleans(), bytes: st.binary(max_size=6),
    int | None: st.none() | _INT, list[int] | None: st.none() | st.lists(_INT, max_size=3),
    list[str]: st.lists(st.text(max_size=4), max_size=3), list[int]: st.lists(_INT, max_size=3),
}
_ABSENT = object()


def _typed(value: Any) -> Any:
    """``value`` with the exact type of everything in it spelled out (``True == 1`` otherwise)."""
    if dataclasses.is_dataclass(value):
        return type(value), [(f.name, _typed(getattr(value, f.name))) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return type(value), [_typed(v) for v in value]
    if isinstance(value, dict):
        return type(value), [(_typed(k), _typed(v)) for k, v in value.items()]
    return type(value), value


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    """What ``fn(*args)`` did: ("ok", the value, typed) or ("raised", (type, code, message))."""
    try:
        return "ok", _typed(fn(*args))
    except StripefsError as exc:
        return "raised", (type(exc), exc.code, exc.message)
    except Exception as exc:  # noqa: BLE001 -- both paths must fail the same way, whatever the way
        return "raised", (type(exc), None, str(exc))


@st.composite
def _request_headers(draw: st.DrawFn) -> tuple[int, dict[Any, Any]]:
    msg_type = draw(st.sampled_from(sorted(wire.MESSAGES)))
    cls = wire.MESSAGES[msg_type]
    hints = typing.get_type_hints(cls)
    header: dict[Any, Any] = {}
    for f in dataclasses.fields(cls):
        value = draw(st.one_of(_VALID[hints[f.name]], _ODD, st.just(_ABSENT)))
        if value is not _ABSENT:
            header[f.name] = value
    header.update(draw(st.dictionaries(st.sampled_from(["x", "ino", "name", b"ino", "attr"]), _ODD, max_size=2)))
    return msg_type, header


@settings(max_examples=500, deadline=None)
@given(_request_headers())
def test_request_fast_path_matches_the_checked_path(case: tuple[int, dict[Any, Any]]) -> None:
    msg_type, header = case
    assert _outcome(wire.decode_message, msg_type, header) == _outcome(m._decode_checked, wire.MESSAGES[msg_type], header)


@pytest.mark.parametrize("header", [
    {"ino": 5}, {"ino": 5, "ino2": 1}, {}, {"ino": True}, {"ino": _Int(5)}, {"ino": 1 << 63}, {"ino": -(1 << 63)},
    {"ino": 5.0}, [("ino", 5)], {b"ino": 5}, {"ino": 5, 7: 1},
])
def test_getattr_headers_decode_as_before(header: Any) -> None:
    fast = _outcome(wire.decode_message, m.GetAttr.MSG_ID, header)
    assert fast == _outcome(m._decode_checked, m.GetAttr, header)


def test_requests_decode_and_encode_without_reflection(monkeypatch: pytest.MonkeyPatch) -> None:
    # The per-class field tables are built once, when the class is declared: nothing on the
    # per-message path may fall back to dataclasses/typing introspection.
    msgs = [m.Create(parent=1, name="f", mode=0o644, exclusive=True), m.GetAttr(ino=3), m.Resolve(path="/a/b"),
            m.SetAttr(ino=3, size=10), m.StatMany(paths=["/a"]), m.ReadChunk(ino=1, index=2, offset=0, length=9)]
    headers = [msg.to_header() for msg in msgs]

    def no_reflection(*_a: object, **_k: object) -> None:
        raise AssertionError("reflection on the per-message path")

    monkeypatch.setattr(dataclasses, "fields", no_reflection)
    monkeypatch.setattr(typing, "get_type_hints", no_reflection)
    for msg, header in zip(msgs, headers):
        assert msg.to_header() == header and m.encode_fields(msg) == header
        assert wire.decode_message(msg.MSG_ID, header) == msg


# --- replies and value types --------------------------------------------------------------

_LAYOUT = wire.Layout(1 << 20, (3, 1, 2))
_ATTR = wire.Attr(7, 0o100644, 1, 1000, 1000, 12345, 1, 2, 3, _LAYOUT, None, 0, 4)
_LINK = wire.Attr(8, 0o120777, 1, 0, 0, 3, 1, 2, 3, None, "abc", 0, 0)


_ODD_VALUES = [None, True, 1.5, 2.0, "7", b"7", 1 << 63, [1], (1,), [], {}, _Int(3), _Str("x"), _Code.SEVEN,
               float("inf")]


def _mutations(wire_map: dict[str, Any]) -> list[Any]:
    """``wire_map`` with each key removed, and with each value replaced by each odd value."""
    out: list[Any] = [wire_map, {**wire_map, "extra": 1}, list(wire_map.items()), None, "map"]
    for key in wire_map:
        out.append({k: v for k, v in wire_map.items() if k != key})
        for odd in _ODD_VALUES:
            out.append({**wire_map, key: odd})
    return out


def _entry_mutations(entry: list[Any]) -> list[Any]:
    """A dir entry's wire list with each item replaced by each odd value, and cut or extended."""
    out: list[Any] = [entry, tuple(entry), entry[:3], [*entry, None], {"name": entry[0]}, "abcd"]
    for i in range(len(entry)):
        out += [[*entry[:i], odd, *entry[i + 1:]] for odd in _ODD_VALUES]
    return out


_BAD_LAYOUTS: list[Any] = [
    {"chunk_size": 1 << 20, "chains": (3, 1)}, {"chunk_size": 1 << 20, "chains": []},
    {"chunk_size": 1 << 20, "chains": [3, -1]}, {"chunk_size": 1 << 20, "chains": [3, True]},
    {"chunk_size": 1 << 20, "chains": [3, 1.0]}, {"chunk_size": 1 << 20, "chains": [3, "1"]},
    {"chunk_size": 1 << 20, "chains": list(range(257))}, {"chunk_size": 1 << 20, "chains": "12"},
    {"chunk_size": (1 << 20) + 1, "chains": [1]}, {"chunk_size": 1 << 15, "chains": [1]},
    {"chunk_size": 1 << 27, "chains": [1]}, {"chunk_size": 1 << 20, "chains": [_Int(1)]},
]


@pytest.mark.parametrize("value", _mutations(_LAYOUT.to_wire()) + _BAD_LAYOUTS)
def test_layout_from_wire_fast_path_matches_the_checked_path(value: Any) -> None:
    assert _outcome(wire.Layout.from_wire, value) == _outcome(wire.Layout._from_wire_checked, value)


@pytest.mark.parametrize("value", _mutations(_ATTR.to_wire()) + _mutations(_LINK.to_wire())
                         + [{**_ATTR.to_wire(), "layout": bad} for bad in _BAD_LAYOUTS])
def test_attr_from_wire_fast_path_matches_the_checked_path(value: Any) -> None:
    assert _outcome(wire.Attr.from_wire, value) == _outcome(wire.Attr._from_wire_checked, value)


@pytest.mark.parametrize("value", _entry_mutations(["a", 7, 0o100644, _ATTR.to_wire()])
                         + _entry_mutations(["b", 8, 0o40755, None])
                         + [["a", 7, 1, attr] for attr in _mutations(_LINK.to_wire())[:40]])
def test_dir_entry_from_wire_fast_path_matches_the_checked_path(value: Any) -> None:
    assert _outcome(wire.DirEntry.from_wire, value) == _outcome(wire.DirEntry._from_wire_checked, value)


_REPLY_SAMPLES: list[tuple[type[m.ReplyMessage], dict[str, Any]]] = [
    (m.AttrReply, {"attr": _ATTR.to_wire()}),
    (m.CreateReply, {"attr": _LINK.to_wire(), "created": True}),
    (m.ReaddirReply, {"entries": [["a", 7, 0o100644, _ATTR.to_wire()], ["b", 8, 0o40755, None]], "more": False}),
    (m.ReadChunkReply, {"length": 100, "chunk_length": 4096, "crcs": [7, 8]}),
    (m.ReadChunkReply, {"length": 100, "chunk_length": 4096}),
    (m.WriteChunkReply, {"length": 4096, "version": 2}),
    (m.StatManyReply, {"attrs": [_ATTR.to_wire(), _LINK.to_wire()], "failed": [2], "codes": [1]}),
    (m.TargetInfoReply, {"server_id": None, "capacity": 10, "free": 5, "used": 5, "chunks": 1, "root": "/r",
                         "syncing": False, "sync_progress": {}}),
    (m.ListChunksReply, {"chunks": [[7, 0, 1, 100]], "digests": None, "more": True}),
    (m.NamesReply, {"names": ["a", "b"], "more": True}),
]


def _reply_cases() -> list[tuple[type[m.ReplyMessage], Any]]:
    cases: list[tuple[type[m.ReplyMessage], Any]] = []
    for cls, header in _REPLY_SAMPLES:
        cases += [(cls, h) for h in _mutations(header)]
    entries = _REPLY_SAMPLES[2][1]["entries"]
    for bad_entry in (["a", 7, 1], ["a", "7", 1, None], ["a", 7, 1, {"ino": 1}], [b"a", 7, 1, None], "x"):
        cases.append((m.ReaddirReply, {"entries": [*entries, bad_entry], "more": False}))
    cases.append((m.ReaddirReply, {"entries": tuple(entries), "more": False}))
    cases.append((m.StatManyReply, {"attrs": [_ATTR.to_wire(), {"ino": 1}], "failed": [], "codes": []}))
    return cases


@pytest.mark.parametrize("cls, header", _reply_cases())
def test_reply_fast_path_matches_the_checked_path(cls: type[m.ReplyMessage], header: Any) -> None:
    assert _outcome(cls.from_header, header) == _outcome(cls._decode_checked, header)


def test_replies_decode_without_reflection(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reflection(*_a: object, **_k: object) -> None:
        raise AssertionError("reflection on the per-message path")

    monkeypatch.setattr(dataclasses, "fields", no_reflection)
    monkeypatch.setattr(typing, "get_type_hints", no_reflection)
    for cls, header in _REPLY_SAMPLES:
        reply = cls.from_header(header)
        assert type(reply) is cls and cls.from_header(reply.to_header()) == reply


# --- the bytes on the wire -----------------------------------------------------------------
# Pinned from the encoder before the fast paths existed: peers of either age read each other.

_GOLDEN_ATTR = wire.Attr(7, 0o100644, 1, 1000, 1000, 12345, 1, 2, 3, wire.Layout(1 << 20, (3, 1, 2)), None, 0, 4)
_ATTR_HEX = ("8da3696e6f07a46d6f6465cd81a4a56e6c696e6b01a3756964cd03e8a3676964cd03e8a473697a65cd3039a86174696d655f6e73"
             "01a86d74696d655f6e7302a86374696d655f6e7303a66c61796f757482aa6368756e6b5f73697a65ce00100000a6636861696e73"
             "93030102a6746172676574c0a47264657600ab7472756e636174696f6e7304")
_GOLDEN: list[tuple[int, int, Any, int, int, str]] = [
    (14, 7, m.Create(parent=1, name="rank-3.pt", mode=0o100644, uid=1000, gid=1000, exclusive=True), 0, 0,
     ("53460100000e00000000000000000007000000430000000000000000"
      "87a6706172656e7401a46e616d65a972616e6b2d332e7074a46d6f6465cd81a4a3756964cd03e8a3676964cd03e8"
      "a96578636c7573697665c3a87472756e63617465c2")),
    (40, 8, m.WriteChunk(ino=12345, index=7, offset=65536, crc=0x1234ABCD, chunk_size=4 << 20, chain=3,
                         routing_version=9), 4096, 0,
     ("534601000028000000000000000000080000005d0000000000001000"
      "89a3696e6fcd3039a5696e64657807a66f6666736574ce00010000a3637263ce1234abcdaa6368756e6b5f73697a65ce00400000"
      "a5636861696e03af726f7574696e675f76657273696f6e09a776657273696f6ec0a6646967657374c0")),
    (14, 7, m.CreateReply(attr=_GOLDEN_ATTR, created=True), 0, wire.FLAG_RESPONSE,
     ("53460101000e0000000000000000000700000096000000000000000082a461747472" + _ATTR_HEX + "a763726561746564c3")),
    (19, 9, m.ReaddirReply(entries=[wire.DirEntry("a", 7, 0o100644, _GOLDEN_ATTR), wire.DirEntry("b", 8, 0o40755)],
                           more=False), 0, wire.FLAG_RESPONSE,
     ("53460101001300000000000000000009000000a60000000000000000"
      "82a7656e74726965739294a16107cd81a4" + _ATTR_HEX + "94a16208cd41edc0a46d6f7265c2")),
    (41, 9, m.ReadChunkReply(length=100, chunk_length=4096, crcs=[7]), 100, wire.FLAG_RESPONSE,
     ("53460101002900000000000000000009000000200000000000000064"
      "83a66c656e67746864ac6368756e6b5f6c656e677468cd1000a4637263739107")),
]


@pytest.mark.parametrize("msg_type, req_id, msg, payload_len, flags, hex_bytes", _GOLDEN,
                         ids=[type(g[2]).__name__ for g in _GOLDEN])
def test_frames_keep_their_bytes(msg_type: int, req_id: int, msg: Any, payload_len: int, flags: int,
                                 hex_bytes: str) -> None:
    frame = wire.encode_prefix(msg_type, req_id, msg.to_header(), payload_len, flags)
    assert frame.hex() == hex_bytes
    decoder = wire.FrameDecoder()
    decoder.feed(frame)
    head = decoder.next_head()
    assert isinstance(head, wire.FrameHead)
    if flags:
        assert wire.decode_reply(wire.MESSAGES[msg_type], head.header) == msg
    else:
        assert wire.decode_message(msg_type, head.header) == msg


# --- the unrolled constructors -----------------------------------------------------------------


def test_positional_builders_make_the_same_objects() -> None:
    from stripefs.wire._build import positional_builder

    assert positional_builder(wire.Attr)(*dataclasses.astuple(_ATTR, tuple_factory=list)[:9], _LAYOUT, None, 0, 4) == _ATTR
    classes = [*wire.MESSAGES.values(), *{c.Reply for c in wire.MESSAGES.values() if c.Reply},
               wire.Attr, wire.Layout, wire.DirEntry, wire.FrameHead, wire.RequestReceived, wire.ResponseReceived]
    for cls in classes:
        values = [object() for _ in dataclasses.fields(cls)]
        built, made = positional_builder(cls)(*values), cls(*values)
        assert type(built) is cls and [getattr(built, f.name) for f in dataclasses.fields(cls)] == values
        assert built == made and hash(built) == hash(made)
        for f in dataclasses.fields(cls)[:1]:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(built, f.name, 1)  # still frozen

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        n: int

        def __post_init__(self) -> None:
            if self.n < 0:
                raise ValueError("negative")

    assert positional_builder(Checked) is Checked  # never skips a __post_init__
