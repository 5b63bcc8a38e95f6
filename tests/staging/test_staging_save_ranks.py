"""``staging.save`` by several ranks is one checkpoint: every rank's keys or nothing.

Each rank calls ``staging.save(sd, url, rank=r, world_size=n, save_id=...)`` with its own keys;
the step commits once, after every rank's files are in the store, with one manifest; if a rank
fails or dies, nothing commits and every rank's ``wait()`` says why. The ranks here are threads
of this process (each save is independent: they meet only in the store) except in the kill
sample, where they are processes killed at a fault point (``staging._sweep_ranks``; the full
sweep over every rank and fault point is ``python -m stripefs.bench.ckpt_sweep --ranks 4``).
"""

from __future__ import annotations

import pytest
import torch

from stripefs import staging
from stripefs.staging._sweep_ranks import sweep_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {f"w{rank}": torch.randn(300 + rank, generator=g), f"b{rank}": torch.arange(rank + 2),
            f"cfg{rank}": {"lr": 0.1 * rank, "name": f"rank-{rank}"}}


def _save_all(states, url, cluster, sdir, save_id, **kw) -> list[staging.SaveHandle]:
    kw.setdefault("rank_timeout", 30.0)
    return [staging.save(sd, url, rank=r, world_size=len(states), save_id=save_id, staging_dir=sdir, cluster=cluster,
                         background_mover=False, snapshot_memory=1 << 30, **kw) for r, sd in enumerate(states)]


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v), k


def test_every_rank_keys_are_in_the_one_commit(cluster, client, testdir, tmp_path):
    url = f"stripefs:/{testdir}/step-000100"
    states = [_state(r) for r in range(3)]
    handles = _save_all(states, url, cluster.file, str(tmp_path / "s"), "job-1/step-100")
    for h in handles:
        assert h.wait(120) and h.globally_durable
    assert len({h.id for h in handles}) == 1  # one checkpoint
    assert all(h.durability is not None and h.durability == handles[0].durability for h in handles)
    man = staging.read_manifest(url, cluster=cluster.file)
    assert man["id"] == handles[0].id and len(man["ranks"]) == 3
    assert {f["name"].split("-")[0] for f in man["files"]} == {"rank00000", "rank00001", "rank00002"}
    assert sorted(client.listdir(f"{testdir}/step-000100")) == sorted({f["name"] for f in man["files"]} |
                                                                      {"manifest.json"}), "part records left"
    assert client.listdir(testdir) == ["step-000100"], "a partial directory left behind"
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file) == url
    merged = {k: v for sd in states for k, v in sd.items()}
    _assert_same(staging.load(url, cluster=cluster.file), merged)
    for r in range(3):
        _assert_same(staging.load(url, cluster=cluster.file, rank=r), states[r])
    with pytest.raises(ValueError, match="no rank 3"):
        staging.load(url, cluster=cluster.file, rank=3)
    # One journal shared by the ranks: only rank 0's committed row stays (retention counts it).
    rows = staging.Mover(str(tmp_path / "s")).journal.checkpoints()
    assert [(r.id, r.state) for r in rows] == [(handles[0].id, "committed")]


def test_two_ranks_saving_one_key_fail_every_rank(cluster, client, testdir, tmp_path):
    url = f"stripefs:/{testdir}/step-1"
    handles = _save_all([{"w": torch.ones(3)}, {"w": torch.zeros(3)}, {"x": torch.ones(2)}], url, cluster.file,
                        str(tmp_path / "s"), "job-2/step-1")
    for h in handles:
        with pytest.raises(staging.CheckpointAborted, match="key 'w' is saved by rank 0 and by rank 1"):
            h.wait(120)
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file) is None
    assert not client.exists(f"{testdir}/step-1")


def test_a_rank_that_cannot_reach_the_store_fails_every_rank(cluster, client, testdir, tmp_path):
    """Rank 1 never gets its files into the store (and cannot even say so there): rank 0 gives
    up after ``rank_timeout`` and every rank's ``wait()`` says which rank and why."""
    url = f"stripefs:/{testdir}/step-1"
    sdir = str(tmp_path / "s")
    opts = staging.MoverOptions(retries=0)
    h0, h2 = (staging.save(_state(r), url, rank=r, world_size=3, save_id="job-3", staging_dir=sdir,
                           cluster=cluster.file, background_mover=False, rank_timeout=2.0, options=opts,
                           snapshot_memory=1 << 30) for r in (0, 2))
    h1 = staging.save(_state(1), url, rank=1, world_size=3, save_id="job-3", staging_dir=sdir,
                      cluster="127.0.0.1:1", background_mover=False, rank_timeout=2.0, options=opts,
                      snapshot_memory=1 << 30)
    with pytest.raises(OSError):
        h1.wait(120)
    for h in (h0, h2):
        with pytest.raises(staging.CheckpointAborted, match=r"rank\(s\) \[1\]"):
            h.wait(120)
    assert not client.exists(f"{testdir}/step-1")
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file) is None
    row = staging.Mover(sdir).journal.get(h0.id)
    assert row.state == "failed" and "[1]" in row.error
    assert staging.Mover(sdir).run_once() == {h0.id: "cleaned"}  # the partial directory goes
    assert client.listdir(testdir) == []


def test_the_arguments_of_a_save_by_several_ranks_are_checked(tmp_path):
    kw = {"staging_dir": str(tmp_path / "s"), "cluster": "127.0.0.1:1", "background_mover": False}
    with pytest.raises(ValueError, match="rank must be in"):
        staging.save({}, "stripefs://x/step-1", rank=2, world_size=2, save_id="a", **kw)
    with pytest.raises(ValueError, match="upload=False"):
        staging.save({}, "stripefs://x/step-1", rank=0, world_size=2, save_id="a", upload=False, **kw)
    with pytest.raises(ValueError, match="world_size"):
        staging.save({}, "stripefs://x/step-1", rank=1, **kw)
    with pytest.raises(TypeError, match="saves a dict"):
        staging.save([torch.ones(1)], "stripefs://x/step-1", rank=0, world_size=2, save_id="a", **kw)
    with pytest.raises(ValueError, match="torch.distributed"):
        staging.save({}, "stripefs://x/step-1", rank=0, world_size=2, **kw)


@pytest.mark.slow
def test_a_rank_killed_never_leaves_a_step_without_every_rank(cluster, client, testdir, tmp_path):
    """A sample of the kill sweep (processes, SIGKILL): rank 1 dies before its part record,
    rank 0 dies before the rename, rank 0 dies after it. The first two leave nothing committed
    and every survivor's save failed; the last commits every rank's keys."""
    kills = [(1, "rank_uploaded", 1), (0, "before_rename", 1), (0, "after_rename", 1)]
    count, _ = sweep_ranks("save", 2, cluster.file, client, testdir, str(tmp_path), only=kills)
    assert count == 3
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file).endswith("/step-000004")
