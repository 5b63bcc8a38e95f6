"""torch DCP through staging: dcp.save / dcp.async_save / dcp.load in one process (no process group)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from stripefs import staging
from stripefs.staging import ChecksumError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# "w" (9 MiB) spans checksum chunks (4 MiB) from an offset that is not a chunk boundary: the
# reader's reads cross chunks inside a tensor.
def _sd(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1536, 1536, generator=g), "b": torch.arange(7), "n": {"v": torch.ones(3) * seed}}


def _zeros() -> dict:
    return {"w": torch.zeros(1536, 1536), "b": torch.zeros(7, dtype=torch.int64), "n": {"v": torch.zeros(3)}}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and torch.equal(a["n"]["v"], b["n"]["v"])


def test_dcp_save_and_load(cluster, testdir, tmp_path):
    sdir = str(tmp_path / "s")
    url = f"stripefs:/{testdir}/step-1"
    w = staging.StagedStorageWriter(url, staging_dir=sdir, cluster=cluster.file)
    dcp.save(_sd(1), storage_writer=w)
    man = staging.read_manifest(url, cluster=cluster.file)
    assert man["kind"] == "dcp" and ".metadata" in {f["name"] for f in man["files"]}
    out = _zeros()
    dcp.load(out, storage_reader=staging.StagedStorageReader(url, staging_dir=str(tmp_path / "fresh"), cluster=cluster.file))
    assert _same(out, _sd(1))
    out = _zeros()  # from the local staged copy
    dcp.load(out, storage_reader=staging.StagedStorageReader(url, staging_dir=sdir, cluster=cluster.file))
    assert _same(out, _sd(1))


def test_dcp_async_save_reuses_writer(cluster, testdir, tmp_path):
    sdir = str(tmp_path / "s")
    w = staging.StagedStorageWriter(staging_dir=sdir, cluster=cluster.file)
    for step in (1, 2):
        fut = dcp.async_save(_sd(step), checkpoint_id=f"stripefs:/{testdir}/step-{step}", storage_writer=w)
        fut.result(60)
    assert sorted(cluster.client().listdir(testdir)) == ["step-1", "step-2"]
    out = _zeros()
    dcp.load(out, checkpoint_id=f"stripefs:/{testdir}/step-2",
             storage_reader=staging.StagedStorageReader(f"stripefs:/{testdir}/step-2", staging_dir=str(tmp_path / "f"),
                                                        cluster=cluster.file))
    assert _same(out, _sd(2))


def _flip_store(client, path: str, at: int) -> None:
    with client.open(path, "r+b") as f:
        b = f.pread(1, at)
        f.pwrite(bytes([b[0] ^ 0x20]), at)


def test_dcp_reader_fails_closed(cluster, client, testdir, tmp_path):
    """A damaged byte in the store fails the load (the chunk holding it is checked before any
    of its bytes reach torch); a file of another size fails the reader at once."""
    url = f"stripefs:/{testdir}/step-1"
    dcp.save(_sd(1), storage_writer=staging.StagedStorageWriter(url, staging_dir=str(tmp_path / "s"), cluster=cluster.file))
    name = next(n for n in client.listdir(f"{testdir}/step-1") if n.endswith(".distcp"))
    _flip_store(client, f"{testdir}/step-1/{name}", 100)
    reader = staging.StagedStorageReader(url, staging_dir=str(tmp_path / "other"), cluster=cluster.file)
    out = _zeros()
    with pytest.raises((ChecksumError, CheckpointException)) as err:  # torch wraps a rank's error
        dcp.load(out, storage_reader=reader)
    failed = [e for e, _ in err.value.failures.values()] if isinstance(err.value, CheckpointException) else [err.value]
    assert failed and all(isinstance(e, ChecksumError) and "CRC32C" in str(e) for e in failed), failed
    assert not torch.equal(out["w"], _sd(1)["w"])  # nothing of the damaged chunk was loaded
    with client.open(f"{testdir}/step-1/{name}", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    with pytest.raises(ChecksumError, match=name):
        staging.StagedStorageReader(url, staging_dir=str(tmp_path / "other"), cluster=cluster.file)


def test_a_bad_chunk_of_the_local_copy_is_read_from_the_store(cluster, testdir, tmp_path, caplog):
    sdir = str(tmp_path / "s")
    url = f"stripefs:/{testdir}/step-1"
    dcp.save(_sd(1), storage_writer=staging.StagedStorageWriter(url, staging_dir=sdir, cluster=cluster.file))
    man = staging.read_manifest(url, cluster=cluster.file)
    local = staging.Mover(sdir).journal.step_dir(man["id"])
    name = next(f["name"] for f in man["files"] if f["name"].endswith(".distcp"))
    with open(os.path.join(local, name), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x20]))
    out = _zeros()
    with caplog.at_level("WARNING", logger="stripefs.staging"):
        dcp.load(out, storage_reader=staging.StagedStorageReader(url, staging_dir=sdir, cluster=cluster.file))
    assert _same(out, _sd(1))
    assert any("reading it from the store" in r.getMessage() for r in caplog.records)
    assert not os.path.exists(os.path.join(sdir, "cache"))  # nothing downloaded to local disk


def test_dcp_save_says_how_many_replicas_it_had(cluster, testdir, tmp_path):
    """As ``SaveHandle.durability``: the writer, the journal and the manifest record the replicas
    the store had serving at the commit (a degraded one: ``test_staging_durable``)."""
    from stripefs.staging._replicas import Durability

    sdir = str(tmp_path / "s")
    url = f"stripefs:/{testdir}/step-1"
    w = staging.StagedStorageWriter(url, staging_dir=sdir, cluster=cluster.file)
    assert w.durability is None
    dcp.save(_sd(1), storage_writer=w)
    assert w.durability is not None and w.durability.full, w.durability
    man = staging.read_manifest(url, cluster=cluster.file)
    assert Durability.from_record(man["durability"]) == w.durability
    assert Durability.from_record(staging.Mover(sdir).journal.get(man["id"]).durability) == w.durability


def _odd_state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "bf16": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "column": torch.arange(12, dtype=torch.int32).reshape(12, 1),
        "t": torch.randn(64, 48, generator=g).t(),  # saved as is: strides (1, 64)
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: spans checksum chunks
    }


def test_dcp_tensors_are_read_straight_into_their_targets(cluster, testdir, tmp_path, monkeypatch):
    """A tensor loaded whole into a contiguous CPU target of its dtype is read into the target
    (no torch.load of it); a target of another dtype or layout is filled as torch's reader would."""
    url = f"stripefs:/{testdir}/step-1"
    saved = _odd_state()
    dcp.save(saved, storage_writer=staging.StagedStorageWriter(url, staging_dir=str(tmp_path / "s"), cluster=cluster.file))
    loads: list = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or real_load(*a, **k))

    def load(out: dict) -> dict:
        dcp.load(out, storage_reader=staging.StagedStorageReader(url, staging_dir=str(tmp_path / "fresh"),
                                                                 cluster=cluster.file))
        return out

    same_kind = {k: torch.full_like(v.contiguous(), 7) for k, v in saved.items()}
    kept = {k: v.data_ptr() for k, v in same_kind.items()}
    out = load(same_kind)
    for k, v in saved.items():
        assert torch.equal(out[k], v) and out[k].data_ptr() == kept[k], k
    # The transposed tensor was saved with its strides: torch's path; every other one in place.
    assert len(loads) == 1

    loads.clear()
    other = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in saved.items()}
    other["t"] = torch.zeros(64, 48, dtype=torch.float64).t()  # a non-contiguous target
    out = load(other)
    for k, v in saved.items():
        assert torch.equal(out[k], v.to(out[k].dtype)), k
    assert len(loads) == len(saved) - 2  # "scalar" is float64 already: in place; "empty" has nothing to read



def test_a_plan_of_tensors_and_objects_opens_each_file_once(cluster, testdir, tmp_path, monkeypatch):
    """Objects (DCP's bytes items) are read from the file the tensors are read from: one
    open per file of the plan, and every value comes back."""
    from stripefs.staging._checked import CheckedFiles

    url = f"stripefs:/{testdir}/step-1"
    saved = {**_sd(3), "step": 17, "meta": {"name": "run", "lr": [0.1, 0.01]}}
    dcp.save(saved, storage_writer=staging.StagedStorageWriter(url, staging_dir=str(tmp_path / "s"), cluster=cluster.file))
    opens: list[str] = []
    real = CheckedFiles.create_stream
    monkeypatch.setattr(CheckedFiles, "create_stream", lambda self, path, mode: opens.append(str(path)) or real(self, path, mode))
    out = {**_zeros(), "step": 0, "meta": {"name": "", "lr": []}}
    dcp.load(out, storage_reader=staging.StagedStorageReader(url, staging_dir=str(tmp_path / "fresh"), cluster=cluster.file))
    assert _same(out, saved) and out["step"] == 17 and out["meta"] == {"name": "run", "lr": [0.1, 0.01]}
    assert opens and len(opens) == len(set(opens)), opens


def test_a_target_of_another_shape_is_refused(cluster, testdir, tmp_path):
    """A planner that resolves a request to a tensor of another shape than stored gets an
    error naming it, not the bytes poured into the wrong shape."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Reshaping(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            t = super().resolve_tensor(read_item)
            return t.view(-1) if read_item.dest_index.fqn == "w" else t

    url = f"stripefs:/{testdir}/step-1"
    dcp.save(_sd(4), storage_writer=staging.StagedStorageWriter(url, staging_dir=str(tmp_path / "s"), cluster=cluster.file))
    with pytest.raises(CheckpointException, match="target's shape"):
        dcp.load(_zeros(), planner=Reshaping(),
                 storage_reader=staging.StagedStorageReader(url, staging_dir=str(tmp_path / "fresh"), cluster=cluster.file))
