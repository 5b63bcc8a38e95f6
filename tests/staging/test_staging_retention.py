"""Retention keeps the newest steps by step number and deletes only what its rows recorded;
a save whose lock file cannot be made fails its handle instead of hanging.

The model test drives random saves (some committed late, by the mover), rollbacks (steps
deleted by hand, then saved again) and keep windows against a model of which checkpoint
must be at each step's URL, and compares the store with it after every operation.
"""

from __future__ import annotations

import os
import random
import subprocess

import pytest
import torch

from stripefs import staging
from stripefs.staging._mover import remove_tree


def _state(tag: int) -> dict:
    return {"w": torch.full((64,), float(tag)), "tag": tag}


def _save(cluster, sdir: str, url: str, tag: int, keep_remote: int | None, upload: bool = True) -> staging.SaveHandle:
    h = staging.save(_state(tag), url, staging_dir=sdir, cluster=cluster.file, keep_remote=keep_remote,
                     keep_local=1, upload=upload, background_mover=False)
    h.wait(60, durable="global" if upload else "local")
    return h


def _tag_at(cluster, url: str) -> int:
    return staging.load(url, cluster=cluster.file)["tag"]


def test_a_step_saved_again_after_a_rollback_is_not_deleted_by_its_old_row(cluster, client, testdir, tmp_path):
    sdir, url = str(tmp_path / "s"), f"stripefs:/{testdir}/step-000001"
    _save(cluster, sdir, url, tag=1, keep_remote=1)
    remove_tree(client, f"{testdir}/step-000001")  # rollback: the step is deleted by hand
    _save(cluster, sdir, url, tag=2, keep_remote=1)  # and saved again by the resumed run
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file) == url
    assert _tag_at(cluster, url) == 2


def test_rows_of_rolled_back_steps_take_no_keep_slot(cluster, client, testdir, tmp_path):
    sdir = str(tmp_path / "s")
    url = lambda step: f"stripefs:/{testdir}/step-{step:06d}"  # noqa: E731
    for step in (1, 2, 3):
        _save(cluster, sdir, url(step), tag=step, keep_remote=3)
    for step in (2, 3):
        remove_tree(client, f"{testdir}/step-{step:06d}")
    for step in (2, 3, 4):
        _save(cluster, sdir, url(step), tag=10 + step, keep_remote=3)
    assert sorted(client.listdir(testdir)) == ["step-000002", "step-000003", "step-000004"]
    assert [_tag_at(cluster, url(s)) for s in (2, 3, 4)] == [12, 13, 14]


def test_an_older_step_committed_last_does_not_push_out_a_newer_one(cluster, client, testdir, tmp_path):
    sdir = str(tmp_path / "s")
    slow = f"stripefs:/{testdir}/step-000100"
    _save(cluster, sdir, slow, tag=100, keep_remote=1, upload=False)  # staged; its upload comes later
    newer = f"stripefs:/{testdir}/step-000200"
    _save(cluster, sdir, newer, tag=200, keep_remote=1)
    assert staging.Mover(sdir, staging.MoverOptions(cluster=cluster.file)).run_once()  # step 100 commits now
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file) == newer
    assert client.listdir(testdir) == ["step-000200"]


@pytest.fixture
def tiny_fs(tmp_path):
    """A tmpfs with 64 inodes (root only): files run out long before bytes do."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=64", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_save_whose_lock_file_cannot_be_made_fails_instead_of_hanging(cluster, testdir, tiny_fs):
    sdir = str(tiny_fs / "s")
    keep = staging.Mover(sdir)  # the staging directory and its journal exist (open: its -wal and -shm stay)
    fill = []
    try:
        while True:  # take every inode left: the save's lock file cannot be created
            fill.append(tiny_fs / f"fill-{len(fill)}")
            fill[-1].touch()
    except OSError:
        fill.pop()
    h = staging.save(_state(1), f"stripefs:/{testdir}/step-1", staging_dir=sdir, cluster=cluster.file,
                     background_mover=False, snapshot_timeout=5)
    with pytest.raises(OSError):
        h.wait(30)
    for f in fill:
        f.unlink()
    # The failed save gave its snapshot buffer back: the next one does not wait for it.
    h = staging.save(_state(2), f"stripefs:/{testdir}/step-2", staging_dir=sdir, cluster=cluster.file,
                     background_mover=False, snapshot_timeout=5)
    assert h.wait(60)
    assert keep.journal.get(h.id) is not None


def test_lock_files_go_with_their_rows(cluster, testdir, tmp_path):
    sdir = str(tmp_path / "s")
    for step in range(1, 5):
        _save(cluster, sdir, f"stripefs:/{testdir}/step-{step}", tag=step, keep_remote=1)
    rows = staging.Mover(sdir).journal.checkpoints()
    assert len(rows) == 1
    assert os.listdir(os.path.join(sdir, "locks")) == [f"{rows[0].id}.lock"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_retention_matches_a_model_of_which_steps_survive(cluster, client, testdir, tmp_path, seed):
    rng = random.Random(seed)
    sdir = str(tmp_path / "s")
    mover = staging.Mover(sdir, staging.MoverOptions(cluster=cluster.file))
    model: dict[int, int] = {}  # step -> tag of the checkpoint that must be at its URL
    staged: list[tuple[int, int, int]] = []  # (step, tag, keep) saved locally, committed by a later mover pass
    url = lambda step: f"stripefs:/{testdir}/step-{step:06d}"  # noqa: E731
    tag = 0

    def committed(step: int, t: int, keep: int) -> None:
        model[step] = t
        for old in sorted(model, reverse=True)[max(1, keep):]:
            del model[old]

    for _ in range(24):
        op = rng.random()
        keep = rng.choice([1, 2, 3])
        taken = set(model) | {s for s, _, _ in staged}
        free = [s for s in range(1, 9) if s not in taken]
        if op < 0.55 and free:
            step, tag = rng.choice(free), tag + 1
            _save(cluster, sdir, url(step), tag, keep)
            committed(step, tag, keep)
        elif op < 0.7 and free:
            step, tag = rng.choice(free), tag + 1
            _save(cluster, sdir, url(step), tag, keep, upload=False)
            staged.append((step, tag, keep))
        elif op < 0.85 and staged:
            mover.run_once()  # commits in journal order: oldest save first
            for step, t, k in sorted(staged, key=lambda x: x[1]):
                committed(step, t, k)
            staged.clear()
        elif model:
            cut = rng.choice(sorted(model))  # rollback: steps above `cut` deleted by hand
            for step in [s for s in model if s > cut]:
                remove_tree(client, f"{testdir}/step-{step:06d}")
                del model[step]
        present = sorted(int(n.split("-")[1]) for n in client.listdir(testdir) if n.startswith("step-"))
        assert present == sorted(model), (present, model)
        for step, t in model.items():
            assert _tag_at(cluster, url(step)) == t
        newest = staging.latest(f"stripefs:/{testdir}", cluster=cluster.file)
        assert newest == (url(max(model)) if model else None)


def test_a_resumed_run_saves_again_the_step_its_dead_predecessor_left_staged(cluster, client, testdir, tmp_path):
    """The dead run's step 200 is staged (its writer gone before the upload); the resumed run,
    from the same staging directory, saves step 200 again: its save succeeds, the mover never
    commits the leftover over it, and step 200 holds the resumed run's state."""
    sdir, url = str(tmp_path / "s"), f"stripefs:/{testdir}/step-000200"
    _save(cluster, sdir, url, tag=1, keep_remote=None, upload=False)  # the dead run's leftover
    h = _save(cluster, sdir, url, tag=2, keep_remote=None)  # the resumed run
    assert h.globally_durable
    assert staging.Mover(sdir, staging.MoverOptions(cluster=cluster.file)).run_once() == {}
    assert _tag_at(cluster, url) == 2
    assert client.listdir(testdir) == ["step-000200"]
    states = sorted(r.state for r in staging.Mover(sdir).journal.checkpoints())
    assert states == ["abandoned", "committed"]


def test_a_resumed_run_replaces_the_step_a_mover_committed_for_its_dead_predecessor(cluster, client, testdir,
                                                                                    tmp_path):
    """As above, but the background mover committed the leftover before the resumed run got
    to step 200 again: the resumed run's save replaces it in one step (rename exchange)."""
    sdir, url = str(tmp_path / "s"), f"stripefs:/{testdir}/step-000200"
    _save(cluster, sdir, url, tag=1, keep_remote=None, upload=False)
    assert list(staging.Mover(sdir, staging.MoverOptions(cluster=cluster.file)).run_once().values()) == ["committed"]
    assert _tag_at(cluster, url) == 1
    h = _save(cluster, sdir, url, tag=2, keep_remote=None)
    assert h.globally_durable
    assert _tag_at(cluster, url) == 2
    assert client.listdir(testdir) == ["step-000200"]  # the replaced checkpoint went
    rows = staging.Mover(sdir).journal.checkpoints()
    assert [(r.id, r.state) for r in rows] == [(h.id, "committed")]


def test_another_staging_directory_still_conflicts(cluster, testdir, tmp_path):
    url = f"stripefs:/{testdir}/step-000200"
    _save(cluster, str(tmp_path / "a"), url, tag=1, keep_remote=None)
    with pytest.raises(staging.CheckpointConflict):
        _save(cluster, str(tmp_path / "b"), url, tag=2, keep_remote=None)
    assert _tag_at(cluster, url) == 1


@pytest.mark.parametrize("url", ["s3://bucket/x/step-1", "file:///tmp/x/step-1", "stripefs:/ckpt/step-1", None])
def test_a_url_of_another_scheme_is_refused_before_anything_is_written(cluster, client, tmp_path, url):
    with pytest.raises(ValueError, match="stripefs"):
        staging.save(_state(1), url, staging_dir=str(tmp_path / "s"), cluster=cluster.file, background_mover=False)
    assert not any(n.startswith(("s3:", "file:", "stripefs:")) for n in client.listdir("/"))


def test_load_of_no_checkpoint_or_a_dcp_step_says_what_to_do(cluster, testdir, tmp_path):
    with pytest.raises(FileNotFoundError, match="latest"):
        staging.load(staging.latest(f"stripefs:/{testdir}/nothing-yet", cluster=cluster.file), cluster=cluster.file)
    import torch.distributed.checkpoint as dcp

    url = f"stripefs:/{testdir}/dcp-1"
    dcp.save({"w": torch.ones(3)}, storage_writer=staging.StagedStorageWriter(url, staging_dir=str(tmp_path / "s"),
                                                                             cluster=cluster.file))
    with pytest.raises(ValueError, match="DCP"):
        staging.load(url, cluster=cluster.file)
