"""The first hour of a new user (issue #37, items 1, 2, 3, 5, 7): the CLI and the client's
first contact with a cluster -- unreachable clusters said at once, the default cluster
fixed per process, messages that name the real problem, ls/put/ckpt as a user expects."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from stripefs import cli
from stripefs._upload import plan_tree, put_tree
from stripefs.fsclient import Client

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
         **kw: object) -> subprocess.CompletedProcess:
    """``stripefs ARGS`` in a process of its own, bounded in time."""
    kw.setdefault("capture_output", True)
    return subprocess.run([sys.executable, "-m", "stripefs", *args], text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, **kw)  # type: ignore[call-overload]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_cluster_file(tmp_path) -> str:
    """A cluster.json whose metadata address nothing listens on (a cluster after `down`)."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"metadata": {"host": "127.0.0.1", "port": _closed_port()}, "client_secret": "x"}))
    return str(path)


# -- item 2: an unreachable cluster -----------------------------------------------------------
@pytest.mark.parametrize("retry_for", [None, "5"])
def test_refused_everywhere_fails_fast_naming_the_address_and_the_file(dead_cluster_file, retry_for) -> None:
    port = json.load(open(dead_cluster_file))["metadata"]["port"]
    env = {"STRIPEFS_RETRY_FOR": retry_for} if retry_for else {}
    t0 = time.monotonic()
    r = _run("ls", "/", "--cluster", dead_cluster_file, env=env, timeout=30)
    took = time.monotonic() - t0
    assert r.returncode == 1 and took < 10, (took, r.stderr)
    assert f"127.0.0.1:{port}" in r.stderr and dead_cluster_file in r.stderr and "refused" in r.stderr, r.stderr


def test_library_client_that_never_got_in_fails_fast(dead_cluster_file) -> None:
    t0 = time.monotonic()
    with Client(dead_cluster_file) as c, pytest.raises(OSError) as err:
        c.stat("/")
    assert time.monotonic() - t0 < 5
    assert "no metadata service" in str(err.value) and dead_cluster_file in str(err.value)


def test_a_client_rides_out_a_metadata_restart_and_says_it_waits(make_cluster, caplog) -> None:
    h = make_cluster(servers=1)
    caplog.set_level(logging.WARNING, logger="stripefs.fsclient")
    with Client(h.file, retry_for=20) as c:
        c.mkdir("/before")
        os.kill(h.data["metadata"]["pid"], signal.SIGKILL)
        time.sleep(0.3)  # refusals from now on, until the restart
        restart = threading.Timer(2.0, h.up)
        restart.start()
        try:
            assert "before" in c.listdir("/")  # waited through the refusals, then answered
        finally:
            restart.join()
    said = caplog.text
    assert "waiting for the metadata service" in said and "answers again" in said, said
    os.kill(h.data["metadata"]["pid"], signal.SIGKILL)
    time.sleep(0.3)
    with Client(h.file, retry_for=2) as c:
        c._core.meta_health.answered = True  # as if it had been answered before the service died
        t0 = time.monotonic()
        with pytest.raises(OSError) as err:
            c.stat("/")
        assert 1.0 <= time.monotonic() - t0 < 10  # the budget, less the last backoff that would pass it
    assert "still failing after" in str(err.value) and h.file in str(err.value), err.value
    h.up()


def test_the_documented_retry_default_is_the_code_s() -> None:
    from stripefs.fsclient.core._metaretry import RETRY_ENV, RETRY_FOR

    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        doc = f.read()
    # | `Client(retry_for=S)` | `STRIPEFS_RETRY_FOR` | 30 s | what it bounds |
    row = re.search(rf"^\|[^\n]*?\|\s*`{RETRY_ENV}`\s*\|\s*(\d+(?:\.\d+)?) s\s*\|", doc, re.M)
    assert row, f"docs/operations.md has no table row for {RETRY_ENV} with its default"
    assert float(row.group(1)) == RETRY_FOR


# -- item 3: which cluster --------------------------------------------------------------------
def test_the_default_cluster_is_fixed_per_process_and_named(cluster, tmp_path) -> None:
    state = tmp_path / "state"
    pointer = state / "stripefs" / "last_cluster"
    pointer.parent.mkdir(parents=True)
    pointer.write_text(cluster.file)
    other = str(tmp_path / "other" / "cluster.json")
    code = ("import pathlib, sys\n"
            "from stripefs.fsclient import Client, find_cluster\n"
            "c = Client()\n"
            f"pathlib.Path({str(pointer)!r}).write_text({other!r})  # another user's `stripefs up`\n"
            "assert find_cluster().path == c.config.path, find_cluster().path\n"
            "print(find_cluster().path, find_cluster().source)\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "XDG_STATE_HOME": str(state)}
    env.pop("STRIPEFS_CLUSTER", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.split() == [cluster.file, "last", "up"], r.stdout + r.stderr
    pointer.write_text(cluster.file)
    r = _run("ls", "/", env={"XDG_STATE_HOME": str(state)})
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("\n") == 1 and cluster.file in r.stderr and "last `stripefs up`" in r.stderr, r.stderr
    assert cluster.file not in r.stdout  # stdout stays the listing
    r = _run("ls", "/", "--cluster", cluster.file, env={"XDG_STATE_HOME": str(state)})
    assert r.returncode == 0 and r.stderr == "", r.stderr


# -- item 5: messages -------------------------------------------------------------------------
def test_a_cluster_path_typo_says_no_such_file(cluster, capsys) -> None:
    typo = cluster.file[:-2]  # …/cluster.js
    assert cli.main(["ls", "/", "--cluster", typo]) == 1
    err = capsys.readouterr().err
    assert "no such file" in err and typo in err and "must be" not in err, err


def test_up_on_a_running_cluster_refuses_what_it_cannot_apply_and_adds_servers(make_cluster, capsys) -> None:
    h = make_cluster(servers=1)
    assert cli.main(["up", "--root", h.root, "--servers", "2", "--replicas", "3"]) == 1
    err = capsys.readouterr().err
    assert "--replicas 3" in err and "nothing was changed" in err, err
    with h.client() as c:
        assert len(c.status().servers) == 1
    assert cli.main(["up", "--root", h.root, "--servers", "2"]) == 0
    out = capsys.readouterr()
    assert "added 1 storage server" in out.err and out.out.strip() == f"127.0.0.1:{h.data['metadata']['port']}"
    h.data = json.load(open(h.file)) | {"secret": h.data["secret"]}
    with h.client() as c:
        assert len(c.status().servers) == 2
    assert cli.main(["up", "--root", h.root]) == 0  # no arguments: nothing to disagree with
    assert cli.main(["up", "--root", h.root, "--servers", "1"]) == 1  # up never removes a server
    assert "remove-server" in capsys.readouterr().err


# -- item 7: ls, ckpt, pipes ------------------------------------------------------------------
def test_ls_hides_dotfiles_unless_a_shows_human_sizes_and_owner_names(cluster, client, testdir, capsys) -> None:
    import grp
    import pwd

    client.write_bytes(f"{testdir}/.hidden", b"x")
    client.write_bytes(f"{testdir}/big", b"\0" * 1536)
    assert cli.main(["ls", testdir, "--cluster", cluster.file]) == 0
    assert capsys.readouterr().out.split() == ["big"]
    assert cli.main(["ls", "-a", testdir, "--cluster", cluster.file]) == 0
    assert sorted(capsys.readouterr().out.split()) == [".hidden", "big"]
    assert cli.main(["ls", "-lh", testdir, "--cluster", cluster.file]) == 0
    line = capsys.readouterr().out.strip()
    user, group = pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name
    assert line.split()[2:5] == [user, group, "1.5K"] and line.endswith(" big"), line
    with pytest.raises(SystemExit):
        cli.main(["ls", "--help"])
    assert "human" in capsys.readouterr().out


def test_output_into_a_closed_pipe_ends_quietly(cluster) -> None:
    r, w = os.pipe()
    os.close(r)  # `| head` that is gone already
    try:
        done = _run("status", "--cluster", cluster.file, stdout=w, capture_output=False, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_ckpt_list_latest_and_verify_of_a_dcp_step(cluster, client, testdir, tmp_path, capsys) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from stripefs import staging

    prefix = f"stripefs:/{testdir}"
    sdir = str(tmp_path / "s")
    for step in (5, 10):
        staging.save({"w": torch.full((100,), float(step))}, f"{prefix}/step-{step:06d}", staging_dir=sdir,
                     cluster=cluster.file, background_mover=False).wait(60)
    dcp_url = f"{prefix}/step-000020"
    dcp.save({"w": torch.ones(64)}, storage_writer=staging.StagedStorageWriter(dcp_url, staging_dir=sdir,
                                                                                cluster=cluster.file))
    client.makedirs(f"{testdir}/step-000030")  # never committed
    assert cli.main(["ckpt", "latest", prefix, "--cluster", cluster.file]) == 0
    assert capsys.readouterr().out.strip() == staging.latest(prefix, cluster=cluster.file) == dcp_url.replace(
        "stripefs:/", "stripefs://").replace(":///", "://")
    assert cli.main(["ckpt", "list", prefix, "--cluster", cluster.file]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["5", "10", "20", "-"], rows
    assert rows[2].endswith("(latest)") and rows[3].endswith("(not committed)"), rows
    assert cli.main(["ckpt", "verify", dcp_url, "--cluster", cluster.file]) == 0
    out = capsys.readouterr().out
    assert "OK (step 20," in out, out
    assert cli.main(["ckpt", "latest", f"{prefix}/nothing", "--cluster", cluster.file]) == 1


# -- item 1: recursive upload -----------------------------------------------------------------
def test_put_r_uploads_a_tree_in_parallel(cluster, client, testdir, tmp_path, capsys, monkeypatch) -> None:
    src = tmp_path / "ds"
    files = {f"a/f{i}": os.urandom(i * 997) for i in range(60)}
    files |= {f"a/b/g{i}": os.urandom(300_000 + i) for i in range(5)}
    files |= {".dot": b"hidden too", "top": b"t"}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    (src / "empty").mkdir()
    assert cli.main(["put", str(src), testdir, "--cluster", cluster.file]) == 1  # a directory needs -r
    assert "use put -r" in capsys.readouterr().err
    client.mkdir(f"{testdir}/ds")
    client.write_bytes(f"{testdir}/ds/top", b"an older, longer version")  # overwritten (truncated)
    assert cli.main(["put", "-r", "-j", "8", str(src), testdir, "--cluster", cluster.file]) == 0  # into it, as cp
    assert "67 files" in capsys.readouterr().err
    for rel, data in files.items():
        assert client.read_bytes(f"{testdir}/ds/{rel}") == data, rel
    assert client.isdir(f"{testdir}/ds/empty")
    assert cli.main(["put", "-r", str(src / "a"), f"{testdir}/copy", "--cluster", cluster.file]) == 0  # new name
    assert sorted(client.listdir(f"{testdir}/copy")) == sorted(["b"] + [f"f{i}" for i in range(60)])
    # Again over itself, two files changed: every name exists, so each is rewritten in place,
    # with no reservation spent and no commit refused.
    (src / "a" / "f3").write_bytes(b"changed")
    (src / "top").write_bytes(b"")
    sent: list[str] = []
    real = client.call
    monkeypatch.setattr(client, "call", lambda msg, **kw: (sent.append(type(msg).__name__), real(msg, **kw))[1])
    assert put_tree(client, plan_tree(str(src), f"{testdir}/ds")) == []
    assert "ReserveFiles" not in sent and "CommitFiles" not in sent
    assert client.read_bytes(f"{testdir}/ds/a/f3") == b"changed" and client.read_bytes(f"{testdir}/ds/top") == b""
    assert client.read_bytes(f"{testdir}/ds/a/b/g2") == files["a/b/g2"]


def test_df_counts_a_disk_shared_by_servers_once(cluster, client) -> None:
    """Four storage servers on one disk (the test cluster) are one disk's worth of space,
    and free space is what the disk has free (a 250 GB disk showed 1 TB free)."""
    disk = os.statvfs(cluster.root)
    size, free = disk.f_blocks * disk.f_frsize, disk.f_bavail * disk.f_frsize
    deadline = time.monotonic() + 10  # each server reports its disk with its heartbeat (1 s)
    while True:
        st = client.statfs()
        if st.capacity <= size or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert st.capacity <= size, f"{st.capacity} bytes reported on a disk of {size}"
    assert st.free <= free + (256 << 20), f"{st.free} bytes free reported, the disk has {free}"
    assert st.free > 0 and st.used >= 0
