"""Listing pages travel by columns (one list per field): the same entries come back, and a
bad page is a PROTOCOL error naming what is wrong, never a half-built page."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stripefs.wire import Attr, DirEntry, ErrorCode, Layout, StripefsError
from stripefs.wire import messages as m

_I64 = st.integers(-(1 << 63), (1 << 63) - 1)
_U32 = st.integers(0, (1 << 32) - 1)
_LAYOUTS = st.builds(Layout, st.sampled_from([1 << 16, 1 << 20, 4 << 20]),
                     st.lists(st.integers(0, 1000), min_size=1, max_size=8).map(tuple))


@st.composite
def _attr(draw: st.DrawFn, ino: int, mode: int) -> Attr:
    return Attr(ino, mode, draw(_U32), draw(_U32), draw(_U32), draw(st.integers(0, 1 << 50)), draw(_I64), draw(_I64),
                draw(_I64), draw(st.none() | _LAYOUTS), draw(st.none() | st.text(max_size=20)), draw(_U32), draw(_U32))


@st.composite
def _page(draw: st.DrawFn) -> list[DirEntry]:
    plus = draw(st.booleans())
    names = draw(st.lists(st.text(min_size=1, max_size=12), max_size=30, unique=True))
    out = []
    for name in sorted(names):
        ino, mode = draw(st.integers(1, 1 << 62)), draw(st.sampled_from([0o100644, 0o40755, 0o120777, 0o20600]))
        out.append(DirEntry(name, ino, mode, draw(_attr(ino, mode)) if plus else None))
    return out


def _wire(header: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(header))


@settings(max_examples=200, deadline=None)
@given(_page(), st.booleans(), st.integers(0, 1 << 40), st.integers(0, 1 << 20))
def test_a_page_by_columns_comes_back_whole(entries: list[DirEntry], more: bool, lease_id: int, lease_ms: int) -> None:
    reply = m.ReaddirReply(entries, more, lease_id, lease_ms)
    header = reply.to_header()
    assert "columns" in header and "entries" not in header
    assert m.ReaddirReply.from_header(_wire(header)) == reply
    # ... and taken with its entries made one at a time (a FUSE daemon keeping a listing)
    rest, page = m.ReaddirReply.with_page(_wire(header))
    assert rest == m.ReaddirReply([], more, lease_id, lease_ms)
    assert page.names == [e.name for e in entries] and page.entries() == entries
    assert [page.entry(i) for i in reversed(range(len(page)))] == entries[::-1]


def test_a_page_of_a_map_per_entry_is_taken_one_entry_at_a_time_too() -> None:
    entries = [DirEntry("d", 5, 0o40755), DirEntry("f", 6, 0o100644, Attr(6, 0o100644, 1, 0, 0, 0, 1, 2, 3))]
    header = m.ReaddirReply(entries, True).to_header()
    assert "entries" in header
    rest, page = m.ReaddirReply.with_page(_wire(header))
    assert rest == m.ReaddirReply([], True) and page.names == ["d", "f"] and page.entry(1) == entries[1]


def test_a_plus_page_carries_one_column_per_field_and_target_and_layout_only_when_used() -> None:
    plain = [DirEntry(f"f{i}", 10 + i, 0o100644, Attr(10 + i, 0o100644, 1, 0, 0, i, 1, 2, 3)) for i in range(3)]
    columns = m.ReaddirReply(plain, False).to_header()["columns"]
    assert columns["name"] == ["f0", "f1", "f2"] and columns["ino"] == [10, 11, 12] and columns["size"] == [0, 1, 2]
    assert "target" not in columns and "layout" not in columns
    link = DirEntry("l", 20, 0o120777, Attr(20, 0o120777, 1, 0, 0, 1, 1, 2, 3, None, "f0"))
    columns = m.ReaddirReply([*plain, link], False).to_header()["columns"]
    assert columns["target"] == [None, None, None, "f0"] and "layout" not in columns


@pytest.mark.parametrize("entries", [
    [DirEntry("d", 5, 0o40755), DirEntry("f", 6, 0o100644, Attr(6, 0o100644, 1, 0, 0, 0, 1, 2, 3))],  # mixed
    [DirEntry("f", 6, 0o100644, Attr(7, 0o100644, 1, 0, 0, 0, 1, 2, 3))],  # the attributes name another inode
])
def test_entries_that_do_not_fit_columns_go_as_a_map_each(entries: list[DirEntry]) -> None:
    header = m.ReaddirReply(entries, True).to_header()
    assert "entries" in header and "columns" not in header
    assert m.ReaddirReply.from_header(_wire(header)) == m.ReaddirReply(entries, True)


_GOOD = {"name": ["a", "b"], "ino": [1, 2], "mode": [0o100644, 0o40755]}
_PLUS = {**_GOOD, **{k: [0, 0] for k in ("nlink", "uid", "gid", "size", "atime_ns", "mtime_ns", "ctime_ns", "rdev",
                                           "truncations")}}


@pytest.mark.parametrize(("columns", "says"), [
    ([["a"], [1], [1]], "must be a map"),
    ({"name": ["a", "b"], "ino": [1, 2]}, "'mode' is missing"),
    ({**_GOOD, "ino": [1]}, "'ino' has 1 values for 2 entries"),
    ({**_GOOD, "ino": [1, 2.0]}, "'ino' holds a value that is not a 64-bit integer"),
    ({**_GOOD, "ino": [1, True]}, "'ino' holds a value that is not a 64-bit integer"),
    ({**_GOOD, "mode": [1, 1 << 63]}, "'mode' holds a value that is not a 64-bit integer"),
    ({**_GOOD, "name": ["a", 7]}, "'name' holds a value that is not a string"),
    ({**_GOOD, "colour": [1, 2]}, "unknown listing columns ['colour']"),
    ({**_GOOD, "size": [1, 2]}, "attribute columns without 'nlink'"),
    ({**_PLUS, "uid": None}, "'uid' is missing"),
    ({**_PLUS, "gid": [0, "0"]}, "'gid' holds a value that is not a 64-bit integer"),
    ({**_PLUS, "target": [None, 3]}, "'target' holds a value that is neither a string nor nil"),
    ({**_PLUS, "layout": [None, {"chunk_size": 3, "chains": [1]}]}, "layout"),
    ({**_PLUS, "layout": [{"chunk_size": 1 << 16, "chains": [1]}, {"chunk_size": 1 << 16, "chains": [[1]]}]}, "layout"),
    ({**_PLUS, "layout": [{"chunk_size": 1 << 16, "chains": [1]}, {"chunk_size": 3, "chains": [1]}]}, "layout"),
])
@pytest.mark.parametrize("decode", [m.ReaddirReply.from_header, m.ReaddirReply.with_page])
def test_a_bad_page_is_a_protocol_error_that_names_the_column(columns: object, says: str, decode: Any) -> None:
    with pytest.raises(StripefsError) as err:
        decode({"columns": columns, "more": False})
    assert err.value.code == ErrorCode.PROTOCOL and says in err.value.message


@pytest.mark.parametrize("decode", [m.ReaddirReply.from_header, m.ReaddirReply.with_page])
def test_columns_and_entries_together_or_a_bad_rest_are_refused(decode: Any) -> None:
    for header in ({"columns": _GOOD, "entries": [], "more": False}, {"columns": _GOOD},
                   {"columns": _GOOD, "more": "yes"}):
        with pytest.raises(StripefsError) as err:
            decode(header)
        assert err.value.code == ErrorCode.PROTOCOL
    # A reply field of a newer version is ignored, as for every reply (docs/protocol.md, "Versions").
    assert len(m.ReaddirReply.from_header({"columns": _GOOD, "more": False, "extra": 1}).entries) == 2


def test_the_old_form_is_still_read() -> None:
    attr = Attr(6, 0o100644, 1, 0, 0, 0, 1, 2, 3)
    header = {"entries": [["d", 5, 0o40755, None], ["f", 6, 0o100644, attr.to_wire()]], "more": False}
    assert m.ReaddirReply.from_header(header) == m.ReaddirReply([DirEntry("d", 5, 0o40755), DirEntry("f", 6, 0o100644, attr)],
                                                                False)
