"""A bounded structured fuzz of the control plane (issue 20).

2,000 membership frames (``RegisterServer``, ``Heartbeat``, ``SyncDone``) with
random field values -- edge integers, wrong types, hostile strings, the real
servers' own addresses and ids -- sent as any client can. Afterwards every
process is alive, nothing was registered, the routing version and the chain
table did not move, and the cluster reads and writes.
"""

from __future__ import annotations

import os
import random
from typing import Any, Callable, Iterator

import pytest

from fsclient import Client
from fsclient.testing import LocalCluster
from wire import StripefsError, messages as m

from ..conftest import TEST_CHUNK

FRAMES = 2000
SEED = 20


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    h = LocalCluster.start(str(tmp_path_factory.mktemp("fuzz")), servers=2, chunk_size=TEST_CHUNK, gc_grace=2.0)
    yield h
    h.down()


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


def _frame(rng: random.Random, v: dict[str, Callable[[], Any]], real: list[dict[str, Any]]) -> m.Message:
    """Half the frames are random in every field; half are well-formed with one field made random."""
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


def test_membership_fuzz_changes_nothing(fuzzed: LocalCluster) -> None:
    rng = random.Random(SEED)
    with fuzzed.client() as c:
        st = c.status()
        before = (st.routing_version, sorted((s.server_id, s.host, s.port, s.state) for s in st.servers),
                  [(ch["chain_id"], ch["targets"]) for ch in st.chains])
        v = _values(rng, fuzzed.data["servers"])
        answers: dict[str, int] = {}
        for _ in range(FRAMES):
            msg = _frame(rng, v, fuzzed.data["servers"])
            try:
                reply = c.call(msg, timeout=10.0)
                key = f"ok:{getattr(reply, 'state', '-')}"
            except StripefsError as exc:
                key = exc.code.name
            answers[key] = answers.get(key, 0) + 1
        print(f"{FRAMES} membership frames: {answers}")
        # A real server may only ever be admitted under its own token: never "serving" by a fuzzed frame.
        assert not any(k.startswith("ok:") and k not in ("ok:pending", "ok:-") for k in answers), answers
        for pid in fuzzed.data["pids"]:
            os.kill(pid, 0)  # raises if a process died
        st = c.status()
        after = (st.routing_version, sorted((s.server_id, s.host, s.port, s.state) for s in st.servers
                                           if s.state != "pending"),
                 [(ch["chain_id"], ch["targets"]) for ch in st.chains])
        assert after == before, answers
        data = os.urandom(5 * TEST_CHUNK + 3)
        c.write_bytes("/after-fuzz", data)
        assert c.read_bytes("/after-fuzz") == data
