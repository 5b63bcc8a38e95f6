"""``keep_local=0``: the upload streams from the snapshot buffer and nothing is written locally.

A save that keeps no local copy lives only in the trainer's memory until its commit: the
journal says so (state ``streaming``), and a trainer killed before the commit loses that step
cleanly — the mover abandons it with a reason naming ``keep_local=0``, removes the partial
upload, and ``latest()`` keeps naming the previous step.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from stripefs import staging
from stripefs.staging import MoverOptions
from stripefs.staging._journal import Journal

from stripefs.staging._sweep import assert_same, check_latest, mover_pass, run_forked, save_step, state_for


@pytest.fixture
def sdir(tmp_path) -> str:
    return str(tmp_path / "staging")


def _local_files(sdir: str) -> list[str]:
    steps = os.path.join(sdir, "steps")
    return [os.path.join(d, f) for d, _, fs in os.walk(steps) for f in fs] if os.path.isdir(steps) else []


def test_keep_local_0_writes_nothing_locally(cluster, testdir, sdir):
    state = {"w": torch.randn(2 << 20), "b": torch.arange(10, dtype=torch.bfloat16), "step": 7}  # 8 MiB
    opts = MoverOptions(cluster=cluster.file, bandwidth=8e6, piece=1 << 20)  # ~1 s of upload
    url = f"stripefs:/{testdir}/step-000007"
    h = staging.save(state, url, staging_dir=sdir, cluster=cluster.file, keep_local=0, options=opts,
                     background_mover=False)
    journal, seen = Journal(sdir), set()
    while not h.done():
        row = journal.get(h.id)
        if row is not None:
            seen.add(row.state)
        assert not _local_files(sdir), "keep_local=0 wrote a local file"
        time.sleep(0.02)
    assert h.wait(60)
    assert "streaming" in seen, seen  # the journal says the step exists only in this process's memory
    assert journal.get(h.id).state == "committed"
    assert h.locally_durable and h.globally_durable and "local_write" not in h.timings
    assert not _local_files(sdir)
    assert_same(staging.load(url, cluster=cluster.file), state)


def test_keep_local_0_needs_upload(cluster, sdir):
    with pytest.raises(ValueError, match="keep_local=0"):
        staging.save({"w": torch.zeros(4)}, "stripefs://x/step-1", staging_dir=sdir, cluster=cluster.file,
                     keep_local=0, upload=False)


def test_keep_local_0_zstd_streams_too(cluster, testdir, sdir):
    state = {"w": torch.zeros(1 << 20), "r": torch.randn(1000)}
    url = f"stripefs:/{testdir}/step-1"
    h = staging.save(state, url, staging_dir=sdir, cluster=cluster.file, keep_local=0, compress="zstd",
                     background_mover=False)
    assert h.wait(60)
    assert not _local_files(sdir)
    assert_same(staging.load(url, cluster=cluster.file), state)


@pytest.mark.parametrize("kill_at", ["upload_piece:2", "before_rename:1", "after_rename:1"])
def test_keep_local_0_trainer_killed(cluster, client, testdir, tmp_path, kill_at):
    """Killed before the commit: the step is lost, never half-visible; killed after it: committed."""
    sdir, out = str(tmp_path / "staging"), str(tmp_path / "out")
    rc, text = run_forked(save_step, (sdir, f"stripefs:/{testdir}/step-000001", 1, cluster.file, True, 1), {}, out)
    assert rc == 0, text
    rc, text = run_forked(save_step, (sdir, f"stripefs:/{testdir}/step-000002", 2, cluster.file, True, 0),
                          {"STRIPEFS_STAGING_KILL_AT": kill_at}, out)
    assert rc == -signal.SIGKILL, text
    cid = Journal(sdir).checkpoints()[-1].id
    assert not [f for f in _local_files(sdir) if cid in f], "keep_local=0 wrote a local file"
    rc, text = mover_pass(cluster.file, sdir, out)
    assert rc == 0, text
    row = Journal(sdir).checkpoints()[-1]
    if kill_at.startswith("after_rename"):
        assert row.state == "committed", (row.state, row.error)
        check_latest(cluster.file, testdir, 2, f"keep_local=0 killed at {kill_at}")
    else:
        assert row.state == "abandoned", (row.state, row.error)
        assert "keep_local=0" in (row.error or ""), row.error
        check_latest(cluster.file, testdir, 1, f"keep_local=0 killed at {kill_at}")
    assert not [n for n in client.listdir(testdir) if n.startswith(".")], "partial upload left"
    assert_same(staging.load(staging.latest(f"stripefs:/{testdir}", cluster=cluster.file), cluster=cluster.file,
                             prefer_local=False), state_for(2 if row.state == "committed" else 1))


def test_stored_checksums_check_every_replica(make_cluster):
    """The check a keep_local=0 upload gets instead of a read-back: every replica's stored CRC32Cs."""
    from stripefs.staging._journal import FileRow
    from stripefs.staging._verify import stored_problem

    c = make_cluster(servers=3, replicas=2)
    client = c.client()
    data = bytearray(os.urandom((3 << 20) + 12345))  # several chunks, the last one short
    client.write_bytes("/f.bin", bytes(data))
    row = FileRow("f.bin", len(data), 0, 4 << 20, [], len(data))
    assert stored_problem(client, "/", row, memoryview(data)) is None
    data[(1 << 20) + 7] ^= 1  # the bytes in memory differ from what the servers stored
    assert "CRC32C" in stored_problem(client, "/", row, memoryview(data))
    data[(1 << 20) + 7] ^= 1
    client.truncate("/f.bin", len(data) - 1)
    assert "committed size" in stored_problem(client, "/", row, memoryview(data))
    assert stored_problem(client, "/", FileRow("nope.bin", 1, 0, 4 << 20, [], 1), memoryview(b"x")) == "missing"
    client.close()
