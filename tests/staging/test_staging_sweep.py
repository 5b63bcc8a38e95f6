"""kill -9 of the mover, and of a saving trainer, at every fault point and every hit count.

An uninterrupted, traced run of a small checkpoint (four files, three of them three pieces
long) lists every fault point the process passes (``STRIPEFS_STAGING_TRACE``); the sweep then
starts a fresh step for each (point, hit count), SIGKILLs the process exactly there, resumes
with ``stripefs mover --once`` and checks what a resuming training job would see: before the
resume and after it, ``staging.latest()`` names only a step that loads from the store
(``prefer_local=False``) and equals what was saved, tensors and plain values alike; after the
resume no partial directory is left and the step is the latest one — unless the trainer died
before its copy was locally durable, when the mover abandons it and the previous step stays
the latest.

Uploads run one file at a time so that the n-th hit of a point is the same piece in every run
(with two files in flight the interleaving, and so the piece, would vary).
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import torch

import staging
from staging._journal import Journal

from ._forked import PIECE, mover_main, run_forked, save_step, state_for


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Exact equality of a loaded tree with the saved one (types, dtypes, values)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), f"{where}: tensor differs"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys differ"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length differs"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _env(kill_at: str | None, trace: str | None) -> dict[str, str]:
    return {"STRIPEFS_STAGING_KILL_AT": kill_at or "", "STRIPEFS_STAGING_TRACE": trace or ""}


def mover(cluster: Any, sdir: str, out: str, *, kill_at: str | None = None, trace: str | None = None) -> tuple[int, str]:
    """One ``stripefs mover --once`` pass (its own process); ``(exit status, output)``."""
    argv = ["mover", "--staging", sdir, "--once", "-q", "--piece", str(PIECE), "--concurrency", "1",
            "--cluster", cluster.file]
    return run_forked(mover_main, (argv,), _env(kill_at, trace), out)


def check_latest(cluster: Any, prefix: str, want_step: int, when: str) -> None:
    """``latest()`` names ``want_step``, and that step loads from the store and equals what was saved."""
    try:
        url = staging.latest(f"stripefs:/{prefix}", cluster=cluster.file)
        assert url is not None and url.endswith(f"/step-{want_step:06d}"), url
        assert_same(staging.load(url, cluster=cluster.file, prefer_local=False), state_for(want_step))
    except (AssertionError, OSError) as exc:
        pytest.fail(f"{when}: latest() should name step {want_step}, loadable: {type(exc).__name__}: {exc}")


def kill_points(trace: str) -> list[tuple[str, int]]:
    """(point, hit count) of every fault point passed, in the order of the traced run."""
    with open(trace) as f:
        passed = f.read().split()
    return [(name, passed[: i + 1].count(name)) for i, name in enumerate(passed)]


def test_mover_killed_at_every_fault_point(cluster, client, testdir, tmp_path):
    sdir, trace, out = str(tmp_path / "staging"), str(tmp_path / "trace"), str(tmp_path / "out")
    t0 = time.monotonic()

    def stage(step: int) -> None:
        rc, text = run_forked(save_step, (sdir, f"stripefs:/{testdir}/step-{step:06d}", step, cluster.file, False),
                              {}, out)
        assert rc == 0, text

    stage(1)
    rc, text = mover(cluster, sdir, out, trace=trace)
    assert rc == 0, text
    check_latest(cluster, testdir, 1, "after an uninterrupted run")
    points = kill_points(trace)
    names = [n for n, _ in points]
    # Three files of three pieces and one of one: every piece is a kill point, twice (sent, journaled).
    assert names.count("piece_written") == names.count("upload_piece") == 10, names
    assert names[-2:] == ["before_rename", "after_rename"], names

    committed = 1
    for i, (name, hit) in enumerate(points):
        step = i + 2
        stage(step)
        rc, text = mover(cluster, sdir, out, kill_at=f"{name}:{hit}")
        assert rc == -signal.SIGKILL, f"{name}:{hit} was not reached: {text}"
        visible = [n for n in client.listdir(testdir) if not n.startswith(".")]
        newest = max(int(n.split("-")[1]) for n in visible)
        assert newest in (committed, step), f"after a kill at {name}:{hit}: {visible}"
        check_latest(cluster, testdir, newest, f"killed at {name}:{hit}")  # nothing partial is visible

        rc, text = mover(cluster, sdir, out)
        assert rc == 0, f"resume after {name}:{hit}: {text}"
        check_latest(cluster, testdir, step, f"resumed after a kill at {name}:{hit}")
        assert not [n for n in client.listdir(testdir) if n.startswith(".")], f"partial left after {name}:{hit}"
        committed = step
    print(f"\nmover kill sweep: {len(points)} kill points in {time.monotonic() - t0:.1f}s")


def test_trainer_killed_at_every_fault_point(cluster, client, testdir, tmp_path):
    sdir, trace, out = str(tmp_path / "staging"), str(tmp_path / "trace"), str(tmp_path / "out")
    t0 = time.monotonic()

    rc, text = run_forked(save_step, (sdir, f"stripefs:/{testdir}/step-000001", 1, cluster.file, True), _env(None, trace),
                          out)
    assert rc == 0, text
    check_latest(cluster, testdir, 1, "after an uninterrupted save")
    points = kill_points(trace)
    names = [n for n, _ in points]
    # The local copy (four data files and the manifest) and the upload from the snapshot buffer.
    assert {"after_begin", "after_local", "before_rename", "after_rename"} <= set(names), names
    assert names.count("local_write") == 5 and names.count("piece_written") == names.count("upload_piece") == 10, names

    committed = 1
    journal = Journal(sdir)
    for i, (name, hit) in enumerate(points):
        step = i + 2
        url = f"stripefs:/{testdir}/step-{step:06d}"
        rc, text = run_forked(save_step, (sdir, url, step, cluster.file, True), _env(f"{name}:{hit}", None), out)
        assert rc == -signal.SIGKILL, f"{name}:{hit} was not reached: {text}"
        visible = [n for n in client.listdir(testdir) if not n.startswith(".")]
        newest = max(int(n.split("-")[1]) for n in visible)
        assert newest in (committed, step), f"after a kill at {name}:{hit}: {visible}"
        check_latest(cluster, testdir, newest, f"trainer killed at {name}:{hit}")

        rc, text = mover(cluster, sdir, out)
        assert rc == 0, f"resume after {name}:{hit}: {text}"
        state = journal.checkpoints()[-1].state
        assert state in ("committed", "abandoned"), f"after {name}:{hit}: {state}"
        if state == "committed":  # the copy was locally durable: the mover finished the upload
            committed = step
        check_latest(cluster, testdir, committed, f"resumed after a trainer kill at {name}:{hit} ({state})")
        assert not [n for n in client.listdir(testdir) if n.startswith(".")], f"partial left after {name}:{hit}"
    print(f"\ntrainer kill sweep: {len(points)} kill points in {time.monotonic() - t0:.1f}s")
