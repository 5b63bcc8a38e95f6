"""Issue 31, save blocking: a save made while the previous one is still being written and
uploaded waits for neither (double buffering), and the snapshot buffer is back as soon as the
local copy is durable, whatever the upload's bandwidth cap.

Behaviour only, no timing: the previous save's local write and its upload are held back by
events (``write_local_dir`` and the upload's pace, ``_Throttle.account``), so "still being
written" and "still uploading" are facts when the next ``save`` returns, not races.
"""

from __future__ import annotations

import threading

import pytest
import torch

from stripefs import staging
from stripefs.staging import MoverOptions
from stripefs.staging import _mover, _save
from stripefs.staging._snapshot import POOL

WAIT = 60.0  # generous bound for a gate opened by the test: a hang fails instead of blocking the run
SNAP = 20.0  # snapshot_timeout where a save must not wait for a held gate (it used to: TimeoutError)


@pytest.fixture
def sdir(tmp_path) -> str:
    return str(tmp_path / "staging")


@pytest.fixture
def gates(monkeypatch):
    """``local``: every local write waits for it; ``upload``: every upload stops after its first
    piece until it is set. Both are opened at teardown, whatever the test did."""
    local, upload = threading.Event(), threading.Event()
    write, account = _save.write_local_dir, _mover._Throttle.account

    def held_write(*args, **kw):
        assert local.wait(WAIT), "the test never opened the local-write gate"
        return write(*args, **kw)

    def held_account(self, n):
        assert upload.wait(WAIT), "the test never opened the upload gate"
        return account(self, n)

    monkeypatch.setattr(_save, "write_local_dir", held_write)
    monkeypatch.setattr(_mover._Throttle, "account", held_account)
    POOL.clear()
    yield local, upload
    local.set()
    upload.set()
    POOL.clear()


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 12 MiB in one data file: three 4 MiB upload pieces, two in flight at once.
    return {"w": torch.randn(3 << 20, generator=g), "b": torch.randn(1000, generator=g), "step": seed}


def _copy(state):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _equal(got, want) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def test_save_during_previous_write_and_upload_waits_for_neither(cluster, testdir, sdir, gates):
    local, upload = gates
    opts = MoverOptions(cluster=cluster.file, piece=4 << 20, verify=False)

    def save(state, step, **kw):
        return staging.save(state, f"stripefs:/{testdir}/step-{step}", staging_dir=sdir, cluster=cluster.file,
                            options=opts, background_mover=False, keep_local=2, **kw)

    s1, s2, s3 = _state(1), _state(2), _state(3)
    want = [_copy(s1), _copy(s2), _copy(s3)]
    h1 = save(s1, 1)
    h2 = save(s2, 2, snapshot_timeout=SNAP)
    # Save 2 returned while save 1 had written nothing locally and uploaded at most one piece:
    # it copied into the second buffer of double buffering (no buffer beyond the two).
    assert not h1.locally_durable and not h1.globally_durable and not h1.done()
    assert not h2.extra_buffer
    s1["w"].zero_()  # the caller owns its tensors again: the snapshots hold the saved bytes
    s2["w"].zero_()

    # Two saves hold both buffers (neither local copy written): a third waits, here for at most
    # snapshot_timeout, and saves nothing — the documented bound of double buffering.
    with pytest.raises(TimeoutError):
        save(s3, 3, snapshot_timeout=0.2)

    local.set()
    assert h1.wait(WAIT, durable="local") and h2.wait(WAIT, durable="local")
    # Locally durable, still uploading: their buffers come back (once the pieces in flight are
    # acknowledged, not when the parked uploads go on), and the next save takes one.
    assert not h1.globally_durable and not h2.globally_durable
    h3 = save(s3, 3, snapshot_timeout=SNAP)
    assert not h3.extra_buffer and not h1.globally_durable and not h2.globally_durable

    upload.set()
    for h in (h1, h2, h3):
        assert h.wait(WAIT)
    for step, w in enumerate(want, 1):
        _equal(staging.load(f"stripefs:/{testdir}/step-{step}", cluster=cluster.file, prefer_local=False), w)


def test_one_buffer_comes_back_at_local_durability_despite_the_pace(cluster, testdir, sdir, gates):
    """``snapshot_memory=0`` keeps one buffer: the next save waits for the previous one's local
    write, but never for its upload — not even for the pause the bandwidth cap puts between two
    pieces (here the upload gate) while a piece already acknowledged is still counted as in
    flight."""
    local, upload = gates
    local.set()
    opts = MoverOptions(cluster=cluster.file, piece=4 << 20, verify=False)
    s1, s2 = _state(4), _state(5)
    want = [_copy(s1), _copy(s2)]
    h1 = staging.save(s1, f"stripefs:/{testdir}/step-1", staging_dir=sdir, cluster=cluster.file, options=opts,
                      background_mover=False, snapshot_memory=0)
    assert h1.wait(WAIT, durable="local")
    assert not h1.globally_durable  # its upload is parked at the pace after its first piece
    h2 = staging.save(s2, f"stripefs:/{testdir}/step-2", staging_dir=sdir, cluster=cluster.file, options=opts,
                      background_mover=False, snapshot_memory=0, snapshot_timeout=SNAP)
    assert not h1.globally_durable and not h2.extra_buffer
    upload.set()
    assert h1.wait(WAIT) and h2.wait(WAIT)
    for step, w in enumerate(want, 1):
        _equal(staging.load(f"stripefs:/{testdir}/step-{step}", cluster=cluster.file, prefer_local=False), w)
