"""kill -9 of the standalone mover at every fault point and every hit count, not a sample.

A traced, uninterrupted mover run of a small checkpoint (four files, three of them three
pieces long) lists every fault point the mover passes, in order; the sweep then stages a
fresh step for each (point, hit count), SIGKILLs ``stripefs mover --once`` exactly there,
and checks what a resuming training job would see: before the resume and after it,
``staging.latest()`` names only a step that loads from the store (``prefer_local=False``)
and equals what was saved, tensors and plain values alike; after the resume the new step
is the latest one and no partial directory is left.

The mover runs with one file at a time so that the n-th hit of a point is the same piece
in every run (with two files in flight the interleaving, and so the piece, would vary).
"""

from __future__ import annotations

import random
import signal
import time
from typing import Any

import pytest
import torch

import staging
import staging._save

from ._mover_proc import run_mover

# The checksum chunk is recorded per file in the manifest and the journal, and the mover's
# piece is a whole number of them: a 256 KiB chunk keeps each of the many runs small.
CHUNK = 256 << 10
PIECE = CHUNK                   # the smallest upload piece (one checksum chunk)
LAYER = 2 * PIECE + 4096        # one data file per layer: two full pieces and a tail
SHARD = 64 << 10                # below LAYER, so every layer gets its own data file


def state_for(step: int) -> dict[str, Any]:
    """The training state saved as ``step``: tensors in several files plus plain values."""
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {f"layer{i}": torch.randn(LAYER // 4, generator=g) for i in range(3)},
        "rng": torch.Generator().manual_seed(1000 + step).get_state(),
        "py_rng": random.Random(step).getstate(),
        "config": {"lr": 0.1 * step, "name": f"run-{step}", "betas": (0.9, 0.99), "warmup": None},
    }


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


def mover(cluster: Any, sdir: str, out: str, *, kill_at: str | None = None, trace: str | None = None) -> tuple[int, str]:
    """One ``stripefs mover --once`` pass (its own process); ``(exit status, output)``."""
    env = {"STRIPEFS_STAGING_KILL_AT": kill_at or "", "STRIPEFS_STAGING_TRACE": trace or ""}
    argv = ["mover", "--staging", sdir, "--once", "-q", "--piece", str(PIECE), "--concurrency", "1",
            "--cluster", cluster.file]
    return run_mover(argv, env, out)


def stage(cluster: Any, sdir: str, url: str, step: int) -> None:
    """Save ``step`` locally only (``upload=False``): the standalone mover uploads it."""
    h = staging.save(state_for(step), url, staging_dir=sdir, cluster=cluster.file, upload=False,
                     background_mover=False, keep_local=1, shard_bytes=SHARD)
    h.wait(durable="local")
    deadline = time.monotonic() + 30
    while not h.done():  # the save thread releases the checkpoint's lock just before done()
        assert time.monotonic() < deadline, "save never finished"
        time.sleep(0.01)
    assert h.error is None


def check_latest(cluster: Any, prefix: str, want_step: int, when: str) -> None:
    """``latest()`` names ``want_step``, and that step loads from the store and equals what was saved."""
    try:
        url = staging.latest(f"stripefs:/{prefix}", cluster=cluster.file)
        assert url is not None and url.endswith(f"/step-{want_step:06d}"), url
        assert_same(staging.load(url, cluster=cluster.file, prefer_local=False), state_for(want_step))
    except (AssertionError, OSError) as exc:
        pytest.fail(f"{when}: latest() should name step {want_step}, loadable: {type(exc).__name__}: {exc}")


def test_mover_killed_at_every_fault_point(cluster, client, testdir, tmp_path, monkeypatch):
    monkeypatch.setattr(staging._save, "CHECK_CHUNK", CHUNK)
    sdir = str(tmp_path / "staging")
    trace = str(tmp_path / "trace")
    out = str(tmp_path / "mover.out")
    t0 = time.monotonic()

    stage(cluster, sdir, f"stripefs:/{testdir}/step-000001", 1)
    rc, text = mover(cluster, sdir, out, trace=trace)
    assert rc == 0, text
    check_latest(cluster, testdir, 1, "after an uninterrupted run")
    with open(trace) as f:
        passed = f.read().split()
    points: list[tuple[str, int]] = []
    for i, name in enumerate(passed):
        points.append((name, passed[: i + 1].count(name)))
    # Three files of three pieces and one of one: every piece is a kill point.
    assert passed.count("upload_piece") == 10 and "before_rename" in passed and "after_rename" in passed, passed

    committed = 1
    for i, (name, hit) in enumerate(points):
        step = i + 2
        stage(cluster, sdir, f"stripefs:/{testdir}/step-{step:06d}", step)
        rc, text = mover(cluster, sdir, out, kill_at=f"{name}:{hit}")
        assert rc == -signal.SIGKILL, f"{name}:{hit} was not reached: {text}"
        visible = [n for n in client.listdir(testdir) if not n.startswith(".")]
        newest = max(int(n.split("-")[1]) for n in visible)
        assert newest in (committed, step), f"after a kill at {name}:{hit}: {visible}"
        check_latest(cluster, testdir, newest, f"killed at {name}:{hit}")  # nothing partial is visible, the latest step loads

        rc, text = mover(cluster, sdir, out)
        assert rc == 0, f"resume after {name}:{hit}: {text}"
        check_latest(cluster, testdir, step, f"resumed after a kill at {name}:{hit}")
        assert not [n for n in client.listdir(testdir) if n.startswith(".")], f"partial left after {name}:{hit}"
        committed = step
    print(f"\nkill sweep: {len(points)} kill points in {time.monotonic() - t0:.1f}s")
