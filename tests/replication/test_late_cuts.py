"""Issue #27 ("acknowledged means durable"): the fault schedules' stale reads after a truncate.

``python -m stripefs.fsclient.testing.faults --seed 4 --replicas 3`` failed most runs with
reads of file 0's regions past 1,310,720 (chunk 5 on) returning zeros long after writes
there were acknowledged. Traced with logging on every cut, write and short read of the
storage servers: the chunks were cut once, in order, before the truncate returned, and
every replica of the chain applied the later writes (their versions and digests agree);
no server ever answered those reads short. The zeros came from the reader process itself.
It took each file's size once, at start, and passed it to every ``read_into``; one reader
started while writer 0 had file 0 cut short (its first truncate, to 1,310,720, came as the
readers started), so every read past that size was answered with zeros by the client,
without asking a server -- a stale read of the workload, not of the cluster. The readers
now read against the files' full length (holes read as zeros all the same).

The test replays it against a real cluster on loopback: a reader starts while the file
is cut short, the file is extended and written, and the reader must see the new bytes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import crc32c

from stripefs.fsclient.testing import LocalCluster
from stripefs.fsclient.testing.faults import CHUNK, SLOT, SLOTS, UNITS, _bytes, _worker

CUT = 5 * CHUNK  # writer 0's first cut in seed 4: file 0 from chunk 5 on
FULL = SLOTS * SLOT


def _reads(log: str) -> list[dict]:
    try:
        with open(log) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def test_a_reader_started_while_a_file_was_cut_short_reads_the_bytes_written_after_the_extend(tmp_path: Path) -> None:
    h = LocalCluster.start(str(tmp_path / "cluster"), servers=3, replicas=3, chunk_size=CHUNK)
    stop = tmp_path / "stop"
    log = str(tmp_path / "reader.jsonl")
    try:
        with h.client() as c:
            c.mkdir("/h")
            c.write_bytes("/h/f0", _bytes("init", FULL))
            attr = c.stat("/h/f0")
            assert attr.layout is not None
            c.truncate("/h/f0", CUT)  # cut short, as writer 0 leaves it between its truncate and extend
            spec = {"who": "r1", "role": "reader", "seed": "late-cuts", "cluster": h.file, "paths": ["/h/f0"],
                    "inos": [attr.ino], "log": log, "stop": str(stop), "namespace": False, "max_seconds": 25}
            reader = threading.Thread(target=_worker, args=(spec,), daemon=True)
            reader.start()
            deadline = time.monotonic() + 10
            while not _reads(log):  # its first read: it has taken the file's attributes
                assert time.monotonic() < deadline, "the reader did not start"
                time.sleep(0.02)
            c.truncate("/h/f0", FULL)  # the extend: zeros past the cut
            new = _bytes("after-the-extend", FULL - CUT)
            c.write_from(attr.ino, attr.layout, CUT, memoryview(new))
            acked = time.monotonic()
            later: list[dict] = []
            deadline = time.monotonic() + 10
            while len(later) < 5 and time.monotonic() < deadline:
                time.sleep(0.1)
                later = [op for op in _reads(log) if op["k"] == "r" and op["t0"] > acked
                         and op["s"] >= 0 and UNITS[op["s"]][0] >= CUT]
        stop.touch()
        reader.join(timeout=20)
        assert not reader.is_alive()
        assert later, "the reader never read past the cut after the write"
        for op in later:
            a, b = UNITS[op["s"]]
            assert op["ok"], op
            assert op["crc"] == crc32c.crc32c(new[a - CUT : b - CUT]), (
                f"region {op['s']} read at {op['t0']:.3f} returned other bytes than the write acknowledged "
                f"at {acked:.3f} (zeros: {op['crc'] == crc32c.crc32c(bytes(b - a))})")
    finally:
        stop.touch()
        h.down()
