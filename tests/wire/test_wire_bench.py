"""bench.wire_bench as a program, at its shortest: well-formed rows for every message it names."""

from __future__ import annotations

import json

import pytest

from stripefs.bench import wire_bench


def test_wire_bench_writes_a_row_per_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert wire_bench.main(["--rounds", "1", "--min-time", "0.001", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bench"] == "wire" and report["unit"] == "us_per_op"
    rows = {r["message"]: r for r in report["rows"]}
    names = [n for n, _ in wire_bench.requests()] + [n for n, _, _ in wire_bench.replies()]
    assert set(names) < set(rows)
    for name in names:
        r = rows[name]
        assert r["encode_us"] > 0 and r["decode_us"] > 0 and r["floor_us"] > 0 and r["header_bytes"] > 0
    calls = [r for r in report["rows"] if r["kind"] == "roundtrip"]
    assert {r["message"] for r in calls} >= {"GetAttr call", "Lookup ENOENT call"}
    assert all(r["call_us"] > 0 and r["ratio"] > 0 for r in calls)
