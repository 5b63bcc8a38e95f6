"""A structured fuzz of the control plane, for a bounded number of frames or a duration.

    python -m stripefs.bench.control_fuzz [--duration 600] [--seed 20] [--root DIR]

Against a private local cluster (2 storage servers, R=2) it sends, round after round:

* membership frames (``RegisterServer``, ``Heartbeat``, ``SyncDone``) with random
  fields -- edge integers, wrong types, hostile strings, the real servers' own
  addresses and ids but never their tokens -- over a connection that holds the
  *server* credential, so they reach the service's validation;
* every server-only message (membership, ``RemoveServer``, chunk management,
  versioned writes) over a *client* connection: each must be refused with ACCESS;
* raw garbage, truncated and oversized frames, before and after the handshake, to
  the metadata service and to every storage server.

Afterwards it checks that every process is alive, that membership and the chain
table are unchanged (the fuzz sends no valid request that may change them), and
that the cluster serves reads and writes; it prints the frame counts, the
duration and each check, and exits 1 when a check failed. The same functions run
for a bounded count in ``make test`` (tests/membership/test_fuzz.py).

Caveats:
    * Frames go one at a time over one connection of each kind: the figure is the
      service's answer rate on this machine, not a load test.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import tempfile
import time
from typing import Any, Callable

import crc32c

from stripefs import wire
from stripefs.fsclient import Client
from stripefs.fsclient.testing import LocalCluster
from stripefs.wire import ErrorCode, StripefsError
from stripefs.wire import messages as m

__all__ = ["membership_frame", "client_frame", "junk", "authenticated", "snapshot", "Fuzz", "main"]


def _values(rng: random.Random, real: list[dict[str, Any]]) -> dict[str, Callable[[], Any]]:
    ints = [-(2 ** 63), -(2 ** 31), -1, 0, 1, 2, 3, 7, 65535, 65536, 2 ** 31, 2 ** 32, 2 ** 63 - 1]
    strings = ["", "127.0.0.1", "localhost", "::1", "0.0.0.0", "256.1.1.1", "bad host", "-x", "x" * 300, "a..b",
               "/srv/a", "relative", "/a\0b", "ab" * 32, "zz" * 32, "é", "/" * 5000]

    def anything() -> Any:
        return rng.choice([None, True, False, 1.5, b"\x00\xff", [], {}, [1, 2], {"a": 1}])

    def some_int() -> Any:
        roll = rng.random()
        if roll < 0.6:
            return rng.choice(ints)
        if roll < 0.9:
            return rng.randint(-1000, 70000)
        return anything()

    def some_str() -> Any:
        roll = rng.random()
        if roll < 0.7:
            return rng.choice(strings + [s["host"] for s in real] + [s["root"] for s in real])
        if roll < 0.9:
            return "".join(chr(rng.randint(1, 0x2FF)) for _ in range(rng.randint(0, 40)))
        return anything()

    def port() -> Any:
        return rng.choice([s["port"] for s in real]) if rng.random() < 0.3 else some_int()

    def server_id() -> Any:
        return rng.choice([1, 2, None]) if rng.random() < 0.4 else some_int()

    def token() -> Any:
        return os.urandom(32).hex() if rng.random() < 0.5 else some_str()

    return {"int": some_int, "str": some_str, "port": port, "server_id": server_id, "token": token}


def _valid(rng: random.Random, real: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """A well-formed frame of ``kind``: real servers' addresses, ids and roots, but never their tokens."""
    srv = rng.choice(real)
    token = os.urandom(32).hex()
    sid = rng.choice([None, 1, 2, rng.randint(3, 1000)])
    if kind == "register":
        return dict(host=rng.choice(["127.0.0.1", "localhost", srv["host"]]),
                    port=rng.choice([srv["port"], rng.randint(1, 65535)]), root=rng.choice([srv["root"], "/srv/fz"]),
                    server_id=sid, capacity=rng.randint(0, 1 << 40), used=rng.randint(0, 1 << 30),
                    pid=rng.randint(1, 1 << 22), token=token)
    if kind == "heartbeat":
        return dict(server_id=sid or 1, capacity=rng.randint(0, 1 << 40), used=rng.randint(0, 1 << 30),
                    chunks=rng.randint(0, 1000), token=token)
    return dict(server_id=sid or 1, token=token)


def membership_frame(rng: random.Random, real: list[dict[str, Any]]) -> m.Message:
    """Half the frames are random in every field; half are well-formed with one field made random."""
    v = _values(rng, real)
    kind = rng.choice(["register", "heartbeat", "syncdone"])
    cls = {"register": m.RegisterServer, "heartbeat": m.Heartbeat, "syncdone": m.SyncDone}[kind]
    if rng.random() < 0.5:
        fields = _valid(rng, real, kind)
        if rng.random() < 0.7:
            name = rng.choice(sorted(fields))
            gen = {"host": "str", "root": "str", "token": "token", "port": "port", "server_id": "server_id"}
            fields[name] = v[gen.get(name, "int")]()
        return cls(**fields)
    if kind == "register":
        return m.RegisterServer(host=v["str"](), port=v["port"](), root=v["str"](), server_id=v["server_id"](),
                                capacity=v["int"](), used=v["int"](), pid=v["int"](), token=v["token"]())
    if kind == "heartbeat":
        return m.Heartbeat(server_id=v["server_id"](), capacity=v["int"](), used=v["int"](), chunks=v["int"](),
                           token=v["token"]())
    return m.SyncDone(server_id=v["server_id"](), token=v["token"]())


def client_frame(rng: random.Random, real: list[dict[str, Any]]) -> tuple[m.Message, bytes | None, str]:
    """A server-only request as a client might forge it: ``(message, payload, "meta" | "storage")``.

    Membership and RemoveServer go to the metadata service; chunk management and
    versioned writes to a storage server. Each must be refused with ACCESS.
    """
    roll = rng.randrange(9)
    ino, index, chain = rng.randint(1, 1 << 20), rng.randint(0, 64), rng.randint(1, 16)
    if roll < 3:
        return membership_frame(rng, real), None, "meta"  # refused before its fields are even decoded
    if roll == 3:
        return m.RemoveServer(server_id=rng.randint(1, 3), force=rng.random() < 0.5), None, "meta"
    if roll == 4:
        return m.RemoveChunks(ino=ino, from_index=index, forget=rng.random() < 0.5), None, "storage"
    if roll == 5:
        return m.DropChain(chain=chain), None, "storage"
    if roll == 6:
        return rng.choice([m.ListChunks(chain=chain), m.FetchChunk(ino=ino, index=index),
                           m.TruncateChunk(ino=ino, index=index, length=rng.randint(0, 4096))]), None, "storage"
    payload = os.urandom(rng.randint(1, 8192))
    return (m.WriteChunk(ino=ino, index=index, offset=0, crc=crc32c.crc32c(payload), chunk_size=1 << 20, chain=chain,
                         version=rng.randint(1, 1 << 40), digest=rng.choice([None, rng.randint(0, 1 << 31)])),
            payload, "storage")


def authenticated(addr: tuple[str, int], credential: str, role: str = "server") -> tuple[socket.socket, wire.ClientConnection]:
    """A raw socket past the handshake (the machine decides every byte of it)."""
    sock = socket.create_connection(addr, timeout=5)
    machine = wire.ClientConnection(credential, os.urandom(16), role=role)
    while machine.state is not wire.ConnState.READY:
        event = machine.next_event()
        out = machine.data_to_send()
        if out:
            sock.sendall(out)
        if event is wire.NEED_DATA:
            machine.receive_data(sock.recv(65536))
    return sock, machine


# Server-only requests that a *valid* random header could turn into a real removal
# (RemoveChunks{ino}, DropChain{chain}, RemoveServer{server_id}): sent only where the
# server role refuses them, never over a server-role connection.
DESTRUCTIVE = (42, 50, 51)


def junk(rng: random.Random, role: str | None = None) -> bytes:
    """Garbage, a frame cut short, a frame claiming an oversized header or payload, or a random
    membership frame (well-formed or not) -- the last three only mean something after the handshake.

    ``role``: the connection's (None before the handshake); a server-role connection never
    gets a :data:`DESTRUCTIVE` message type.
    """
    roll = rng.random()
    if roll < 0.25:
        return os.urandom(rng.randint(1, 300))
    types = [28, 29, 48, 45, 3, rng.randint(0, 65535)] + ([] if role == "server" else list(DESTRUCTIVE))
    msg_type = rng.choice(types)
    while role == "server" and msg_type in DESTRUCTIVE:
        msg_type = rng.randint(0, 65535)
    header = {rng.choice(["host", "port", "root", "server_id", "token", "chain", "ino", "x"]): rng.choice(
        [1, -1, 2 ** 63 - 1, "127.0.0.1", "", None, b"\x00", [1], {"a": 1}]) for _ in range(rng.randint(0, 6))}
    frame = wire.encode_frame(msg_type, rng.randint(1, 2 ** 63), header)
    if roll < 0.45:
        return frame[: rng.randint(1, len(frame) - 1)]  # truncated: the server sees EOF mid-frame
    if roll < 0.6:  # a prefix claiming more than any frame may carry
        return b"SF\x01\x00" + msg_type.to_bytes(2, "big") + b"\x00\x00" + b"\x00" * 8 + \
            rng.choice([(1 << 31).to_bytes(4, "big") + b"\x00" * 8, b"\x00\x00\x00\x02" + (1 << 40).to_bytes(8, "big")])
    return frame


def snapshot(c: Client) -> tuple[int, list, list]:
    """What no fuzzed frame may change: routing version, admitted servers, the chain table."""
    st = c.status()
    return (st.routing_version, sorted((s.server_id, s.host, s.port, s.state) for s in st.servers if s.state != "pending"),
            [(ch["chain_id"], ch["targets"], ch["states"]) for ch in st.chains])


class Fuzz:
    """The three kinds of frames against one running cluster, with their tallies.

    Args:
        cluster: a running :class:`LocalCluster` (its server.json gives the server credential).
        seed: every choice derives from it (addresses and tokens aside).
    """

    def __init__(self, cluster: LocalCluster, seed: int = 20):
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.real = cluster.data["servers"]
        self.answers: dict[str, int] = {}
        self.refused_client = 0  # server-only frames from a client, each refused with ACCESS
        self.raw = 0  # raw connections (garbage before or after the handshake)
        self.unreachable: list[str] = []  # connections a server refused: it stopped listening
        self.frames = 0

    def _tally(self, key: str) -> None:
        self.answers[key] = self.answers.get(key, 0) + 1
        self.frames += 1

    def membership(self, server: Client, n: int) -> None:
        """``n`` membership frames as a server: validated by the service."""
        for _ in range(n):
            try:
                reply = server.call(membership_frame(self.rng, self.real), timeout=10.0)
                self._tally(f"ok:{getattr(reply, 'state', '-')}")
            except StripefsError as exc:
                self._tally(exc.code.name)

    def as_client(self, client: Client, n: int) -> None:
        """``n`` server-only frames from a client connection.

        Raises:
            AssertionError: one was not refused with ACCESS.
        """
        servers = sorted(client.routing(refresh=True).servers)
        for _ in range(n):
            msg, payload, where = client_frame(self.rng, self.real)
            try:
                if where == "meta":
                    client.call(msg, timeout=10.0)
                else:
                    client._core.data_conn(self.rng.choice(servers)).call(msg, payload, timeout=10.0)
            except StripefsError as exc:
                if exc.code != ErrorCode.ACCESS:
                    raise AssertionError(f"{type(msg).__name__} from a client: {exc.code.name} {exc.message}") from exc
                self.refused_client += 1
                self.frames += 1
                continue
            raise AssertionError(f"{type(msg).__name__} from a client was accepted")

    def raw_connections(self, n: int) -> None:
        """``n`` raw connections sending junk, half of them after a server-role handshake."""
        conf = self.cluster.data
        targets = [(conf["metadata"]["host"], conf["metadata"]["port"])] + [(s["host"], s["port"]) for s in self.real
                                                                             if not s.get("removed")]
        for i in range(n):
            addr = targets[(self.raw + i) % len(targets)]
            role = None if self.rng.random() < 0.5 else self.rng.choice(["server", "client"])
            try:
                if role is None:
                    sock = socket.create_connection(addr, timeout=5)
                else:
                    sock, _ = authenticated(addr, wire.role_credential(conf["secret"], role), role)
            except ConnectionRefusedError:
                self.unreachable.append(f"{addr[0]}:{addr[1]}")
                continue
            with sock:
                try:
                    for _ in range(self.rng.randint(1, 4)):
                        sock.sendall(junk(self.rng, role))
                        self.frames += 1
                    sock.shutdown(socket.SHUT_WR)
                    while sock.recv(65536):  # the server answers or closes; it never hangs
                        pass
                except TimeoutError:
                    raise  # a server waiting on a half-closed connection: the bug this looks for
                except OSError:
                    pass  # the server refused and closed first (reset, broken pipe, not connected)
        self.raw += n

    def check(self, before: tuple[int, list, list]) -> dict[str, bool]:
        """Processes alive, nothing changed, reads and writes served."""
        checks: dict[str, bool] = {}
        alive = True
        for pid in self.cluster.data["pids"]:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
        checks["processes alive"] = alive
        checks["every server accepted connections"] = not self.unreachable
        checks["no fuzzed frame admitted a server"] = not any(k.startswith("ok:") and k != "ok:pending"
                                                              for k in self.answers)
        with self.cluster.client() as c:
            checks["membership and chain table unchanged"] = snapshot(c) == before
            data = os.urandom(3 * (1 << 20) + 5)
            c.write_bytes(f"/fuzz-check-{self.frames}", data)
            checks["reads and writes served"] = c.read_bytes(f"/fuzz-check-{self.frames}") == data
        return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.control_fuzz", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of fuzzing")
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--root", help="cluster directory (default: a temporary one, removed afterwards)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stripefs-fuzz-") as tmp:
        root = args.root or tmp
        cluster = LocalCluster.start(root, servers=2, replicas=2, chunk_size=1 << 20, gc_grace=2.0)
        try:
            fuzz = Fuzz(cluster, args.seed)
            with cluster.client() as client, Client(os.path.join(cluster.root, "server.json")) as server:
                client.write_bytes("/fuzz-before", os.urandom(2 << 20))
                before = snapshot(client)
                started = time.monotonic()
                while time.monotonic() - started < args.duration:
                    fuzz.membership(server, 200)
                    fuzz.as_client(client, 100)
                    fuzz.raw_connections(20)
                elapsed = time.monotonic() - started
            checks = fuzz.check(before)
        finally:
            cluster.down()
    print(f"control-plane fuzz, seed {args.seed}: {fuzz.frames} frames in {elapsed:.0f} s "
          f"({fuzz.frames / elapsed:.0f}/s)")
    print(f"  membership frames as a server: {sum(fuzz.answers.values())} {dict(sorted(fuzz.answers.items()))}")
    print(f"  server-only frames as a client: {fuzz.refused_client}, every one refused with EACCES")
    print(f"  raw connections (garbage, truncated, oversized): {fuzz.raw}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
