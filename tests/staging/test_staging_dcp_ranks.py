"""A DCP save by several ranks is one checkpoint: every rank's shards or nothing.

Real processes (gloo on loopback), each with its own keys, save through
``StagedStorageWriter``; the step must hold every rank's files, load with every rank's
keys, and never commit when a rank fails or dies before its files are in the store.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stripefs import staging

from ._dcp_rank import state

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save(cluster, url: str, sdirs: list[str], tmp_path, env_of=lambda rank: {}, mode: str = "dcp") -> list[dict]:
    """Run one save on ``len(sdirs)`` ranks; each rank's result (``{}`` for a killed rank)."""
    port, world = _free_port(), len(sdirs)
    procs, outs = [], []
    for rank, sdir in enumerate(sdirs):
        out = str(tmp_path / f"rank{rank}.json")
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_dcp_rank.py"), str(rank), str(world), str(port), url, sdir,
             cluster.file, out, mode], env={**os.environ, **env_of(rank)}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE))
    for p in procs:
        p.wait(timeout=120)
    return [json.load(open(o)) if os.path.exists(o) else {} for o in outs]


def _load(cluster, url: str, world: int, tmp_path) -> dict:
    want = {k: torch.zeros_like(v) for rank in range(world) for k, v in state(rank).items()}
    dcp.load(want, storage_reader=staging.StagedStorageReader(url, staging_dir=str(tmp_path / "load"),
                                                              cluster=cluster.file))
    return want


def test_per_rank_saves_agree_on_one_checkpoint_through_torch_distributed(cluster, client, testdir, tmp_path):
    """``staging.save(..., rank=r, world_size=n)`` without a ``save_id``: the ranks agree on
    one by a broadcast from rank 0 over the initialized process group, and the step commits
    once with every rank's keys."""
    url = f"stripefs:/{testdir}/step-000200"
    results = _save(cluster, url, [str(tmp_path / f"s{r}") for r in range(2)], tmp_path, mode="save")
    assert results == [{"ok": True}] * 2
    man = staging.read_manifest(url, cluster=cluster.file)
    assert len(man["ranks"]) == 2 and all(r["files"] for r in man["ranks"])  # one entry per rank, each with files
    loaded = staging.load(url, cluster=cluster.file, prefer_local=False)
    assert sorted(loaded) == sorted(k for rank in range(2) for k in state(rank))
    for rank in range(2):
        for k, v in state(rank).items():
            assert torch.equal(loaded[k], v), k
    assert client.listdir(testdir) == ["step-000200"], "a partial directory left behind"


@pytest.mark.parametrize("world,shared", [(2, False), (2, True)])  # 4 ranks: the bench's sweep
def test_every_rank_shards_are_in_the_one_commit(cluster, client, testdir, tmp_path, world, shared):
    url = f"stripefs:/{testdir}/step-000100"
    sdirs = [str(tmp_path / ("s" if shared else f"s{r}")) for r in range(world)]
    results = _save(cluster, url, sdirs, tmp_path)
    assert results == [{"ok": True}] * world
    man = staging.read_manifest(url, cluster=cluster.file)
    names = {f["name"] for f in man["files"]}
    assert ".metadata" in names
    assert {n.split("_")[2] for n in names if n.endswith(".distcp")} == {str(r) for r in range(world)}
    assert sorted(client.listdir(f"{testdir}/step-000100")) == sorted(names | {"manifest.json"}), "part records left"
    assert client.listdir(testdir) == ["step-000100"], "a partial directory left behind"
    staging.verify(url, cluster=cluster.file)
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file) == url
    loaded = _load(cluster, url, world, tmp_path)
    for rank in range(world):
        for k, v in state(rank).items():
            assert torch.equal(loaded[k], v), k
    for sdir in set(sdirs):  # no rank keeps a row the mover would pick up and commit on its own
        rows = staging.Mover(sdir).journal.checkpoints("WHERE state NOT IN ('committed')")
        assert rows == []


# A sample of the kill sweep (each case starts fresh interpreters: ~15 s on a loaded 2-core
# machine): a rank killed before its part is in the store, and the coordinator after its rename.
# Every rank at every fault point, with 2 or 4 ranks: python -m stripefs.bench.ckpt_sweep --ranks 4.
KILLS = [("rank_uploaded", 1, False), ("after_rename", 0, True)]


@pytest.mark.parametrize("point,victim,committed", KILLS, ids=[f"{p}-rank{v}" for p, v, _ in KILLS])
def test_a_rank_killed_at_any_point_never_leaves_a_step_without_every_rank(cluster, client, testdir, tmp_path,
                                                                           point, victim, committed):
    first = f"stripefs:/{testdir}/step-000100"
    assert _save(cluster, first, [str(tmp_path / "a0"), str(tmp_path / "a1")], tmp_path) == [{"ok": True}] * 2
    url = f"stripefs:/{testdir}/step-000200"
    kill = {"STRIPEFS_STAGING_KILL_AT": point}
    (tmp_path / "second").mkdir()
    results = _save(cluster, url, [str(tmp_path / "b0"), str(tmp_path / "b1")], tmp_path / "second",
                    env_of=lambda rank: kill if rank == victim else {})
    assert results[victim] == {}  # killed there
    survivor = results[1 - victim]
    assert "error" in survivor, survivor  # its dcp.save failed: it never heard of a commit
    assert client.exists(f"{testdir}/step-000200") == committed
    newest = staging.latest(f"stripefs:/{testdir}", cluster=cluster.file)
    assert newest == (url if committed else first)
    loaded = _load(cluster, newest, 2, tmp_path)  # whatever latest() names loads with every rank's keys
    for rank in range(2):
        for k, v in state(rank).items():
            assert torch.equal(loaded[k], v), k
    if committed:
        staging.verify(url, cluster=cluster.file)


def test_a_rank_whose_url_differs_fails_every_rank(cluster, client, testdir, tmp_path):
    port = _free_port()
    outs = [str(tmp_path / f"r{r}.json") for r in range(2)]
    urls = [f"stripefs:/{testdir}/step-1", f"stripefs:/{testdir}/step-2"]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_dcp_rank.py"), str(r), "2", str(port), urls[r],
                               str(tmp_path / f"s{r}"), cluster.file, outs[r]], stdout=subprocess.DEVNULL,
                              stderr=open(str(tmp_path / f"err{r}"), "w")) for r in range(2)]
    for p in procs:
        p.wait(timeout=120)
    results = [json.load(open(o)) if os.path.exists(o) else open(str(tmp_path / f"err{r}")).read()
               for r, o in enumerate(outs)]
    assert all("error" in r for r in results), results
    assert client.listdir(testdir) == [] or all(not n.startswith("step-") for n in client.listdir(testdir))
