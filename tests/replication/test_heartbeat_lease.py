"""A storage server serves reads only while a heartbeat it sent less than ``SILENCE`` ago
was answered: the metadata service declares it offline ``OFFLINE_AFTER`` after the last
heartbeat it *received*, and from then on writes leave it out.

The hole this closes (found by ``bench.net_soak``, seed 7, R=3, under link faults): a
server whose heartbeats were not getting through still fetched chain tables (for a
resync pass, a client's newer table, or to confirm after a silence) and counted those
answers as proof of life. It went on serving the old bytes of chunks rewritten after the
service had declared it offline, to clients that still routed by the old table.

Here the heartbeats of one replica are dropped (injected into the storage servers: a
``sitecustomize`` that fails a ``Heartbeat`` call while ``ROOT/drop-heartbeats`` exists)
while its other calls go through."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from stripefs.fsclient.testing import LocalCluster
from stripefs.storage import _replication
from stripefs.wire import ErrorCode, StripefsError, messages as m

DROP = "drop-heartbeats"
DROP_HEARTBEATS = f"""
import os, sys
try:
    import trio
    import stripefs.storage._server as _s
    from stripefs.wire import ErrorCode, StripefsError, messages as _m
except ImportError:
    pass
else:
    _root = sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else None
    _call = _s.control_call
    async def _dropping(conn, msg, payload=b""):
        if isinstance(msg, _m.Heartbeat) and _root and os.path.exists(os.path.join(_root, "{DROP}")):
            await trio.sleep(0.5)
            raise StripefsError(ErrorCode.TIMEOUT, "heartbeat dropped (test)")
        return await _call(conn, msg, payload)
    _s.control_call = _dropping
"""


def test_a_server_whose_heartbeats_are_lost_stops_serving_before_it_is_left_out(
        make_cluster: Callable[..., LocalCluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DROP_HEARTBEATS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    h = make_cluster(servers=2, replicas=2)
    old, new = b"o" * 4096, b"n" * 4096
    with h.client() as c:
        c.write_bytes("/f", old)
        ino = c.stat("/f").ino
        place = c.placement("/f")[0]
        chain, victim = place["chain"], place["replicas"][-1]
        old_table = c.routing().version
        read = m.ReadChunk(ino=ino, index=0, offset=0, length=4096, chain=chain, routing_version=old_table)
        root = _root_of(h, c, victim)
        Path(root, DROP).touch()
        t0 = time.monotonic()
        # Past SILENCE since its last answered heartbeat, before OFFLINE_AFTER: a read makes
        # the server look for a sign of life (before the fix: a chain table, still naming it).
        time.sleep(_replication.SILENCE + 1.2)
        _try_read(c, victim, read)
        # The service declares it offline; a write goes to the rest of the chain.
        deadline = t0 + 20
        while victim in c.routing(refresh=True).chains.get(chain, ()):
            assert time.monotonic() < deadline, "the victim was never declared offline"
            time.sleep(0.2)
        c.write_bytes("/f", new)
        # A client still routing by the old table reads from the victim: never the old bytes.
        for _ in range(5):
            got = _try_read(c, victim, read)
            assert got != old, f"{time.monotonic() - t0:.1f} s after its heartbeats stopped, the server left " \
                               "out of the chain served bytes overwritten since"
            time.sleep(0.1)
        Path(root, DROP).unlink()
        assert c.read_bytes("/f") == new


def _try_read(c: Any, server: int, read: m.ReadChunk) -> bytes | None:
    """The bytes a direct read returns, None when the server refuses it."""
    try:
        reply = c._core.data_conn(server).call(read, timeout=30)
    except StripefsError as exc:
        assert exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.STALE_ROUTING), exc
        return None
    return bytes(reply.payload)


def _root_of(h: LocalCluster, c: Any, server: int) -> str:
    info = c.routing().servers[server]
    return next(s["root"] for s in h.data["servers"] if int(s["port"]) == int(info.port))
