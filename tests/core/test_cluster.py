"""Cluster lifecycle, CLI end to end, authentication, bad input and failures."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from stripefs import wire
from stripefs.fsclient import Client
from stripefs.rpc import Connection
from tests.conftest import TEST_CHUNK
from stripefs.wire import ErrorCode, StripefsError, messages as m

CLI = [sys.executable, "-m", "stripefs"]


def run_cli(*args: str, cluster: str, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args, "--cluster", cluster] if args[0] not in ("up", "down") else [*CLI, *args],
                          capture_output=True, input=input, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"stripefs {' '.join(args)} failed: {proc.stderr.decode()}")
    return proc


def test_cli_end_to_end(cluster, tmp_path, testdir: str) -> None:
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(3 * TEST_CHUNK * 4 + 99))
    run_cli("mkdir", "-p", f"stripefs://{testdir}/x/y", cluster=cluster.file)
    run_cli("put", str(src), f"{testdir}/x/y/", cluster=cluster.file)
    ls = run_cli("ls", "-l", f"{testdir}/x/y", cluster=cluster.file).stdout.decode()
    assert "in.bin" in ls and str(src.stat().st_size) in ls
    st = json.loads(run_cli("stat", "--chunks", f"{testdir}/x/y/in.bin", cluster=cluster.file).stdout)
    assert st["size"] == src.stat().st_size and len({c["server"] for c in st["chunks"]}) == 4
    out = tmp_path / "out.bin"
    run_cli("get", f"{testdir}/x/y/in.bin", str(out), cluster=cluster.file)
    assert out.read_bytes() == src.read_bytes()
    assert run_cli("cat", f"{testdir}/x/y/in.bin", cluster=cluster.file).stdout == src.read_bytes()
    run_cli("cp", f"{testdir}/x/y/in.bin", f"{testdir}/copy", cluster=cluster.file)
    run_cli("mv", f"{testdir}/copy", f"{testdir}/moved", cluster=cluster.file)
    assert run_cli("cat", f"{testdir}/moved", cluster=cluster.file).stdout == src.read_bytes()
    bad = run_cli("rm", f"{testdir}/x", cluster=cluster.file, check=False)
    assert bad.returncode == 1 and b"is a directory" in bad.stderr
    run_cli("rm", "-r", f"{testdir}/x", cluster=cluster.file)
    missing = run_cli("cat", f"{testdir}/x/y/in.bin", cluster=cluster.file, check=False)
    assert missing.returncode == 1 and b"no such file" in missing.stderr.lower()
    status = json.loads(run_cli("status", "--json", cluster=cluster.file).stdout)
    assert len(status["servers"]) == 4 and all(s["state"] == "serving" and s["capacity"] > 0 for s in status["servers"])
    assert len(status["chains"]) >= 4 and {t for c in status["chains"] for t in c["targets"]} == {s["server_id"] for s in status["servers"]}


def test_cli_rm_r_removes_links_not_what_they_point_at(cluster, client: Client, testdir: str) -> None:
    client.makedirs(f"{testdir}/run0/sub")
    client.write_bytes(f"{testdir}/run0/sub/a.bin", b"keep me")
    client.makedirs(f"{testdir}/run1")
    client.symlink(f"{testdir}/run0", f"{testdir}/run1/latest")
    client.symlink(f"{testdir}/run0/sub/a.bin", f"{testdir}/run1/a-link")
    run_cli("rm", "-r", f"{testdir}/run1", cluster=cluster.file)
    assert not client.exists(f"{testdir}/run1")
    assert client.read_bytes(f"{testdir}/run0/sub/a.bin") == b"keep me"
    client.symlink(f"{testdir}/run0", f"{testdir}/top-link")
    run_cli("rm", "-r", f"{testdir}/top-link", cluster=cluster.file)  # the link itself goes
    assert client.listdir(f"{testdir}/run0") == ["sub"]


def test_cluster_file_is_private(cluster) -> None:
    assert os.stat(cluster.file).st_mode & 0o777 == 0o600


def test_restart_keeps_committed_files(make_cluster) -> None:
    h = make_cluster(servers=3)
    data = os.urandom(TEST_CHUNK * 7 + 5)
    with h.client() as c:
        c.makedirs("/keep/me")
        c.write_bytes("/keep/me/f", data)
        c.symlink("me/f", "/keep/link")
    port = h.data["metadata"]["port"]
    h.restart()
    assert h.data["metadata"]["port"] == port  # same address when free: old clients keep working
    with h.client() as c:
        assert c.read_bytes("/keep/link") == data
        assert len(c.status().servers) == 3


def test_wrong_secret_is_refused(cluster) -> None:
    conf = json.load(open(cluster.file))
    addr = (conf["metadata"]["host"], conf["metadata"]["port"])
    with pytest.raises(StripefsError) as exc:
        Connection(addr, "not-the-secret", os.urandom(16))
    assert exc.value.code == ErrorCode.AUTH and exc.value.errno == errno.EACCES
    with pytest.raises(PermissionError):
        Client(f"{addr[0]}:{addr[1]}", secret="wrong").stat("/")


def test_unauthenticated_requests_are_refused(cluster) -> None:
    conf = json.load(open(cluster.file))
    with socket.create_connection((conf["metadata"]["host"], conf["metadata"]["port"]), timeout=5) as s:
        dec = wire.FrameDecoder()
        while (ev := dec.next_event()) is wire.NEED_DATA:
            dec.feed(s.recv(4096))
        assert ev.head.msg_type == m.Challenge.MSG_ID
        s.sendall(wire.encode_frame(m.Resolve.MSG_ID, 1, m.Resolve(path="/").to_header()))
        while (ev := dec.next_event()) is wire.NEED_DATA:
            data = s.recv(4096)
            assert data, "server closed without answering"
            dec.feed(data)
        assert ev.head.is_error and ev.head.header["code"] == ErrorCode.AUTH


def test_garbage_frames_do_not_hurt_the_server(cluster, client: Client, testdir: str) -> None:
    conf = json.load(open(cluster.file))
    targets = [(conf["metadata"]["host"], conf["metadata"]["port"])] + [(s["host"], s["port"]) for s in conf["servers"]]
    for addr in targets:
        for junk in (b"GET / HTTP/1.1\r\n\r\n", os.urandom(64), b"SF\x01\x00" + b"\xff" * 24):
            with socket.create_connection(addr, timeout=5) as s:
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)  # EOF after the junk: the server must not wait for more
                s.settimeout(5)
                try:
                    while s.recv(4096):
                        pass
                except (ConnectionResetError, socket.timeout):
                    pass
    client.write_bytes(f"{testdir}/still-ok", b"fine")  # every server still serves
    assert client.read_bytes(f"{testdir}/still-ok") == b"fine"


def test_bad_requests_get_typed_errors(cluster, client: Client, testdir: str) -> None:
    client.write_bytes(f"{testdir}/f", b"x" * 10)
    attr = client.stat(f"{testdir}/f")
    sid = client.routing().chains[attr.layout.chain_of(0)][0]
    conn = client.data_connection(sid)
    with pytest.raises(StripefsError) as exc:  # payload does not match its checksum
        conn.call(m.WriteChunk(ino=attr.ino, index=0, offset=0, crc=1234, chunk_size=TEST_CHUNK,
                               chain=attr.layout.chain_of(0), routing_version=client.routing().version), payload=b"abc")
    assert exc.value.code == ErrorCode.CHECKSUM
    with pytest.raises(StripefsError) as exc:  # beyond the chunk
        conn.call(m.ReadChunk(ino=attr.ino, index=0, offset=-1, length=10))
    assert exc.value.errno == errno.EINVAL
    with pytest.raises(StripefsError) as exc:  # a metadata request sent to a storage server
        conn.call(m.Resolve(path="/"))
    assert exc.value.code == ErrorCode.NOT_SUPPORTED
    with pytest.raises(OSError) as exc2:
        with client.open(f"{testdir}/f", "r+b") as f:
            f.pwrite(b"x", wire.MAX_FILE_SIZE)
    assert exc2.value.errno == errno.EFBIG
    assert client.read_bytes(f"{testdir}/f") == b"x" * 10


def test_dead_server_gives_clear_error_and_others_keep_serving(make_cluster) -> None:
    h = make_cluster(servers=2)
    with h.client(retry_for=5.0) as c:  # a chain with no serving target is waited for this long
        c.set_layout("/", stripe=1)
        c.write_bytes("/a", b"a" * 100)
        c.write_bytes("/b", b"b" * 100)
        sid_a = c.placement("/a")[0]["server"]
        victim = next(s for s in c.status().servers if s.server_id == sid_a)
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(OSError) as exc:
            c.read_bytes("/a")
        assert exc.value.errno == errno.EHOSTUNREACH
        assert time.monotonic() - t0 < 60  # bounded: fails once the server is declared offline
        other = "/b" if c.placement("/b")[0]["server"] != sid_a else None
        if other:
            assert c.read_bytes(other) == b"b" * 100
        c.mkdir("/meta-still-works")


def test_postgresql_metadata_store_end_to_end(make_cluster, tmp_path) -> None:
    from stripefs.fsclient.testing import LocalPostgres, postgres_bin

    if postgres_bin("initdb") is None:
        pytest.skip("PostgreSQL server binaries are not installed (apt-get install postgresql)")
    h = make_cluster(servers=2, metadata_store="postgresql")
    try:
        data = os.urandom(3 * TEST_CHUNK + 5)
        with h.client() as c:
            c.makedirs("/pg/d")
            c.write_bytes("/pg/d/f", data)
            c.setxattr("/pg/d/f", "user.k", b"v")
            assert c.status().metadata["store"] == "postgresql"
        h.restart()  # metadata service, storage servers and the private PostgreSQL
        with h.client() as c:
            assert c.read_bytes("/pg/d/f") == data and c.getxattr("/pg/d/f", "user.k") == b"v"
        status = json.loads(run_cli("status", "--json", cluster=h.file).stdout)
        assert status["metadata"]["store"] == "postgresql"
    finally:
        h.down()
        LocalPostgres(h.root).destroy()
    assert not LocalPostgres(h.root).running()


def test_a_retried_mutation_still_in_flight_runs_once(cluster, testdir: str) -> None:
    # A client whose connection broke retries with the same (client id, request id) on a
    # new one; the original may still be queued. Both must get the original's answer.
    from stripefs.fsclient.core import find_cluster

    cfg = find_cluster(cluster.file)
    client_id = os.urandom(16)
    with Client(cluster.file) as c:
        parent = c.stat(testdir).ino
    conns = [Connection(cfg.metadata, cfg.secret, client_id, expect_role="metadata") for _ in range(2)]
    try:
        for i in range(20):
            msg = m.Create(parent=parent, name=f"once-{i}", mode=0o644, exclusive=True)
            futs = [conn.submit(msg, req_id=1000 + i) for conn in conns]  # same ids, twice at once
            replies = [wire.decode_reply(msg, f.result(30).header) for f in futs]
            assert replies[0] == replies[1] and replies[0].created, f"round {i}: {replies}"
    finally:
        for conn in conns:
            conn.close()
