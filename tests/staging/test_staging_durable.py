"""Every local directory staging renames into place is fsynced before (its entries) and after
(the rename, in its parent): a crash right after "locally durable" must not lose the step. And a
commit says how many replicas the store had serving: a step committed while a storage server of
an R=2 chain was down is not reported as fully durable."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stripefs import staging

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, str]]:
    """``(op, path)`` of every rename and every directory fsync this process makes."""
    seen: list[tuple[str, str]] = []
    real_rename, real_fsync = os.rename, os.fsync

    def rename(src, dst, *a, **kw):
        seen.append(("rename", os.path.abspath(src)))
        return real_rename(src, dst, *a, **kw)

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            seen.append(("fsync_dir", path))
        return real_fsync(fd)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _assert_published(events: list[tuple[str, str]], final: str) -> None:
    """``final`` (renamed from a ``.tmp-`` sibling) was fsynced before the rename, its parent after."""
    renames = [i for i, (op, p) in enumerate(events) if op == "rename" and os.path.dirname(p) == os.path.dirname(final)
               and p.endswith(os.path.basename(final))]
    assert renames, f"no rename into {final}: {events}"
    i = renames[-1]
    tmp = events[i][1]
    assert ("fsync_dir", tmp) in events[:i], f"{tmp} not fsynced before its rename: {events}"
    assert ("fsync_dir", os.path.dirname(final)) in events[i + 1 :], f"parent of {final} not fsynced: {events}"


def test_save_publishes_the_step_directory_durably(cluster, testdir, tmp_path, events):
    sdir = str(tmp_path / "s")
    h = staging.save({"w": torch.ones(1000)}, f"stripefs:/{testdir}/step-1", staging_dir=sdir, cluster=cluster.file,
                     upload=False, background_mover=False)
    h.wait(60, durable="local")
    _assert_published(events, os.path.join(sdir, "steps", h.id))


def test_dcp_writer_publishes_the_step_directory_durably(cluster, testdir, tmp_path, events):
    sdir = str(tmp_path / "s")
    w = staging.StagedStorageWriter(f"stripefs:/{testdir}/step-1", staging_dir=sdir, cluster=cluster.file, upload=False)
    ckpt_id = w.ckpt_id
    dcp.save({"w": torch.ones(1000)}, storage_writer=w)
    _assert_published(events, os.path.join(sdir, "steps", ckpt_id))


# -- what a commit was durable on: the replicas the store had serving ----------------------------

def _wait_degraded(client, timeout: float = 40.0) -> None:
    """Until the metadata service has taken the dead server out of its chains (~5 s of silence)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = client.status()
        if any(sum(s == "serving" for s in c["states"]) < st.replicas for c in st.chains):
            return
        time.sleep(0.2)
    raise AssertionError(f"no chain lost its dead server: {client.status().chains}")


def test_a_commit_with_a_storage_server_down_says_how_many_replicas_it_had(make_cluster, tmp_path, caplog, capsys):
    from stripefs import cli
    from stripefs.staging._replicas import Durability

    c = make_cluster(servers=2, replicas=2)
    client = c.client()
    client.makedirs("/ck")
    sdir = str(tmp_path / "s")

    def save(step: int) -> staging.SaveHandle:
        h = staging.save({"w": torch.randn(50_000)}, f"stripefs://ck/step-{step}", staging_dir=sdir, cluster=c.file,
                         background_mover=False)
        assert h.wait(120)
        return h

    full = save(1)
    assert full.durability is not None and full.durability.full
    assert (full.durability.replicas, full.durability.serving) == (2, 2)

    victim = client.status().servers[-1]
    os.kill(victim.pid, signal.SIGKILL)
    _wait_degraded(client)
    with caplog.at_level(logging.WARNING, logger="stripefs.staging"):
        weak = save(2)
    d = weak.durability
    assert d is not None and not d.full and (d.replicas, d.serving) == (2, 1) and d.degraded >= 1, d
    assert any("step-2" in r.getMessage() and "1/2 replicas" in r.getMessage() for r in caplog.records), caplog.text
    # The journal, the manifest and `stripefs ckpt list` say the same.
    row = staging.Mover(sdir).journal.get(weak.id)
    assert Durability.from_record(row.durability) == d
    man = staging.read_manifest("stripefs://ck/step-2", cluster=c.file)
    assert Durability.from_record(man["durability"]) == d
    assert Durability.from_record(staging.read_manifest("stripefs://ck/step-1", cluster=c.file)["durability"]).full
    assert cli.main(["ckpt", "list", "stripefs://ck", "--cluster", c.file]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert "replicas" in rows[0]
    assert " 2/2 " in rows[1] and "DEGRADED" not in rows[1], rows
    assert " 1/2 " in rows[2] and "DEGRADED" in rows[2] and rows[2].endswith("(latest)"), rows
    # A DCP save says the same on its writer (and warns), as the handle of staging.save does.
    caplog.clear()
    w = staging.StagedStorageWriter("stripefs://ck/step-3", staging_dir=sdir, cluster=c.file)
    with caplog.at_level(logging.WARNING, logger="stripefs.staging"):
        dcp.save({"w": torch.randn(50_000)}, storage_writer=w)
    assert w.durability == d, w.durability
    assert any("step-3" in r.getMessage() and "1/2 replicas" in r.getMessage() for r in caplog.records), caplog.text
    man = staging.read_manifest("stripefs://ck/step-3", cluster=c.file)
    assert Durability.from_record(man["durability"]) == d
    assert Durability.from_record(staging.Mover(sdir).journal.get(man["id"]).durability) == d
    client.close()
