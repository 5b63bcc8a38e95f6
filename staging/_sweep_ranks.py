"""Kill sweeps of saves by several ranks: every rank killed at every fault point it passes.

Two ways several processes save one step: ``staging.save(..., rank=r, world_size=n,
save_id=...)`` (``api="save"``) and ``dcp.save`` through ``StagedStorageWriter`` over gloo on
loopback (``api="dcp"``). An uninterrupted, traced run lists the fault points each rank passes
(``STRIPEFS_STAGING_TRACE``, one file per rank); then, for every rank and every (point, hit
count) of its trace, a fresh step is saved by all ranks with that rank SIGKILLed exactly there
(``STRIPEFS_STAGING_KILL_AT``). After each run:

* the step is either not there at all, or committed with every rank's files, and then it loads
  with every rank's keys, equal to what each rank saved;
* ``latest()`` names the newest committed step, and it loads with every rank's keys;
* a step that did not commit left no rank believing it did: every surviving rank's save failed
  (``staging.save``: with :class:`CheckpointAborted` or ``TimeoutError`` saying why).

Ranks are processes forked from ``_sweep``'s preloaded forkserver (a real SIGKILL, the kernel
dropping the victim's locks and memory). Failures raise :class:`AssertionError` naming the kill.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

import torch

from ._sweep import CHUNK, PIECE, _ctx, _child, _env, kill_points

__all__ = ["rank_state", "rank_main", "run_ranks", "check_step", "sweep_ranks", "RANK_TIMEOUT"]

RANK_TIMEOUT = 3.0  # staging.save: how long rank 0 waits for a killed rank's files before it aborts


def rank_state(rank: int, step: int) -> dict[str, Any]:
    """What rank ``rank`` saves as ``step``: its own keys, a two-piece tensor (two upload
    pieces, so a piece boundary is a kill point) and a small one."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return {f"w{rank}": torch.randn((PIECE + 4096) // 4, generator=g), f"b{rank}": torch.arange(5) + step,
            f"step{rank}": step}


def rank_main(api: str, rank: int, world: int, url: str, sdir: str, cluster: str, tag: str, port: int,
              step: int) -> int:
    """One rank's save (in a forked child); prints ``ok`` or the error, returns 0 / 1."""
    from stripefs import staging
    from stripefs.staging import _save

    try:
        if api == "save":
            _save.CHECK_CHUNK = CHUNK  # only ever in a forked child
            h = staging.save(rank_state(rank, step), url, rank=rank, world_size=world, save_id=tag, staging_dir=sdir,
                             cluster=cluster, background_mover=False, rank_timeout=RANK_TIMEOUT,
                             options=staging.MoverOptions(cluster=cluster, piece=PIECE, concurrency=1))
            h.wait()
        else:
            import datetime

            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=30))
            dcp.save({k: v for k, v in rank_state(rank, step).items() if isinstance(v, torch.Tensor)},
                     storage_writer=staging.StagedStorageWriter(url, staging_dir=sdir, cluster=cluster))
    except BaseException as exc:  # noqa: BLE001 -- torch's CheckpointException is a BaseException
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"ok": True}))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(api: str, world: int, url: str, workdir: str, cluster: str, step: int,
              env_of: Any = lambda rank: {}, timeout: float = 120.0) -> list[tuple[int, str]]:
    """All ``world`` ranks save ``step`` to ``url`` at once, each in a forked child with
    ``env_of(rank)`` added; ``(exit status, output)`` per rank (-9: killed)."""
    tag, port = f"{url}-{time.time_ns()}", _free_port()
    procs = []
    for rank in range(world):
        out = os.path.join(workdir, f"rank{rank}.out")
        args = (api, rank, world, url, os.path.join(workdir, f"s{rank}"), cluster, tag, port, step)
        p = _ctx.Process(target=_child, args=(rank_main, args, env_of(rank), out))
        p.start()
        procs.append((p, out))
    deadline = time.monotonic() + timeout
    results = []
    for p, out in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
            raise AssertionError(f"a rank of {url} still ran after {timeout:.0f} s: a save hangs")
        with open(out) as f:
            results.append((p.exitcode, f.read()))
    return results


def check_step(api: str, url: str, world: int, step: int, cluster: str, workdir: str) -> None:
    """``url`` holds every rank's files and loads with every rank's keys, equal to what it saved."""
    from stripefs import staging

    man = staging.verify(url, cluster=cluster)  # every file listed is there and reads back whole
    want = {k: v for rank in range(world) for k, v in rank_state(rank, step).items()}
    if api == "save":
        assert len(man["ranks"]) == world, f"{url}: the manifest names {len(man['ranks'])} ranks, not {world}"
        got = staging.load(url, cluster=cluster, prefer_local=False)
    else:
        import torch.distributed.checkpoint as dcp

        names = {f["name"] for f in man["files"]}
        assert {n.split("_")[2] for n in names if n.endswith(".distcp")} == {str(r) for r in range(world)}, names
        want = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(got, storage_reader=staging.StagedStorageReader(url, staging_dir=os.path.join(workdir, "load"),
                                                                 cluster=cluster))
    assert sorted(got) == sorted(want), f"{url}: keys {sorted(got)}, saved {sorted(want)}"
    for k, v in want.items():
        same = torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
        assert same, f"{url}: {k} differs from what its rank saved"


def sweep_ranks(api: str, world: int, cluster: str, client: Any, prefix: str, workdir: str,
                only: list[tuple[int, str, int]] | None = None) -> tuple[int, float]:
    """Kill each rank at each fault point (and hit count) it passes; check every run (module doc).

    Args:
        only: ``(rank, point, hit)`` kills to run instead of every one of the traced run (a sample).

    Returns:
        ``(kills run, seconds)``.
    """
    from stripefs import staging

    t0 = time.monotonic()
    traces = [os.path.join(workdir, f"trace{r}") for r in range(world)]
    url = f"stripefs:/{prefix}/step-{1:06d}"
    results = run_ranks(api, world, url, workdir, cluster, 1, lambda r: _env(None, traces[r]))
    assert all(rc == 0 for rc, _ in results), f"the uninterrupted save failed: {results}"
    check_step(api, url, world, 1, cluster, workdir)
    kills = only if only is not None else [(r, p, n) for r in range(world) for p, n in kill_points(traces[r])]
    committed = 1
    for i, (victim, point, hit) in enumerate(kills):
        step = i + 2
        url = f"stripefs:/{prefix}/step-{step:06d}"
        when = f"{api}, {world} ranks, rank {victim} killed at {point}:{hit}"
        results = run_ranks(api, world, url, workdir, cluster, step,
                            lambda r: _env(f"{point}:{hit}" if r == victim else None, None))
        assert results[victim][0] == -signal.SIGKILL, f"{when}: not reached: {results[victim]}"
        if client.exists(url.removeprefix("stripefs:/")):
            check_step(api, url, world, step, cluster, workdir)
            committed = step
        else:
            ok = [r for r, (rc, _) in enumerate(results) if rc == 0]
            assert not ok, f"{when}: the step did not commit, yet rank(s) {ok} were told it did"
        newest = staging.latest(f"stripefs:/{prefix}", cluster=cluster)
        assert newest == f"stripefs:/{prefix}/step-{committed:06d}", f"{when}: latest() is {newest}"
        check_step(api, newest, world, committed, cluster, workdir)
    return len(kills), time.monotonic() - t0

