"""Behaviour of bench.floors with tiny sizes: result shape, exact byte counts, bounded failure."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from stripefs.bench import floors

MiB = 1 << 20


def assert_result(r: dict[str, Any], path: str, nbytes: int) -> None:
    assert r["path"] == path
    assert isinstance(r["bytes"], int) and r["bytes"] == nbytes
    assert isinstance(r["seconds"], float) and r["seconds"] > 0
    assert isinstance(r["gbps"], float)
    assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("4096", 4096), ("1K", 1024), ("512k", 512 << 10), ("16M", 16 * MiB),
    ("1G", 1 << 30), ("1.5G", 3 << 29), ("2GiB", 2 << 30), ("8MB", 8 * MiB), (" 3 m ", 3 * MiB),
    ("1T", 1 << 40),
])
def test_parse_size(text: str, expected: int) -> None:
    assert floors.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "-1M", "1X", "1 G B", "one"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        floors.parse_size(text)


@pytest.mark.parametrize("total, streams, processes, block", [
    (16 * MiB, 4, 1, MiB),
    (16 * MiB + 12345, 3, 2, 1_000_000),   # uneven shares, block not a page multiple
    (5, 4, 1, MiB),                       # fewer bytes than streams: empty streams are fine
])
def test_floor_socket_delivers_every_byte(total: int, streams: int, processes: int,
                                          block: int, tmp_path: Path) -> None:
    r = floors.floor_socket(total, streams=streams, block=block, processes=processes,
                            directory=str(tmp_path), timeout=60)
    assert_result(r, "floor_socket", total)
    assert (r["streams"], r["processes"], r["block"]) == (streams, processes, block)
    assert r["crc_checked_bytes"] > 0          # head and tail of each stream matched the file
    assert 1 <= len(r["per_stream_gbps"]) <= streams
    assert list(tmp_path.iterdir()) == []      # the sender's file is gone


def test_floor_socket_rejects_bad_shape() -> None:
    with pytest.raises(ValueError):
        floors.floor_socket(MiB, streams=2, processes=3)


def _stream(path: Path, data: bytes, **over: Any) -> tuple[int, dict[str, Any]]:
    path.write_bytes(data)
    tail = len(data) % 4096 or 4096
    o = {"stream": 0, "length": len(data), "received": len(data), "eof": True, "tail": tail,
         "head_crc": zlib.crc32(data[:floors._SAMPLE]), "tail_crc": zlib.crc32(data[-tail:])}
    o.update(over)
    return os.open(path, os.O_RDONLY), o


@pytest.mark.parametrize("over, ok", [
    ({}, True),
    ({"received": 100_000 - 1}, False),
    ({"eof": False}, False),
    ({"head_crc": 0}, False),
    ({"tail_crc": 0}, False),
    ({"error": "OSError()"}, False),
])
def test_check_stream_catches_wrong_data(over: dict[str, Any], ok: bool, tmp_path: Path) -> None:
    fd, o = _stream(tmp_path / "f", os.urandom(100_000), **over)
    try:
        if ok:
            assert floors._check_stream(fd, o, 0, 100_000, 100_000) > 0
        else:
            with pytest.raises(RuntimeError):
                floors._check_stream(fd, o, 0, 100_000, 100_000)
    finally:
        os.close(fd)


class _Dead:
    name, exitcode = "send0", -9


def test_collect_fails_fast_when_a_child_dies() -> None:
    import queue
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="died"):
        floors._collect(queue.Queue(), {"sent": 1}, [_Dead()], floors._clock() + 30)
    assert time.monotonic() - t0 < 5


def test_collect_times_out() -> None:
    import queue
    with pytest.raises(TimeoutError):
        floors._collect(queue.Queue(), {"sent": 1}, [], floors._clock() - 1)


def test_floor_memcpy() -> None:
    r = floors.floor_memcpy(16 * MiB, block=4 * MiB)
    assert_result(r, "floor_memcpy", 16 * MiB)
    assert r["block"] == 4 * MiB and len(r["runs_gbps"]) == 3
    assert r["best_gbps"] >= r["gbps"] * 0.999


@pytest.mark.parametrize("fsync, files", [("per_chunk", 1), ("end", 3), ("none", 2)])
def test_floor_disk_write(fsync: str, files: int, tmp_path: Path) -> None:
    total = 16 * MiB + 4097
    r = floors.floor_disk_write(total, str(tmp_path), chunk=MiB, fsync=fsync, files=files)
    assert_result(r, "local_disk", total)
    assert (r["op"], r["fsync"], r["files"]) == ("write", fsync, files)
    assert list(tmp_path.iterdir()) == []


def test_floor_disk_write_rejects_unknown_fsync(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        floors.floor_disk_write(MiB, str(tmp_path), fsync="sometimes")


@pytest.mark.parametrize("warm", [True, False])
def test_floor_disk_read(warm: bool, tmp_path: Path) -> None:
    r = floors.floor_disk_read(16 * MiB, str(tmp_path), chunk=MiB, warm=warm)
    assert_result(r, "local_disk", 16 * MiB)
    assert (r["op"], r["warm"]) == ("read", warm)
    assert list(tmp_path.iterdir()) == []


def test_machine_facts() -> None:
    f = floors.machine_facts()
    assert f["cores"] >= 1 and f["memory_bytes"] > 0 and f["python"] and f["hostname"]
    assert f["packages"]["numpy"] is not None
    assert {"cpu", "kernel", "date"} <= f.keys()
    assert {"trio", "msgpack", "fsspec", "torch"} <= f["packages"].keys()


def test_cli_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    floors.main(["--size", "8M", "--streams", "2", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "memcpy" in out and "socket 2 streams" in out and "disk read, warm" in out
    assert list(tmp_path.iterdir()) == []
