"""The SQLite store's durability setting (``--metadata-sync full|normal``).

``full`` (the default) makes each acknowledged operation survive power loss;
``normal`` skips the fsync per commit but still survives a kill -9 of any
process: the operating system holds the write-ahead log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from stripefs.fsclient.core import pid_alive
from stripefs.fsclient.testing import LocalCluster
from stripefs.metadata import SqliteStore
from stripefs.wire import ErrorCode, StripefsError


def test_store_defaults_to_full_and_takes_normal(tmp_path) -> None:
    with SqliteStore(tmp_path / "a.db") as full:
        assert full.synchronous == "full"
    with SqliteStore(tmp_path / "b.db", synchronous="normal") as normal:
        assert normal.synchronous == "normal"
        with normal.transaction() as txn:  # still a working store
            txn.put_meta("k", "v")
    with SqliteStore(tmp_path / "b.db") as again:  # the setting is the opener's, not the file's
        assert again.synchronous == "full"
        with again.transaction() as txn:
            assert txn.get_meta("k") == "v"


@pytest.mark.parametrize("bad", ["off", "FULLER", ""])
def test_unknown_setting_is_a_typed_error(tmp_path, bad: str) -> None:
    with pytest.raises(StripefsError) as info:
        SqliteStore(tmp_path / "c.db", synchronous=bad)
    assert info.value.code == ErrorCode.INVALID and "full" in info.value.message


def test_up_refuses_bad_settings(tmp_path) -> None:
    from stripefs.fsclient.testing import up

    with pytest.raises(StripefsError) as info:
        up(str(tmp_path / "x"), servers=1, metadata_sync="off")
    assert info.value.code == ErrorCode.INVALID
    with pytest.raises(StripefsError) as info:  # PostgreSQL's durability is its own setting
        up(str(tmp_path / "y"), servers=1, metadata_store="postgresql", metadata_sync="normal")
    assert info.value.code == ErrorCode.INVALID and "postgresql" in info.value.message.lower()
    assert not os.path.exists(tmp_path / "x" / "cluster.json")  # refused before starting anything


def test_service_cli_refuses_a_bad_setting(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "stripefs.metadata", "--state", str(tmp_path), "--cluster", "/nonexistent",
                           "--sync", "sometimes"], capture_output=True, timeout=60, check=False)
    assert proc.returncode == 2 and b"--sync: invalid choice" in proc.stderr


def test_normal_keeps_every_acknowledged_create_across_kill_9(tmp_path) -> None:
    n = 300
    with LocalCluster.start(str(tmp_path / "c"), servers=1, metadata_sync="normal", gc_grace=1.0) as cluster:
        with cluster.client() as c:
            assert c.status().metadata["sync"] == "normal"
            c.makedirs("/k")
            for i in range(n):
                c.open(f"/k/f{i:04d}", "wb").close()  # returns once the service acknowledged it
            c.write_bytes("/k/data", b"payload")
        pid = cluster.data["metadata"]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:  # a zombie counts as gone
            time.sleep(0.05)
        cluster.up()  # starts the dead metadata service again, with the cluster's setting
        assert cluster.data["metadata"]["pid"] != pid
        with cluster.client() as c:
            assert c.status().metadata["sync"] == "normal"
            names = c.listdir("/k")
            assert names == sorted([f"f{i:04d}" for i in range(n)] + ["data"])
            assert c.read_bytes("/k/data") == b"payload"


def test_full_is_the_default_and_shown(make_cluster) -> None:
    cluster = make_cluster(servers=1)
    with cluster.client() as c:
        assert c.status().metadata["sync"] == "full"



def test_normal_never_hands_out_a_number_twice_after_losing_commits(tmp_path) -> None:
    """A power loss under ``normal`` may take back the last commits, the counters with
    them; an inode number given to a file that was lost must not name a new file (the
    storage servers may hold chunks under it)."""
    import shutil

    from stripefs.metadata import Namespace

    path = tmp_path / "meta.db"
    store = SqliteStore(path, synchronous="normal")
    ns = Namespace(store)
    ns.mkdir(1, "d", 0o755, 0, 0)
    # What the disk holds at the last fsync: a copy of the files now (before the commits
    # that a power loss could take back).
    disk = tmp_path / "disk"
    disk.mkdir()
    for suffix in ("", "-wal"):
        if os.path.exists(f"{path}{suffix}"):
            shutil.copy(f"{path}{suffix}", disk / f"meta.db{suffix}")
    lost = {ns.mkdir(1, f"lost{i}", 0o755, 0, 0).ino for i in range(20)}
    store.close()
    with SqliteStore(disk / "meta.db", synchronous="normal") as after:
        again = Namespace(after)
        assert [e.name for e in again.readdir(1)[0]] == ["d"]  # the copy lost them
        fresh = {again.mkdir(1, f"new{i}", 0o755, 0, 0).ino for i in range(5)}
    assert not fresh & lost and min(fresh) > max(lost)


def test_cli_up_takes_the_setting_and_status_shows_it(tmp_path) -> None:
    cli = [sys.executable, "-m", "stripefs"]
    root = str(tmp_path / "cli")
    up = subprocess.run([*cli, "up", "--root", root, "--servers", "1", "--metadata-sync", "normal"],
                        capture_output=True, timeout=120, check=False)
    try:
        assert up.returncode == 0, up.stderr.decode()
        status = subprocess.run([*cli, "status", "--cluster", os.path.join(root, "cluster.json")],
                                capture_output=True, timeout=60, check=False)
        assert status.returncode == 0 and b" sync normal " in status.stdout, status.stdout.decode()
    finally:
        subprocess.run([*cli, "down", "--root", root], capture_output=True, timeout=60, check=False)
    bad = subprocess.run([*cli, "up", "--root", root, "--metadata-sync", "never"], capture_output=True, timeout=60, check=False)
    assert bad.returncode == 2 and b"invalid choice" in bad.stderr
