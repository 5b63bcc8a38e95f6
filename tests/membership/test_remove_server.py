"""``stripefs remove-server ID`` (issue 20): drain with replicas, refuse to lose data without --force.

R=2 over three servers: the removed server's chain slots move to the others (resync),
it is marked ``removed``, stops, and every byte stays readable with it gone; it is
never started or admitted again. R=1: refused, naming the chains and what they
hold, unless --force, which removes it and reports the lost chains. An unknown id,
and a client's cluster.json (no server credential), get clear errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Iterator

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.core import pid_alive
from stripefs.fsclient.testing import LocalCluster
from stripefs.wire import StripefsError
from stripefs.wire import messages as m

from ..conftest import TEST_CHUNK


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stripefs", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    h = LocalCluster.start(str(tmp_path_factory.mktemp("remove")), servers=3, replicas=2, chunk_size=TEST_CHUNK,
                           gc_grace=1.0)
    yield h
    h.down()


def test_drain_with_two_replicas_keeps_every_byte_after_the_server_is_gone(three: LocalCluster) -> None:
    files = {f"/d/f{i}": os.urandom(3 * TEST_CHUNK + i) for i in range(6)}
    with three.client() as c:
        c.makedirs("/d", exist_ok=True)
        for path, data in files.items():
            c.write_bytes(path, data)
        victim = c.status().servers[0]
    r = _cli("remove-server", str(victim.server_id), "--root", three.root, "--timeout", "150", timeout=200)
    assert r.returncode == 0, r.stderr
    assert f"server {victim.server_id}: removed" in r.stdout
    with three.client() as c:
        st = c.status()
        assert {s.server_id: s.state for s in st.servers}[victim.server_id] == "removed"
        assert not any(victim.server_id in ch["targets"] for ch in st.chains)
        assert all(len(ch["targets"]) == 2 for ch in st.chains)  # the slots moved: two replicas each
        shown = _cli("status", "--cluster", three.file)
        assert "removed" in shown.stdout, shown.stdout
    # It stops by itself: its next heartbeat is answered "removed".
    pid = victim.pid
    deadline = time.monotonic() + 15
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid), "a removed storage server stops"
    with three.client() as c:
        for path, data in files.items():
            assert c.read_bytes(path) == data
        c.write_bytes("/d/after", b"x" * (2 * TEST_CHUNK))
        assert c.read_bytes("/d/after") == b"x" * (2 * TEST_CHUNK)
    three.up()  # restarts nothing: the removed server is never started again
    with three.client() as c:
        assert {s.server_id: s.state for s in c.status().servers}[victim.server_id] == "removed"
    # A removed id cannot register again, even with its own data directory's token.
    root = next(s["root"] for s in three.data["servers"] if (s["host"], s["port"]) == (victim.host, victim.port))
    with open(os.path.join(root, "target.json")) as f:
        token = json.load(f)["token"]
    with Client(os.path.join(three.root, "server.json")) as c:
        for sid in (victim.server_id, None):
            with pytest.raises(StripefsError) as info:
                c.call(m.RegisterServer(host=victim.host, port=victim.port, root=root, server_id=sid,
                                        capacity=1, used=0, pid=1, token=token))
            assert info.value.errno == 1 and "removed" in info.value.message  # EPERM


def test_single_replica_is_refused_unless_forced_and_errors_are_clear(tmp_path_factory: pytest.TempPathFactory) -> None:
    h = LocalCluster.start(str(tmp_path_factory.mktemp("remove1")), servers=2, chunk_size=TEST_CHUNK, gc_grace=1.0)
    try:
        with h.client() as c:
            c.write_bytes("/one", os.urandom(4 * TEST_CHUNK))
            attr = c.stat("/one")
            st = c.status()
            victim = st.servers[1].server_id
            chains = [ch["chain_id"] for ch in st.chains if victim in ch["targets"]]
            before = (st.routing_version, [(ch["chain_id"], ch["targets"]) for ch in st.chains])
        r = _cli("remove-server", "99", "--root", h.root)
        assert r.returncode == 1 and "no storage server 99" in r.stderr, r.stderr
        # A client's cluster.json copied elsewhere has no servers' credential to act with.
        elsewhere = os.path.join(h.root, "logs", "client-copy.json")
        with open(h.file) as src, open(elsewhere, "w") as dst:
            dst.write(src.read())
        r = _cli("remove-server", str(victim), "--cluster", elsewhere)
        assert r.returncode == 1 and "servers' credential" in r.stderr, r.stderr
        r = _cli("remove-server", str(victim), "--root", h.root)
        assert r.returncode == 1
        assert "would lose chains " + ", ".join(map(str, chains)) in r.stderr, r.stderr
        # Exactly what would be lost: the chunks and bytes of /one on the victim's chains.
        held = sum(1 for i in range(4) if attr.layout.chain_of(i) in chains)
        assert f"{held} chunks, " in r.stderr and f"held only by server {victim}" in r.stderr, r.stderr
        assert "--force" in r.stderr
        with h.client() as c:
            st = c.status()
            assert (st.routing_version, [(ch["chain_id"], ch["targets"]) for ch in st.chains]) == before
        r = _cli("remove-server", str(victim), "--root", h.root, "--force")
        assert r.returncode == 0, r.stderr
        assert "chains lost: " + ", ".join(map(str, chains)) in r.stderr, r.stderr
        with h.client() as c:
            st = c.status()
            assert {s.server_id: s.state for s in st.servers}[victim] == "removed"
            assert not any(victim in ch["targets"] for ch in st.chains)
    finally:
        h.down()
