"""Membership only real storage servers can join (issue 20).

Every test here talks to a private cluster with the server credential (what a
storage server holds: ``ROOT/server.json``; a client's cluster.json cannot send
these at all, see test_roles.py) and sends the membership messages:
bad fields are refused with EINVAL, a registration is only ``pending`` until
the metadata service has connected back and found a storage server with the
announced identity, and a server id is bound to its data directory's token.
"""

from __future__ import annotations

import os
import socket
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

TOKEN = "ab" * 32


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    h = LocalCluster.start(str(tmp_path_factory.mktemp("members")), servers=2, chunk_size=TEST_CHUNK, gc_grace=2.0)
    yield h
    h.down()


def _server(h: LocalCluster) -> Client:
    """A connection as a server of the cluster (the credential in ROOT/server.json)."""
    return Client(os.path.join(h.root, "server.json"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _snapshot(c: Client) -> tuple[int, list, list]:
    st = c.status()
    return (st.routing_version, sorted((s.server_id, s.host, s.port) for s in st.servers if s.state != "pending"),
            [(ch["chain_id"], ch["targets"]) for ch in st.chains])


BAD_REGISTRATIONS = [
    dict(host="", port=9000),
    dict(host="bad host!", port=9000),
    dict(host="-leading.dash", port=9000),
    dict(host="a" * 300, port=9000),
    dict(host="127.0.0.1", port=0),
    dict(host="127.0.0.1", port=65536),
    dict(host="127.0.0.1", port=9223372036854775807),
    dict(host="127.0.0.1", port=-1),
    dict(host="127.0.0.1", port=9000, capacity=-1),
    dict(host="127.0.0.1", port=9000, used=-1),
    dict(host="127.0.0.1", port=9000, pid=0),
    dict(host="127.0.0.1", port=9000, pid=-5),
    dict(host="127.0.0.1", port=9000, root="relative/dir"),
    dict(host="127.0.0.1", port=9000, root=""),
    dict(host="127.0.0.1", port=9000, root="/a\0b"),
    dict(host="127.0.0.1", port=9000, server_id=0),
    dict(host="127.0.0.1", port=9000, server_id=-3),
    dict(host="127.0.0.1", port=9000, token=""),
    dict(host="127.0.0.1", port=9000, token="not hex"),
]


@pytest.mark.parametrize("fields", BAD_REGISTRATIONS, ids=lambda f: ",".join(f"{k}={str(v)[:12]}" for k, v in f.items()))
def test_bad_registration_fields_get_einval_and_change_nothing(small: LocalCluster, fields: dict) -> None:
    msg = {"root": "/srv/x", "capacity": 1 << 30, "used": 0, "pid": 1234, "token": TOKEN, **fields}
    with _server(small) as c:
        before = _snapshot(c)
        with pytest.raises(StripefsError) as info:
            c.call(m.RegisterServer(**msg))
        assert info.value.errno == 22, info.value
        assert _snapshot(c) == before


@pytest.mark.parametrize("msg", [
    m.Heartbeat(server_id=1, capacity=-1, used=0, chunks=0, token=TOKEN),
    m.Heartbeat(server_id=1, capacity=10, used=-1, chunks=0, token=TOKEN),
    m.Heartbeat(server_id=1, capacity=10, used=0, chunks=-1, token=TOKEN),
    m.Heartbeat(server_id=0, capacity=10, used=0, chunks=0, token=TOKEN),
    m.SyncDone(server_id=0, token=TOKEN),
    m.SyncDone(server_id=-1, token=TOKEN),
], ids=repr)
def test_bad_heartbeat_and_syncdone_fields_get_einval(small: LocalCluster, msg: m.Message) -> None:
    with _server(small) as c:
        before = _snapshot(c)
        with pytest.raises(StripefsError) as info:
            c.call(msg)
        assert info.value.errno == 22, info.value
        assert _snapshot(c) == before


def test_phantom_registrations_stay_pending_and_take_no_chain(small: LocalCluster) -> None:
    """The issue's reproduction: three registrations naming an address where nothing listens."""
    with _server(small) as c:
        before = _snapshot(c)
        sids = []
        for i in range(3):
            reply = c.call(m.RegisterServer(host="127.0.0.1", port=_free_port(), root=f"/srv/phantom{i}",
                                            capacity=1 << 40, used=0, pid=4242, token=os.urandom(32).hex()))
            assert reply.state == "pending"
            sids.append(reply.server_id)
        time.sleep(1.0)  # several connect-back attempts
        st = c.status()
        pending = {p["server_id"]: p for p in st.metadata.get("pending", [])}
        assert set(sids) <= set(pending)
        assert all(pending[s]["reason"] for s in sids)
        assert {s.server_id: s.state for s in st.servers if s.server_id in sids} == dict.fromkeys(sids, "pending")
        assert _snapshot(c) == before
        shown = subprocess.run([sys.executable, "-m", "stripefs", "status", "--cluster", small.file],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        for sid in sids:
            assert f"pending {sid} (127.0.0.1:" in shown.stdout and "cannot connect back" in shown.stdout, shown.stdout
        c.makedirs("/phantom", exist_ok=True)
        for i in range(5):  # every write lands on a real server
            data = os.urandom(8 << 20)
            c.write_bytes(f"/phantom/f{i}", data)
            assert c.read_bytes(f"/phantom/f{i}") == data
        assert _snapshot(c) == before


def test_a_server_id_is_bound_to_its_data_directory_token(small: LocalCluster) -> None:
    with _server(small) as c:
        before = _snapshot(c)
        real = c.status().servers[0]
        root = small.data["servers"][0]["root"]
        for msg in (
            m.RegisterServer(host=real.host, port=real.port, root=root, server_id=real.server_id,
                             capacity=1, used=0, pid=1, token=TOKEN),
            m.Heartbeat(server_id=real.server_id, capacity=1, used=0, chunks=0, token=TOKEN),
            m.SyncDone(server_id=real.server_id, token=TOKEN),
        ):
            with pytest.raises(StripefsError) as info:
                c.call(msg)
            assert info.value.errno == 1, (msg, info.value)  # EPERM
        assert _snapshot(c) == before


def test_registration_naming_a_real_server_under_a_new_id_is_not_admitted(small: LocalCluster) -> None:
    with _server(small) as c:
        before = _snapshot(c)
        real = c.status().servers[0]
        root = small.data["servers"][0]["root"]
        reply = c.call(m.RegisterServer(host=real.host, port=real.port, root=root, capacity=1, used=0, pid=1,
                                        token=os.urandom(32).hex()))
        assert reply.state == "pending"
        time.sleep(1.0)
        pending = {p["server_id"]: p for p in c.status().metadata.get("pending", [])}
        assert "server" in pending[reply.server_id]["reason"]
        assert _snapshot(c) == before


def test_restarted_server_is_admitted_again(small: LocalCluster) -> None:
    """A real server's re-registration (same token, new port) passes the connect-back check."""
    with small.client() as c:
        before = c.status()
    pid = small.data["servers"][1]["pid"]
    os.kill(pid, 9)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:  # SIGKILL lands asynchronously
        time.sleep(0.02)
    small.up()  # starts only the dead server; returns once it is admitted
    with small.client() as c:
        st = c.status()
        assert all(s.state == "serving" for s in st.servers if s.state != "pending")
        assert {s.server_id for s in st.servers if s.state == "serving"} == {s.server_id for s in before.servers if s.state != "pending"}
        data = os.urandom(3 * TEST_CHUNK)
        c.write_bytes("/after-restart", data)
        assert c.read_bytes("/after-restart") == data
