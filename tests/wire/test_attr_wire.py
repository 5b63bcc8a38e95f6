"""Attr's wire map names every field (it is written out by hand, for speed)."""

from __future__ import annotations

import dataclasses

from stripefs.wire import Attr, Layout


def test_attr_wire_map_has_every_field_and_round_trips() -> None:
    a = Attr(7, 0o100644, 2, 1000, 1001, 12345, 1, 2, 3, Layout(1 << 20, (3, 1, 2)), "t", 5, 6)
    wire_map = a.to_wire()
    assert list(wire_map) == [f.name for f in dataclasses.fields(Attr)]
    assert wire_map["layout"] == {"chunk_size": 1 << 20, "chains": [3, 1, 2]}
    assert Attr.from_wire(wire_map) == a
    assert Attr.from_wire(Attr(1, 0o40755, 2, 0, 0, 0, 0, 0, 0).to_wire()).layout is None
