"""Exhaustive kill sweeps of checkpoint staging: the machinery the tests and ``bench.ckpt_sweep`` share.

An uninterrupted, traced run of a small checkpoint (``files`` data files of ``pieces``
upload pieces each, plus one small file) lists every fault point the process passes
(``STRIPEFS_STAGING_TRACE``); the sweep then starts a fresh step for each (point, hit count),
SIGKILLs the process exactly there (``STRIPEFS_STAGING_KILL_AT``), resumes with
``stripefs mover --once`` and checks what a resuming training job would see: before the
resume and after it, ``staging.latest()`` names only a step that loads from the store
(``prefer_local=False``) and equals what was saved, tensors and plain values alike; after
the resume no partial directory is left and the step is the latest one — unless the trainer
died before its step was durable anywhere (before its local copy, or, with ``keep_local=0``,
before the commit), when the mover abandons it and the previous step stays the latest.

The mover and the trainer run in processes forked from a preloaded forkserver: a fresh
interpreter costs seconds (torch's import) each time, a fork milliseconds, and the child is
still a process of its own (SIGKILL, the kernel dropping its flocks and its memory are those
of a real trainer or ``stripefs mover``). Uploads run one file at a time so that the n-th hit
of a point is the same piece in every run.

Failures raise :class:`AssertionError` naming the kill point.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import time
from typing import Any, Callable

import torch

from ._journal import Journal

__all__ = ["CHUNK", "PIECE", "state_for", "save_step", "run_forked", "mover_pass", "kill_points", "assert_same",
           "check_latest", "sweep_mover", "sweep_trainer"]

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["stripefs.staging", "stripefs.staging.mover_cli", __name__])

# The checksum chunk is recorded per file in the manifest and the journal, and the mover's
# piece is a whole number of them: a 256 KiB chunk keeps each of the many runs small.
CHUNK = 256 << 10
PIECE = CHUNK                   # the smallest upload piece (one checksum chunk)
SHARD = 64 << 10                # below a layer, so every layer gets its own data file


def state_for(step: int, files: int = 3, pieces: int = 3) -> dict[str, Any]:
    """The training state saved as ``step``: ``files`` layers of ``pieces`` pieces (the last a
    4 KiB tail), each in its own data file, plus plain values and an RNG state (one small file)."""
    layer = (pieces - 1) * PIECE + 4096
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {f"layer{i}": torch.randn(layer // 4, generator=g) for i in range(files)},
        "rng": torch.Generator().manual_seed(1000 + step).get_state(),
        "py_rng": random.Random(step).getstate(),
        "config": {"lr": 0.1 * step, "name": f"run-{step}", "betas": (0.9, 0.99), "warmup": None},
    }


def save_step(sdir: str, url: str, step: int, cluster: str, upload: bool, keep_local: int = 1, files: int = 3,
              pieces: int = 3) -> None:
    """Save ``state_for(step, files, pieces)`` as the sweep's trainer does; returns once globally
    (or, without ``upload``, locally) durable, when the standalone mover can take the checkpoint.
    ``keep_local=0`` streams the upload from memory and writes nothing locally."""
    from stripefs import staging
    from stripefs.staging import _save

    _save.CHECK_CHUNK = CHUNK  # only ever in a forked child: the caller keeps 4 MiB
    h = staging.save(state_for(step, files, pieces), url, staging_dir=sdir, cluster=cluster, upload=upload,
                     background_mover=False, keep_local=keep_local, shard_bytes=SHARD,
                     options=staging.MoverOptions(cluster=cluster, piece=PIECE, concurrency=1))
    h.wait(120, durable="global" if upload else "local")


def _child(fn: Callable[..., int | None], args: tuple[Any, ...], env: dict[str, str], out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)  # the kill and trace hooks read the environment at every point
    code = 1
    try:
        code = int(fn(*args) or 0)
    except BaseException as exc:  # reported through the output file; the exit status says it failed
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_forked(fn: Callable[..., int | None], args: tuple[Any, ...], env: dict[str, str], out_path: str,
               timeout: float = 120.0) -> tuple[int, str]:
    """Run ``fn(*args)`` in a forked child with ``env`` added (``fn``: a module-level function).

    Returns:
        ``(exit status, output)``; the status is ``-signal`` when a signal ended the child.

    Raises:
        TimeoutError: the child ran past ``timeout`` (it is killed).
    """
    p = _ctx.Process(target=_child, args=(fn, args, env, out_path))
    p.start()
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise TimeoutError(f"{fn.__name__}{args} still running after {timeout}s")
    with open(out_path) as f:
        return p.exitcode, f.read()


def mover_main(argv: list[str]) -> int:
    from . import mover_cli

    return mover_cli.main(argv)


def _env(kill_at: str | None, trace: str | None) -> dict[str, str]:
    return {"STRIPEFS_STAGING_KILL_AT": kill_at or "", "STRIPEFS_STAGING_TRACE": trace or ""}


def mover_pass(cluster: str, sdir: str, out: str, *, kill_at: str | None = None,
               trace: str | None = None) -> tuple[int, str]:
    """One ``stripefs mover --once`` pass (its own process); ``(exit status, output)``."""
    argv = ["mover", "--staging", sdir, "--once", "-q", "--piece", str(PIECE), "--concurrency", "1",
            "--cluster", cluster]
    return run_forked(mover_main, (argv,), _env(kill_at, trace), out)


def first_and_last(points: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Of every fault point, its first and its last hit only (in the traced order): each kind
    of kill once at the start of an upload and once at its end, for a short sweep."""
    last = {name: hit for name, hit in points}
    return [(name, hit) for name, hit in points if hit in (1, last[name])]


def kill_points(trace: str) -> list[tuple[str, int]]:
    """(point, hit count) of every fault point passed, in the order of the traced run."""
    with open(trace) as f:
        passed = f.read().split()
    seen: dict[str, int] = {}
    out = []
    for name in passed:
        seen[name] = seen.get(name, 0) + 1
        out.append((name, seen[name]))
    return out


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


def check_latest(cluster: str, prefix: str, want_step: int, when: str, files: int = 3, pieces: int = 3) -> None:
    """``latest()`` names ``want_step``, and that step loads from the store and equals what was saved.

    Raises:
        AssertionError: naming ``when``.
    """
    from stripefs import staging

    try:
        url = staging.latest(f"stripefs:/{prefix}", cluster=cluster)
        assert url is not None and url.endswith(f"/step-{want_step:06d}"), url
        assert_same(staging.load(url, cluster=cluster, prefer_local=False), state_for(want_step, files, pieces))
    except (AssertionError, OSError) as exc:
        raise AssertionError(f"{when}: latest() should name step {want_step}, loadable: "
                             f"{type(exc).__name__}: {exc}") from None


def _visible_newest(client: Any, prefix: str) -> int:
    visible = [n for n in client.listdir(prefix) if not n.startswith(".")]
    return max(int(n.split("-")[1]) for n in visible)


def _no_partial(client: Any, prefix: str, when: str) -> None:
    assert not [n for n in client.listdir(prefix) if n.startswith(".")], f"partial left after {when}"


def sweep_mover(cluster: str, client: Any, prefix: str, workdir: str, files: int = 3,
                pieces: int = 3, short: bool = False) -> tuple[int, float]:
    """Kill ``stripefs mover`` at every fault point and hit count of one upload; resume and check.
    ``short``: only the first and last hit of each point (:func:`first_and_last`).

    Returns:
        ``(kill points, seconds)``.
    """
    sdir, trace, out = (os.path.join(workdir, n) for n in ("staging", "trace", "out"))
    t0 = time.monotonic()

    def stage(step: int) -> None:
        rc, text = run_forked(save_step, (sdir, f"stripefs:/{prefix}/step-{step:06d}", step, cluster, False, 1,
                                          files, pieces), {}, out)
        assert rc == 0, text

    stage(1)
    rc, text = mover_pass(cluster, sdir, out, trace=trace)
    assert rc == 0, text
    check_latest(cluster, prefix, 1, "after an uninterrupted run", files, pieces)
    points = kill_points(trace)
    names = [n for n, _ in points]
    # Every piece is a kill point, twice (sent, journaled); the small file is one piece.
    want = files * pieces + 1
    assert names.count("piece_written") == names.count("upload_piece") == want, names
    assert names[-2:] == ["before_rename", "after_rename"], names

    committed = 1
    if short:
        points = first_and_last(points)
    for i, (name, hit) in enumerate(points):
        step = i + 2
        stage(step)
        rc, text = mover_pass(cluster, sdir, out, kill_at=f"{name}:{hit}")
        assert rc == -signal.SIGKILL, f"{name}:{hit} was not reached: {text}"
        newest = _visible_newest(client, prefix)
        assert newest in (committed, step), f"after a kill at {name}:{hit}: newest visible step {newest}"
        check_latest(cluster, prefix, newest, f"killed at {name}:{hit}", files, pieces)  # nothing partial visible

        rc, text = mover_pass(cluster, sdir, out)
        assert rc == 0, f"resume after {name}:{hit}: {text}"
        check_latest(cluster, prefix, step, f"resumed after a kill at {name}:{hit}", files, pieces)
        _no_partial(client, prefix, f"{name}:{hit}")
        committed = step
    return len(points), time.monotonic() - t0


def sweep_trainer(cluster: str, client: Any, prefix: str, workdir: str, files: int = 3, pieces: int = 3,
                  keep_local: int = 1, short: bool = False) -> tuple[int, float]:
    """Kill a saving trainer at every fault point and hit count of one save; resume and check
    (``short``: only the first and last hit of each point).

    With ``keep_local=0`` nothing is staged locally: a kill before the commit loses the step
    (the mover abandons it), a kill after the rename leaves it committed.

    Returns:
        ``(kill points, seconds)``.
    """
    sdir, trace, out = (os.path.join(workdir, n) for n in ("staging", "trace", "out"))
    t0 = time.monotonic()

    def save(step: int, env: dict[str, str]) -> tuple[int, str]:
        return run_forked(save_step, (sdir, f"stripefs:/{prefix}/step-{step:06d}", step, cluster, True, keep_local,
                                      files, pieces), env, out)

    rc, text = save(1, _env(None, trace))
    assert rc == 0, text
    check_latest(cluster, prefix, 1, "after an uninterrupted save", files, pieces)
    points = kill_points(trace)
    names = [n for n, _ in points]
    assert {"after_begin", "before_rename", "after_rename"} <= set(names), names
    # The local copy (the data files and the manifest) unless keep_local=0, and the upload from memory.
    assert names.count("local_write") == (files + 2 if keep_local else 0), names
    assert names.count("piece_written") == names.count("upload_piece") == files * pieces + 1, names

    committed = 1
    journal = Journal(sdir)
    if short:
        points = first_and_last(points)
    for i, (name, hit) in enumerate(points):
        step = i + 2
        rc, text = save(step, _env(f"{name}:{hit}", None))
        assert rc == -signal.SIGKILL, f"{name}:{hit} was not reached: {text}"
        newest = _visible_newest(client, prefix)
        assert newest in (committed, step), f"after a kill at {name}:{hit}: newest visible step {newest}"
        check_latest(cluster, prefix, newest, f"trainer killed at {name}:{hit}", files, pieces)

        rc, text = mover_pass(cluster, sdir, out)
        assert rc == 0, f"resume after {name}:{hit}: {text}"
        row = journal.checkpoints()[-1]
        assert row.state in ("committed", "abandoned"), f"after {name}:{hit}: {row.state}"
        if row.state == "committed":  # durable somewhere before the kill: the mover finished it
            committed = step
        elif keep_local == 0:
            assert "keep_local=0" in (row.error or ""), f"after {name}:{hit}: {row.error}"
        check_latest(cluster, prefix, committed, f"resumed after a trainer kill at {name}:{hit} ({row.state})",
                     files, pieces)
        _no_partial(client, prefix, f"{name}:{hit}")
    return len(points), time.monotonic() - t0
