"""Every local directory staging renames into place is fsynced before (its entries) and after
(the rename, in its parent): a crash right after "locally durable" must not lose the step."""

from __future__ import annotations

import os

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
