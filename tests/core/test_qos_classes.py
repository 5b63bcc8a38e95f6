"""Traffic classes of chunk writes (storage/_qos.py): a ``background`` client's small
writes wait for a bulk slot behind a checkpoint-sized write and are told how long, an
``interactive`` client's small writes take no slot and are not told; the checkpoint
mover paces itself on what it is told; unknown classes are refused at both ends.

One storage server with one bulk slot and a slow disk (every data sync sleeps
:data:`SYNC` seconds, ``STRIPEFS_SLOW_FSYNC_FILE``), so a bulk write holds the slot
for a known time."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.testing import LocalCluster
from stripefs.staging._mover import UPLOAD_QOS, _Throttle
from stripefs.wire import ErrorCode, StripefsError, messages as m

SLOW = "qos-slow-fsync"
SYNC = 0.6  # seconds each data sync of the server sleeps while the test's slow file is there


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRIPEFS_SLOW_FSYNC_FILE", SLOW)  # read by the server at start
        mp.setenv("STRIPEFS_BULK_SLOTS", "1")
        with LocalCluster.start(str(tmp_path_factory.mktemp("qos")), servers=1, chunk_size=4 << 20) as c:
            yield c


def _slow_disk(cluster: LocalCluster, seconds: float | None) -> None:
    path = Path(cluster.data["servers"][0]["root"]) / SLOW
    if seconds is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(str(seconds))


def _timed(fn: Any, out: dict[str, float], key: str) -> threading.Thread:
    def run() -> None:
        t = time.monotonic()
        fn()
        out[key] = time.monotonic() - t

    th = threading.Thread(target=run)
    th.start()
    return th


def test_a_background_write_waits_for_the_bulk_slot_and_is_told(cluster: LocalCluster) -> None:
    with Client(cluster.file) as bulk, Client(cluster.file, qos="background") as bg, Client(cluster.file) as plain:
        for c in (bulk, bg, plain):  # connections and routing ready before the clock starts
            c.write_bytes(f"/warm-{id(c)}", b"w")
        _slow_disk(cluster, SYNC)
        try:
            took: dict[str, float] = {}
            big = _timed(lambda: bulk.write_bytes("/big", os.urandom(2 << 20)), took, "big")
            time.sleep(SYNC / 3)  # the bulk write holds the one slot now, in its slow sync
            small = [_timed(lambda: bg.write_bytes("/bg", b"b" * 4096), took, "background"),
                     _timed(lambda: plain.write_bytes("/plain", b"p" * 4096), took, "interactive")]
            for th in [big, *small]:
                th.join(30)
        finally:
            _slow_disk(cluster, None)
        assert bg.read_bytes("/bg") == b"b" * 4096 and plain.read_bytes("/plain") == b"p" * 4096
        # The background write waited for the slot (until the bulk write's sync ended), and
        # was told; the interactive one took no slot: only its own slow sync.
        told = bg._core.queue_delay
        assert told.last >= SYNC / 3 and bg.queue_delay > 0.0, (told.last, bg.queue_delay, took)
        assert plain.queue_delay == 0.0 and plain._core.queue_delay.reports == 0
        assert took["interactive"] < took["background"] - SYNC / 3, took
        # The interactive and the bulk writer were never told (their replies carry no wait).
        assert bulk.queue_delay == 0.0


def test_an_idle_server_reports_no_wait(cluster: LocalCluster) -> None:
    with Client(cluster.file, qos="bulk") as c:
        for i in range(4):
            c.write_bytes(f"/idle-{i}", b"x" * 8192)
        assert c._core.queue_delay.reports >= 4
        assert c.queue_delay < SYNC / 3


def test_the_mover_yields_while_the_servers_hold_its_writes(cluster: LocalCluster) -> None:
    with Client(cluster.file, qos=UPLOAD_QOS) as c:
        c.write_bytes("/told", b"t")  # an idle server: told of no wait
        quiet = _Throttle(None, c)
        quiet.account(1 << 20)
        assert quiet.yielded == 0.0
        c._core.queue_delay.add(0.2)  # as if the servers had held its writes
        while c.queue_delay <= _Throttle.QUEUE_TARGET:
            c._core.queue_delay.add(0.2)
        busy = _Throttle(None, c)
        t = time.monotonic()
        busy.account(1 << 20)
        assert busy.yielded == pytest.approx(min(c.queue_delay, _Throttle.MAX_YIELD))
        assert time.monotonic() - t >= busy.yielded


def test_unknown_classes_are_refused(cluster: LocalCluster) -> None:
    with pytest.raises(StripefsError) as exc:
        Client(cluster.file, qos="urgent")
    assert exc.value.code == ErrorCode.INVALID and "qos" in str(exc.value)
    with Client(cluster.file) as c:
        c.write_bytes("/raw", b"r")
        attr = c.stat("/raw")
        assert attr.layout is not None
        server = next(iter(c._core.routing().servers))
        msg = m.WriteChunk(ino=attr.ino, index=0, offset=0, crc=0, chunk_size=attr.layout.chunk_size,
                           chain=attr.layout.chain_of(0), routing_version=c._core.routing().version, qos=9)
        with pytest.raises(StripefsError) as exc:
            c._core.data_conn(server).submit(msg, payload=b"").result(10)
        assert exc.value.code == ErrorCode.INVALID and "traffic class" in str(exc.value)


def test_a_mount_and_a_save_name_their_class() -> None:
    from stripefs.fsclient.fuse._daemon import MountError, parse_options
    from stripefs.staging import MoverOptions

    cfg, fuse_opts = parse_options(["attr_timeout=2,qos=bulk"])
    assert cfg.qos == "bulk" and not any(o.startswith("qos") for o in fuse_opts)
    assert parse_options([])[0].qos == "interactive"
    with pytest.raises(MountError, match="qos is one of interactive, bulk, background"):
        parse_options(["qos=urgent"])
    assert MoverOptions().qos == UPLOAD_QOS == "background"


def test_the_mover_uploads_in_its_options_class(cluster: LocalCluster, tmp_path: Path) -> None:
    import torch

    from stripefs import staging
    from stripefs.staging import _mover

    for qos in ("bulk", "background"):
        h = staging.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, f"stripefs://qos/{qos}",
                         staging_dir=str(tmp_path / qos), cluster=cluster.file,
                         options=staging.MoverOptions(cluster=cluster.file, qos=qos))
        h.wait()
        used = _mover.client_for(cluster.file, qos)
        assert used._core.qos == m.QOS_CLASSES[qos] and used._core.queue_delay.reports > 0
