"""Each role as a command for its own host (issue #34): ``stripefs serve metadata``,
``stripefs serve storage --join`` with a join token, a client from a client token, and the
one-line errors of a bad join (unreachable, wrong token, port in use, a root of another cluster).

Real processes on 127.0.0.1, each bounded in time and killed at the end."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from stripefs._cli_serve import decode_token, encode_token
from stripefs.fsclient import Client
from stripefs.wire import ClientConnection, HandshakeComplete, ServerConnection, StripefsError, new_secret
from stripefs.wire._auth import role_credential, role_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}
READY_WITHIN = 30.0


def _stripefs(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """``stripefs ARGS`` in a process of its own, bounded in time."""
    return subprocess.run([sys.executable, "-m", "stripefs", *args], text=True, capture_output=True,
                          timeout=timeout, cwd=ROOT, env=ENV)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(args: list[str], log: str, ready: str) -> subprocess.Popen:
    """Start ``stripefs ARGS`` and wait for its ready file."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stripefs", *args, "--ready", ready], cwd=ROOT, env=ENV,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + READY_WITHIN
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{' '.join(args[:2])} did not start:\n{open(log, errors='replace').read()[-2000:]}")
        time.sleep(0.05)
    return proc


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A metadata service and two storage servers, each started as its own host would."""
    base = str(tmp_path_factory.mktemp("serve"))
    state, port = os.path.join(base, "meta"), _free_port()
    procs = []
    try:
        procs.append(_start(["serve", "metadata", "--state", state, "--listen", f"127.0.0.1:{port}",
                             "--admit-after", "0"], os.path.join(base, "metadata.log"), os.path.join(base, "meta.ready")))
        token = _stripefs("token", "--state", state)
        assert token.returncode == 0, token.stderr
        token_file = os.path.join(base, "join.token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token.stdout)
        for i in range(2):
            root = os.path.join(base, f"storage-{i}")
            os.makedirs(root)
            procs.append(_start(["serve", "storage", "--join", f"127.0.0.1:{port}", "--token-file", token_file,
                                 "--root", root, "--listen", "127.0.0.1:0", "--advertise", "127.0.0.1"],
                                os.path.join(base, f"storage-{i}.log"), os.path.join(root, "ready")))
        yield {"base": base, "state": state, "addr": f"127.0.0.1:{port}", "port": port,
               "token": token.stdout.strip(), "token_file": token_file}
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_a_client_from_a_client_token_writes_and_reads(served: dict[str, Any]) -> None:
    client_token = _stripefs("token", "--client", "--state", served["state"])
    assert client_token.returncode == 0, client_token.stderr
    config = os.path.join(served["base"], "client", "cluster.json")
    os.makedirs(os.path.dirname(config))
    made = _stripefs("client-config", served["addr"], "--token", client_token.stdout.strip(), "-o", config)
    assert made.returncode == 0, made.stderr
    assert os.stat(config).st_mode & 0o777 == 0o600
    with Client(config) as fs:
        fs.write_bytes("/hello", b"over the join token" * 1000)
        assert fs.read_bytes("/hello") == b"over the join token" * 1000
        assert fs.stat("/hello").size == 19000


def test_tokens_never_hold_the_secret(served: dict[str, Any]) -> None:
    with open(os.path.join(served["state"], "server.json")) as f:
        secret = json.load(f)["secret"]
    assert os.stat(os.path.join(served["state"], "server.json")).st_mode & 0o777 == 0o600
    client = _stripefs("token", "--client", "--state", served["state"]).stdout.strip()
    for token in (served["token"], client):
        body = token.split("-", 2)[2].rpartition(".")[0]
        decoded = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        assert secret not in token and secret.encode() not in decoded
    assert set(decode_token(client, "client").credentials) == {"client"}
    assert set(decode_token(served["token"], "join").credentials) == {"client", "server"}


def test_an_unreachable_join_address_is_said_within_seconds(served: dict[str, Any], tmp_path) -> None:
    closed = _free_port()
    began = time.monotonic()
    r = _stripefs("serve", "storage", "--join", f"127.0.0.1:{closed}", "--token-file", served["token_file"],
                  "--root", str(tmp_path / "r"), "--listen", "127.0.0.1:0")
    assert r.returncode == 1, r.stderr
    assert f"cannot reach the metadata service at 127.0.0.1:{closed}" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert time.monotonic() - began < 20  # interpreter start-up on a loaded machine included


def test_a_token_of_another_cluster_is_refused(served: dict[str, Any], tmp_path) -> None:
    other = encode_token("join", "0123456789abcdef", {"client": "a" * 64, "server": "b" * 64})
    r = _stripefs("serve", "storage", "--join", served["addr"], "--token", other,
                  "--root", str(tmp_path / "r"), "--listen", "127.0.0.1:0")
    assert r.returncode == 1, r.stderr
    assert f"token refused by the cluster at {served['addr']}" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_mistyped_token_is_not_a_stripefs_token(served: dict[str, Any], tmp_path) -> None:
    token = served["token"]
    typo = token[:30] + ("A" if token[30] != "A" else "B") + token[31:]
    for bad in (typo, token[:-3], "hunter2"):
        r = _stripefs("client-config", served["addr"], "--token", bad)
        assert r.returncode == 2 and "not a stripefs token" in r.stderr, r.stderr
    r = _stripefs("client-config", served["addr"], "--token", token)  # a join token where a client one goes
    assert r.returncode == 2 and "this is a join token" in r.stderr, r.stderr


def test_a_port_in_use_is_said(served: dict[str, Any], tmp_path) -> None:
    r = _stripefs("serve", "storage", "--join", served["addr"], "--token-file", served["token_file"],
                  "--root", str(tmp_path / "r"), "--listen", served["addr"])
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on {served['addr']}" in r.stderr and "Traceback" not in r.stderr
    r = _stripefs("serve", "metadata", "--state", str(tmp_path / "m"), "--listen", served["addr"])
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on {served['addr']}" in r.stderr and "Traceback" not in r.stderr


def test_a_root_of_another_cluster_is_refused(served: dict[str, Any], tmp_path) -> None:
    root = tmp_path / "theirs"
    root.mkdir()
    (root / "target.json").write_text(json.dumps({"cluster_id": "feedfacefeedface"}))
    r = _stripefs("serve", "storage", "--join", served["addr"], "--token-file", served["token_file"],
                  "--root", str(root), "--listen", "127.0.0.1:0")
    assert r.returncode == 2, r.stderr
    assert f"storage root {root} belongs to cluster feedfacefeedface" in r.stderr and "Traceback" not in r.stderr


def test_listening_everywhere_needs_an_advertised_address(served: dict[str, Any], tmp_path) -> None:
    r = _stripefs("serve", "storage", "--join", served["addr"], "--token-file", served["token_file"],
                  "--root", str(tmp_path / "r"), "--listen", "0.0.0.0:0")
    assert r.returncode == 2 and "needs --advertise" in r.stderr, r.stderr


def _handshake(server: ServerConnection, client: ClientConnection) -> object:
    client.receive_data(server.start())
    client.next_event()
    server.receive_data(client.data_to_send())
    try:
        server.next_event()
    finally:
        client.receive_data(server.data_to_send())
    return client.next_event()


def test_a_server_with_role_keys_checks_each_role_with_its_credential() -> None:
    secret = new_secret()
    keys = role_keys({role: role_credential(secret, role) for role in ("client", "server")})
    assert secret not in keys and role_credential(keys, "server") == role_credential(secret, "server")
    for role in ("client", "server"):
        done = _handshake(ServerConnection(keys, "storage"), ClientConnection(role_credential(secret, role), b"c" * 16,
                                                                              role=role))
        assert isinstance(done, HandshakeComplete)
    with pytest.raises(StripefsError, match="authentication failed"):  # a client credential claiming "server"
        _handshake(ServerConnection(keys, "storage"), ClientConnection(role_credential(secret, "client"), b"c" * 16,
                                                                       role="server"))
    with pytest.raises(ValueError, match="no server credential"):
        role_credential(role_keys({"client": role_credential(secret, "client")}), "server")


def test_a_namespace_without_its_secret_gets_no_new_one(tmp_path) -> None:
    state = tmp_path / "meta"
    state.mkdir()
    (state / "meta.db").write_bytes(b"")
    r = _stripefs("serve", "metadata", "--state", str(state), "--listen", f"127.0.0.1:{_free_port()}")
    assert r.returncode == 1 and "holds a namespace but no server.json" in r.stderr, r.stderr
    assert not (state / "server.json").exists()
