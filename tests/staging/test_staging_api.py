"""staging.save / load / latest against a real loopback cluster: format, handle, faults."""

from __future__ import annotations

import errno
import gc
import os
import pickle
import signal
import time
import subprocess
import threading
import weakref
from collections import OrderedDict

import numpy as np
import pytest
import torch

from stripefs import staging
from stripefs.staging import CheckpointConflict, ChecksumError, Mover, MoverOptions


class Opaque:
    """A value with no JSON form and no weights_only allow-listing."""

    def __init__(self, x: int):
        self.x = x


def _state() -> dict:
    w = torch.randn(300, 200)
    return {
        "model": OrderedDict(w=w, b=torch.arange(10, dtype=torch.int64), h=torch.ones(4, 4, dtype=torch.bfloat16)),
        "tied": w,
        "optim": {"state": {0: {"exp_avg": torch.zeros(300, 200)}}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]},
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "misc": [1, 2.5, float("inf"), "text", b"\x00raw", None, True, torch.float16, torch.Size([2, 3])],
        "rng": torch.get_rng_state(),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5),
    }


def _check(out: dict, ref: dict) -> None:
    assert isinstance(out["model"], OrderedDict)
    for k in ("w", "b", "h"):
        assert torch.equal(out["model"][k], ref["model"][k]) and out["model"][k].dtype == ref["model"][k].dtype
    assert out["tied"] is out["model"]["w"]
    assert out["optim"]["param_groups"] == ref["optim"]["param_groups"]
    assert 0 in out["optim"]["state"]
    assert isinstance(out["np"], np.ndarray) and (out["np"] == ref["np"]).all()
    assert out["misc"] == ref["misc"]
    assert torch.equal(out["rng"], ref["rng"]) and out["empty"].shape == (0, 5) and out["scalar"].item() == 3.5


@pytest.fixture
def sdir(tmp_path) -> str:
    return str(tmp_path / "staging")


def test_roundtrip_remote_and_local(cluster, testdir, sdir):
    ref = _state()
    url = f"stripefs:/{testdir}/step-000010"
    h = staging.save(ref, url, staging_dir=sdir, cluster=cluster.file, background_mover=False)
    assert h.snapshotted
    assert h.wait(60) and h.locally_durable and h.globally_durable and h.done() and h.error is None
    assert {"snapshot", "serialize", "local_write", "upload"} <= set(h.timings) and h.gbps["snapshot"] > 0
    _check(staging.load(url, cluster=cluster.file, staging_dir=sdir), ref)             # local copy
    _check(staging.load(url, cluster=cluster.file, prefer_local=False), ref)           # remote
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file) == url
    man = staging.read_manifest(url, cluster=cluster.file)
    assert man["step"] == 10 and all(f["name"].endswith(".bin") for f in man["files"])


def test_release_buffers_gives_the_snapshot_memory_back(cluster, testdir, sdir):
    from stripefs.staging._snapshot import POOL

    staging.release_buffers()  # whatever earlier tests left pooled
    ref = {"w": torch.randn(16 << 20 >> 2)}  # 16 MiB
    url = f"stripefs:/{testdir}/step-000001"
    assert staging.save(ref, url, staging_dir=sdir, cluster=cluster.file, background_mover=False).wait(60)
    pooled = [weakref.ref(b) for b in POOL._free]
    assert pooled
    assert staging.release_buffers() >= 16 << 20
    # Nothing of ours holds the buffers any more (the save's thread, which gave its buffer
    # back before it finished, lets go of it too): each is unmapped as it goes.
    deadline = time.monotonic() + 30
    while any(r() is not None for r in pooled):
        assert time.monotonic() < deadline, "a released snapshot buffer is still referenced"
        gc.collect()
        time.sleep(0.05)
    assert staging.release_buffers() == 0
    url2 = f"stripefs:/{testdir}/step-000002"  # the next save makes a buffer again
    assert staging.save(ref, url2, staging_dir=sdir, cluster=cluster.file, background_mover=False).wait(60)
    assert torch.equal(staging.load(url2, cluster=cluster.file, prefer_local=False)["w"], ref["w"])


def test_a_buffer_reserved_across_release_buffers_is_not_pooled(monkeypatch):
    """A save that overlaps an earlier one reserves a second buffer on a thread of its own; a
    release made while that buffer is being faulted in must not find it pooled afterwards."""
    from stripefs.staging import _snapshot

    pool = _snapshot.BufferPool()
    making, go = threading.Event(), threading.Event()
    made = _snapshot.HostBuffer

    def slow_buffer(size):
        making.set()
        assert go.wait(30)
        return made(size)

    monkeypatch.setattr(_snapshot, "HostBuffer", slow_buffer)
    result = []
    t = threading.Thread(target=lambda: result.append(pool.reserve(1 << 20)))
    t.start()
    assert making.wait(30)
    assert pool.clear() == 0  # nothing pooled yet
    go.set()
    t.join(30)
    assert result == [False] and pool._free == [] and pool._count == 0 and pool._bytes == 0
    assert pool.reserve(1 << 20) and len(pool._free) == 1  # a reserve after the release pools
    assert pool.clear() == _snapshot.buffer_size(1 << 20)


def test_snapshot_is_isolated_from_later_updates(cluster, testdir, sdir):
    t = torch.zeros(1000)
    h = staging.save({"t": t}, f"{testdir}/s-1", staging_dir=sdir, cluster=cluster.file, background_mover=False)
    t.add_(1)  # training continues right after the blocking part
    h.wait(60)
    assert staging.load(f"{testdir}/s-1", cluster=cluster.file, prefer_local=False)["t"].sum() == 0


def test_zstd_roundtrip_and_several_shards(cluster, testdir, sdir):
    ref = {"a": torch.zeros(600_000), "b": torch.randn(300_000), "c": torch.arange(100)}
    url = f"{testdir}/step-1"
    h = staging.save(ref, url, staging_dir=sdir, cluster=cluster.file, compress="zstd", shard_bytes=1 << 20,
                     background_mover=False)
    h.wait(60)
    man = staging.read_manifest(url, cluster=cluster.file)
    assert len(man["files"]) >= 3 and man["files"][0]["encoding"] == "zstd"
    assert man["files"][0]["size"] < man["files"][0]["raw_size"]
    out = staging.load(url, cluster=cluster.file, prefer_local=False)
    assert all(torch.equal(out[k], ref[k]) for k in ref)


def test_load_fails_closed_on_corrupt_remote_bytes(cluster, client, testdir, sdir):
    url = f"{testdir}/step-1"
    staging.save({"w": torch.ones(100_000)}, url, staging_dir=sdir, cluster=cluster.file,
                 background_mover=False).wait(60)
    with client.open(f"{testdir}/step-1/data-00000.bin", "r+b") as f:
        f.pwrite(b"\xff" * 16, 4096)
    with pytest.raises(ChecksumError) as ei:
        staging.load(url, cluster=cluster.file, prefer_local=False)
    assert ei.value.errno == errno.EIO
    # the staged local copy is intact and preferred
    assert staging.load(url, cluster=cluster.file, staging_dir=sdir)["w"].sum() == 100_000


def test_non_json_values_never_unpickled_unrestricted(cluster, testdir, sdir):
    # save() refuses what the restricted unpickler would refuse at load (issue 19) ...
    with pytest.raises(TypeError, match="obj"):
        staging.save({"obj": Opaque(3)}, f"{testdir}/step-1", staging_dir=sdir, cluster=cluster.file,
                     background_mover=False)
    # ... and a manifest that carries such a value anyway is still never unpickled unrestricted.
    import base64
    import io

    from stripefs.staging._format import decode_tree

    raw = io.BytesIO()
    torch.save(Opaque(3), raw)
    with pytest.raises(pickle.UnpicklingError):
        decode_tree({"d": [["obj", {"p": base64.b64encode(raw.getvalue()).decode()}]]}, [])


def test_two_trainers_same_step(cluster, testdir, tmp_path):
    url = f"{testdir}/step-5"
    a = staging.save({"x": torch.zeros(10)}, url, staging_dir=str(tmp_path / "a"), cluster=cluster.file,
                     background_mover=False)
    a.wait(60)
    b = staging.save({"x": torch.ones(10)}, url, staging_dir=str(tmp_path / "b"), cluster=cluster.file,
                     background_mover=False)
    with pytest.raises(CheckpointConflict):
        b.wait(60)
    assert b.locally_durable and not b.globally_durable
    assert staging.load(url, cluster=cluster.file, prefer_local=False)["x"].sum() == 0
    assert [n for n in cluster.client().listdir(testdir)] == ["step-5"]  # no partial left behind


def test_unobserved_error_surfaces_at_next_save(cluster, testdir, tmp_path):
    url = f"{testdir}/step-5"
    staging.save({"x": torch.zeros(1)}, url, staging_dir=str(tmp_path / "a"), cluster=cluster.file,
                 background_mover=False).wait(60)
    b = staging.save({"x": torch.ones(1)}, url, staging_dir=str(tmp_path / "b"), cluster=cluster.file,
                     background_mover=False)
    while not b.done():
        time.sleep(0.01)
    with pytest.raises(CheckpointConflict):
        staging.save({"x": torch.ones(1)}, f"{testdir}/step-6", staging_dir=str(tmp_path / "b"), cluster=cluster.file)


def test_corrupted_staged_file_is_never_committed(cluster, testdir, sdir):
    url = f"{testdir}/step-1"
    h = staging.save({"w": torch.randn(50_000)}, url, staging_dir=sdir, cluster=cluster.file, upload=False,
                     background_mover=False)
    assert h.wait(60, durable="local")
    h._done.wait(60)
    path = os.path.join(sdir, "steps", h.id, "data-00000.bin")
    with open(path, "r+b") as f:
        f.seek(1000)
        f.write(b"garbage")
    mover = Mover(sdir, MoverOptions(cluster=cluster.file))
    assert mover.run_once() == {h.id: "failed"}
    assert "ChecksumError" in (mover.journal.get(h.id).error or "")
    assert cluster.client().listdir(testdir) == []
    assert not os.path.exists(os.path.join(sdir, "steps", h.id))  # its corrupt local copy went with it
    # The row stays, with its error; later passes report it as cleaned up, not as a new
    # failure, so a standalone mover's exit status is about its own pass.
    assert mover.run_once() == {h.id: "cleaned"}
    assert "ChecksumError" in (mover.journal.get(h.id).error or "")
    from stripefs.staging import mover_cli

    assert mover_cli.main(["mover", "--staging", sdir, "--cluster", cluster.file, "--once", "-q"]) == 0


def test_retention_keeps_last_k_local_n_remote_and_pins(cluster, testdir, sdir):
    ids = []
    for step in range(1, 5):
        h = staging.save({"s": torch.full((10,), step)}, f"{testdir}/step-{step}", staging_dir=sdir,
                         cluster=cluster.file, keep_local=1, keep_remote=2, pin=(step == 1), background_mover=False)
        h.wait(60)
        ids.append(h.id)
    assert sorted(cluster.client().listdir(testdir)) == ["step-1", "step-3", "step-4"]
    local = set(os.listdir(os.path.join(sdir, "steps")))
    assert ids[3] in local and ids[2] not in local and ids[1] not in local


def test_bad_input(cluster, sdir):
    with pytest.raises(ValueError):
        staging.save({}, "/x/step-1", staging_dir=sdir, cluster=cluster.file, compress="lz4")
    with pytest.raises(OSError) as ei:
        staging.save({}, "stripefs://", staging_dir=sdir, cluster=cluster.file)
    assert ei.value.errno == errno.EINVAL
    with pytest.raises(FileNotFoundError):
        staging.load("stripefs://no/such/step", cluster=cluster.file)
    assert staging.latest("stripefs://no/such", cluster=cluster.file) is None


def test_store_unreachable_then_mover_resumes(make_cluster, sdir, monkeypatch):
    monkeypatch.setenv("STRIPEFS_RETRY_FOR", "3")  # clients wait this long for a chain to be served again
    c = make_cluster(servers=2)
    url = "stripefs://ck/step-1"
    c.client().makedirs("/ck")
    for s in c.data["servers"]:  # every storage server gone: the data path is unreachable
        os.kill(s["pid"], signal.SIGKILL)
    opts = MoverOptions(cluster=c.file, retries=0)  # each attempt already waits out the core's retry budget
    h = staging.save({"w": torch.randn(20_000)}, url, staging_dir=sdir, cluster=c.file, options=opts,
                     background_mover=False)
    with pytest.raises(OSError):
        h.wait(120)
    assert h.locally_durable and not h.globally_durable
    c.up()  # restarts the dead servers (new ports) under the same metadata
    assert Mover(sdir, MoverOptions(cluster=c.file)).run_once() == {h.id: "committed"}
    assert staging.load(url, cluster=c.file, prefer_local=False)["w"].shape == (20_000,)


def test_full_local_disk(cluster, testdir, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        h = staging.save({"w": torch.randn(1 << 20)}, f"{testdir}/step-1", staging_dir=str(small), cluster=cluster.file,
                         background_mover=False)
        with pytest.raises(OSError) as ei:
            h.wait(60)
        assert ei.value.errno == errno.ENOSPC
        assert not h.locally_durable and cluster.client().listdir(testdir) == []
        assert not [n for n in os.listdir(small / "steps")]
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_exports():
    assert {"save", "load", "latest", "SaveHandle", "StagedStorageWriter", "StagedStorageReader"} <= set(staging.__all__)
    assert staging.StagedStorageWriter.__name__ == "StagedStorageWriter"
