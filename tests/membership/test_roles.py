"""Server roles (issue 14 claim 8, issue 20): clients and servers hold different credentials.

A client connection (what a cluster.json gives) sends every server-only message --
membership, sync, chunk management, a versioned write straight to a chain's tail --
to the metadata service and to the storage servers: each is refused with EACCES and
changes nothing (the chain table, the stored bytes). The cluster.json that clients
read holds the client credential only, which cannot authenticate as a server; a
cluster directory written before roles (cluster.json holding the cluster secret)
still starts, and is upgraded.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import socket
import time
from typing import Any, Callable, Iterator

import crc32c
import pytest

from stripefs import wire
from stripefs.fsclient import Client
from stripefs.fsclient.core import ClusterConfig
from stripefs.fsclient.testing import LocalCluster
from stripefs.wire import ErrorCode, StripefsError
from stripefs.wire import messages as m

from ..conftest import TEST_CHUNK
from ..rpc.threaded import ThreadedServer

TOKEN = "cd" * 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    h = LocalCluster.start(str(tmp_path_factory.mktemp("roles")), servers=2, replicas=2, chunk_size=TEST_CHUNK,
                           gc_grace=1.0)
    yield h
    h.down()


@pytest.fixture(scope="module")
def stored(pair: LocalCluster) -> tuple[bytes, Any]:
    """A file of three chunks, written before any refused request."""
    data = os.urandom(3 * TEST_CHUNK)
    with pair.client() as c:
        c.write_bytes("/kept", data)
        return data, c.stat("/kept")


def _snapshot(c: Client) -> tuple[int, list, list]:
    st = c.status()
    return (st.routing_version, sorted((s.server_id, s.host, s.port, s.state) for s in st.servers),
            [(ch["chain_id"], ch["targets"], ch["states"]) for ch in st.chains])


def _tail(c: Client, chain: int) -> int:
    return c.routing(refresh=True).chains[chain][-1]


# (name, where: "meta" or "tail", message factory from (client, attr of /kept))
SERVER_ONLY: list[tuple[str, str, Callable[[Client, Any], m.Message]]] = [
    ("RegisterServer", "meta", lambda c, a: m.RegisterServer(
        host="127.0.0.1", port=9, root="/srv/rogue", capacity=1 << 40, used=0, pid=4242, token=TOKEN)),
    ("Heartbeat", "meta", lambda c, a: m.Heartbeat(server_id=1, capacity=1, used=0, chunks=0, token=TOKEN)),
    ("SyncDone", "meta", lambda c, a: m.SyncDone(server_id=1, token=TOKEN)),
    ("RemoveServer", "meta", lambda c, a: m.RemoveServer(server_id=1, force=True)),
    ("RemoveChunks", "tail", lambda c, a: m.RemoveChunks(ino=a.ino, from_index=0, forget=True)),
    ("TruncateChunk", "tail", lambda c, a: m.TruncateChunk(ino=a.ino, index=0, length=1)),
    ("DropChain", "tail", lambda c, a: m.DropChain(chain=a.layout.chain_of(0))),
    ("ListChunks", "tail", lambda c, a: m.ListChunks(chain=a.layout.chain_of(0))),
    ("FetchChunk", "tail", lambda c, a: m.FetchChunk(ino=a.ino, index=0)),
    ("WriteChunk(version)", "tail", lambda c, a: m.WriteChunk(
        ino=a.ino, index=0, offset=0, crc=0, chunk_size=a.layout.chunk_size, chain=a.layout.chain_of(0),
        routing_version=c.routing().version, version=1 << 40)),
    # Naming no chain: a server would store it as is, outside chain replication.
    ("WriteChunk(no chain)", "tail", lambda c, a: m.WriteChunk(
        ino=a.ino, index=0, offset=0, crc=0, chunk_size=a.layout.chunk_size)),
]


@pytest.mark.parametrize("name,where,make", SERVER_ONLY, ids=[s[0] for s in SERVER_ONLY])
def test_client_connection_cannot_send_server_only_messages(pair: LocalCluster, stored: tuple[bytes, Any],
                                                            name: str, where: str, make: Callable) -> None:
    data, attr = stored
    with pair.client() as c:
        before = _snapshot(c)
        msg = make(c, attr)
        with pytest.raises(StripefsError) as info:
            if where == "meta":
                c.call(msg, timeout=10.0)
            else:
                payload = None
                if isinstance(msg, m.WriteChunk):  # well-formed: only the role is wrong
                    payload = b"\0" * 4096
                    msg = dataclasses.replace(msg, crc=crc32c.crc32c(payload))
                c._core.data_conn(_tail(c, attr.layout.chain_of(0))).call(msg, payload, timeout=10.0)
        assert info.value.code == ErrorCode.ACCESS and info.value.errno == errno.EACCES, info.value
        assert "client" in info.value.message
        assert _snapshot(c) == before
        assert c.read_bytes("/kept") == data
        # Every replica still holds the chunks (a read may be served by either).
        routing = c.routing(refresh=True)
        for index in range(3):
            chain = attr.layout.chain_of(index)
            for sid in routing.chains[chain]:
                assert c.call_storage(sid, m.StatChunk(ino=attr.ino, index=index)).length == TEST_CHUNK


def test_cluster_file_holds_only_the_client_credential(pair: LocalCluster) -> None:
    raw = json.load(open(pair.file))
    assert "secret" not in raw and raw["client_secret"]
    assert oct(os.stat(pair.file).st_mode & 0o777) == "0o600"
    server_file = os.path.join(pair.root, "server.json")
    assert oct(os.stat(server_file).st_mode & 0o777) == "0o600"
    secret = json.load(open(server_file))["secret"]
    assert raw["client_secret"] == wire.role_credential(secret, "client") != wire.role_credential(secret, "server")
    addr = (raw["metadata"]["host"], raw["metadata"]["port"])
    # The client credential does not make a server: the handshake as one is refused.
    with pytest.raises(StripefsError) as info:
        _handshake(addr, raw["client_secret"], "server")
    assert info.value.code == ErrorCode.AUTH
    assert _handshake(addr, raw["client_secret"], "client") == "client"
    # The servers' file gives a configuration that authenticates as a server.
    cfg = ClusterConfig.from_file(server_file)
    assert cfg.role == "server" and _handshake(addr, cfg.secret, "server") == "server"


def _handshake(addr: tuple[str, int], credential: str, role: str) -> str:
    with socket.create_connection(addr, timeout=5) as sock:
        machine = wire.ClientConnection(credential, os.urandom(16), role=role)
        while True:
            event = machine.next_event()
            out = machine.data_to_send()
            if out:
                sock.sendall(out)
            if isinstance(event, wire.HandshakeComplete):
                return event.peer_role
            machine.receive_data(sock.recv(65536))


def test_server_connection_may_send_membership_messages(pair: LocalCluster) -> None:
    """The same frame from a server-role connection reaches the service (here: refused on its fields)."""
    with Client(os.path.join(pair.root, "server.json")) as c:
        with pytest.raises(StripefsError) as info:
            c.call(m.RegisterServer(host="127.0.0.1", port=0, root="/srv/x", pid=1, token=TOKEN))
        assert info.value.code == ErrorCode.INVALID


def test_cluster_directory_from_before_roles_starts_and_is_upgraded(tmp_path: Any) -> None:
    h = LocalCluster.start(str(tmp_path / "old"), servers=1, chunk_size=TEST_CHUNK)
    try:
        with h.client() as c:
            c.write_bytes("/before", b"kept across the upgrade")
        h.down()
        # Rewrite the directory as the code before roles left it: the secret in cluster.json.
        server = json.load(open(os.path.join(h.root, "server.json")))
        old = {k: v for k, v in server.items() if k != "role"}
        with open(h.file, "w") as f:
            json.dump(old, f)
        os.unlink(os.path.join(h.root, "server.json"))
        with Client(h.file) as c:  # an old cluster file still names a client...
            assert c.config.role == "client"
        h.up()
        raw = json.load(open(h.file))
        assert "secret" not in raw and raw["client_secret"] == wire.role_credential(old["secret"], "client")
        with h.client() as c:
            assert c.read_bytes("/before") == b"kept across the upgrade"
        old_copy = tmp_path / "old-cluster.json"
        old_copy.write_text(json.dumps({**old, "metadata": raw["metadata"]}))
        with Client(str(old_copy)) as c:  # ... that works against the upgraded cluster
            assert c.read_bytes("/before") == b"kept across the upgrade"
            with pytest.raises(StripefsError) as info:
                c.call(m.SyncDone(server_id=1, token=TOKEN))
            assert info.value.code == ErrorCode.ACCESS
    finally:
        h.down()


class _Impostor(ThreadedServer):
    """A 'storage server' built from what a client holds (the client credential), on a thread.

    It answers ``TargetInfo`` exactly as the registered server would; only the
    server credential is missing.
    """

    def __init__(self, credential: str, root: str):
        from stripefs.rpc import Service

        self.server_id: int | None = None
        impostor = self

        class Answers(Service):
            role = "storage"

            async def handle(self, conn: Any, head: Any, msg: Any, payload: Any) -> None:
                await conn.send(head, m.TargetInfoReply(server_id=impostor.server_id, capacity=1 << 40, free=1 << 40,
                                                        used=0, chunks=0, root=root, syncing=False,
                                                        sync_progress={}).to_header())

        super().__init__(Answers(), credential)


def test_connect_back_needs_the_server_credential(pair: LocalCluster) -> None:
    """A registration pointing at a server that holds only the client credential stays pending."""
    raw = json.load(open(pair.file))
    impostor = _Impostor(raw["client_secret"], "/srv/impostor")
    try:
        with Client(os.path.join(pair.root, "server.json")) as c:
            before = _snapshot(c)
            reply = c.call(m.RegisterServer(host="127.0.0.1", port=impostor.address[1], root="/srv/impostor",
                                            capacity=1 << 40, used=0, pid=4243, token=os.urandom(32).hex()))
            impostor.server_id = reply.server_id
            assert reply.state == "pending"
            deadline = time.monotonic() + 5
            reason = ""
            while time.monotonic() < deadline:
                pending = {p["server_id"]: p for p in c.status().metadata.get("pending", [])}
                reason = pending[reply.server_id]["reason"]
                if "not a storage server of this cluster" in reason:
                    break
                time.sleep(0.1)
            assert "not a storage server of this cluster" in reason, reason
            version, servers, chains = _snapshot(c)
            assert (version, chains) == (before[0], before[2])  # no chain moved, nothing admitted
            assert [s for s in servers if s[3] != "pending"] == before[1]
    finally:
        impostor.stop()
