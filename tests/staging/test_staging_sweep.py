"""kill -9 of the mover, and of a saving trainer, at every fault point (its first and last hit
here; every hit count in ``python -m stripefs.bench.ckpt_sweep``).

The sweep machinery lives in ``staging._sweep`` (shared with ``python -m stripefs.bench.ckpt_sweep``,
which runs it larger): a traced, uninterrupted run of a checkpoint of three data files of three
pieces (plus one small file) lists every fault point passed; each (point, hit count) is then
killed in turn, resumed with ``stripefs mover --once``, and checked — ``latest()`` names only
a step that loads from the store and equals what was saved, before and after the resume, and
no partial directory is left.
"""

from __future__ import annotations

import pytest

from stripefs.staging._sweep import sweep_mover, sweep_trainer


def test_mover_killed_at_every_fault_point(cluster, client, testdir, tmp_path):
    count, seconds = sweep_mover(cluster.file, client, testdir, str(tmp_path), short=True)
    assert count >= 2 * 2 + 2  # the first and last piece, sent and journaled; before and after the rename
    print(f"\nmover kill sweep: {count} kill points in {seconds:.1f}s")


@pytest.mark.parametrize("keep_local", [1, 0])
def test_trainer_killed_at_every_fault_point(cluster, client, testdir, tmp_path, keep_local):
    count, seconds = sweep_trainer(cluster.file, client, testdir, str(tmp_path), keep_local=keep_local, short=True)
    assert count >= 2 * 2 + 3
    print(f"\ntrainer kill sweep (keep_local={keep_local}): {count} kill points in {seconds:.1f}s")
