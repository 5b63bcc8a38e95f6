"""Where a reader's tail goes during a checkpoint burst: ``python -m stripefs.bench.burst_tail``.

Starts a local cluster (or uses ``--cluster``), writes a dataset of ``--files`` files of
64-256 KiB and reads it once (the page cache stays warm: the disk is out of the picture),
then ``--readers`` processes read random files of it one at a time while one writer
process writes a ``--size`` MiB file in 4 MiB pieces (``--rate``: paced to that many GB/s)
and syncs it (``--staged``: saves a state of ``--size`` MiB in 16 tensors with
``staging.save`` and waits for its commit, as a training job checkpoints: the snapshot, the
local copy, then the in-process mover's upload in the background traffic class; ``--rate``
is then the mover's bandwidth cap). It prints, for the readers' files before the burst and during it: the
latency p50/p99, how many took longer than ``--slow`` ms and how their time splits between
open, read and close; and, for every process of ours, the CPU it ran and the time its
threads waited in the kernel's run queue for a CPU during the burst (``/proc/<pid>/task/
<tid>/schedstat``), with the number of times they were put on a CPU.

Example::

    python -m stripefs.bench.burst_tail --size 1024 --readers 1 --json out.json

A hand tool to explain the ``burst_interference`` workload of ``stripefs bench``
(docs/benchmarks.md), not a benchmark with floors and peers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import random
import time
from typing import Any

import numpy as np

from stripefs.fsclient import Client

from ._local import cluster_and_pids

PIECE = 4 << 20  # bytes per write(2) of the burst
SETTLE = 3.0  # seconds the readers read alone before the writer starts (the first half second is not counted)


def schedstat(pid: int) -> dict[str, tuple[int, int, int]]:
    """Per thread of ``pid`` alive now: nanoseconds on a CPU and waiting in the run queue,
    and times put on a CPU, so far."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                r, w, n = (int(x) for x in f.read().split())
        except (OSError, ValueError):  # the thread ended
            continue
        out[tid] = (r, w, n)
    return out


def sched_delta(before: dict[str, tuple[int, int, int]],
                after: dict[str, tuple[int, int, int]]) -> dict[str, float]:
    """What the threads alive at ``after`` did since ``before`` (a thread that started
    meanwhile: all of it; one that ended meanwhile is not counted, its time then lost):
    CPU and run-queue ms, times put on a CPU."""
    d = [tuple(x - y for x, y in zip(now, before.get(tid, (0, 0, 0)))) for tid, now in after.items()]
    return {"cpu": sum(x[0] for x in d) / 1e6, "run_queue": sum(x[1] for x in d) / 1e6,
            "on_cpu_times": sum(x[2] for x in d)}


def _reader(cluster: str, names: list[str], stop: Any, out: Any) -> None:
    rows: list[tuple[float, float, float, float]] = []  # start, open, read, close
    rng = random.Random(os.getpid())
    with Client(cluster) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            f = c.open(rng.choice(names), "rb")
            t1 = time.perf_counter()
            try:
                f.read()
            finally:
                t2 = time.perf_counter()
                f.close()
            rows.append((t0, t1 - t0, t2 - t1, time.perf_counter() - t2))
    out.put(rows)


def _writer(cluster: str, size: int, rate: float, out: Any) -> None:
    piece = memoryview(os.urandom(PIECE))
    with Client(cluster) as c:
        t0 = time.perf_counter()
        with c.open("/burst_tail/ckpt", "wb") as f:
            for done in range(PIECE, size + PIECE, PIECE):
                f.write(piece[: PIECE - max(0, done - size)])
                if rate:
                    ahead = t0 + done / rate - time.perf_counter()
                    if ahead > 0:
                        time.sleep(ahead)
            f.fsync()
        out.put((t0, time.perf_counter()))
        c.unlink("/burst_tail/ckpt")


def _staged_writer(cluster: str, size: int, rate: float, out: Any) -> None:
    import tempfile

    import torch

    from stripefs import staging
    from stripefs.staging import MoverOptions
    from stripefs.staging._mover import remove_tree

    count = 16
    state = {f"layer{i:02d}": torch.rand(max(1, size // count // 4)) for i in range(count)}
    options = MoverOptions(bandwidth=rate or None)
    with tempfile.TemporaryDirectory(prefix="burst-tail-staging-") as sdir:
        t0 = time.perf_counter()
        h = staging.save(state, "stripefs:///burst_tail/ck/step-1", staging_dir=sdir, cluster=cluster,
                         keep_local=1, options=options)
        blocked = time.perf_counter() - t0
        h.wait()
        out.put((t0, time.perf_counter(), blocked))
    with Client(cluster) as c:
        remove_tree(c, "/burst_tail/ck")


def _phase(rows: list[tuple[float, ...]], slow: float) -> dict[str, Any]:
    if not rows:
        return {"files": 0}
    lat = np.array([sum(r[1:]) for r in rows])
    late = [r for r in rows if sum(r[1:]) > slow]
    out = {"files": len(rows), "p50_ms": 1e3 * float(np.percentile(lat, 50)),
           "p99_ms": 1e3 * float(np.percentile(lat, 99)), "slow": len(late)}
    if late:
        out["slow_mean_ms"] = {part: 1e3 * float(np.mean([r[k] for r in late]))
                               for k, part in enumerate(("open", "read", "close"), start=1)}
    return out


def measure(cluster: str, names: list[str], pids: dict[str, int], *, size: int, readers: int,
            rate: float, slow: float, staged: bool = False) -> dict[str, Any]:
    """One burst beside ``readers`` reading processes; see the module docstring."""
    ctx = mp.get_context("spawn")
    stop, rq, wq = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(cluster, names, stop, rq)) for _ in range(readers)]
    for p in procs:
        p.start()
    try:
        time.sleep(SETTLE)
        watched = {**pids, **{f"reader {k}": p.pid for k, p in enumerate(procs)}}
        writer = ctx.Process(target=_staged_writer if staged else _writer, args=(cluster, size, rate, wq))
        w0 = time.perf_counter()
        before = {name: schedstat(pid) for name, pid in watched.items()}
        writer.start()
        watched["writer"] = writer.pid
        before["writer"] = schedstat(writer.pid)  # its imports and connecting count too
        while True:
            try:
                t0, t1, *blocked = wq.get(timeout=1.0)
                break
            except queue.Empty:
                if not writer.is_alive():
                    raise RuntimeError(f"the burst's writer died (exit code {writer.exitcode})") from None
        after = {name: schedstat(pid) for name, pid in watched.items()}
        window = time.perf_counter() - w0
        writer.join(60)
    finally:
        stop.set()
        rows = [row for _ in procs for row in rq.get(timeout=120)]
        for p in procs:
            p.join(60)
    # Alone: read while nothing else ran (before the writer's process started: its imports
    # and connecting take CPU too). perf_counter is CLOCK_MONOTONIC: one clock for all processes.
    alone = [r for r in rows if w0 - SETTLE + 0.5 < r[0] and r[0] + sum(r[1:]) < w0]
    during = [r for r in rows if r[0] >= t0 and r[0] + sum(r[1:]) <= t1]
    burst = {"bytes": size, "seconds": t1 - t0, "gb_per_s": size / (t1 - t0) / 1e9}
    if blocked:
        burst["save_blocked_s"] = blocked[0]
    return {
        "burst": burst,
        "alone": _phase(alone, slow), "during": _phase(during, slow),
        "sched_window_s": window,  # the burst, and the writer's start (imports, connecting) before it
        "sched_during_ms": {name: sched_delta(before[name], after[name]) for name in watched},
    }


def _dataset(cluster: str, files: int) -> list[str]:
    rng = random.Random(1)
    names = [f"/burst_tail/ds/f{k}" for k in range(files)]
    with Client(cluster) as c:
        c.makedirs("/burst_tail/ds", exist_ok=True)
        for name in names:
            c.write_bytes(name, rng.randbytes(rng.randrange(64 << 10, 256 << 10)))
        for name in names:  # warm: the page cache holds every byte the readers ask for
            c.read_bytes(name)
    return names


def _report(r: dict[str, Any]) -> None:
    b = r["burst"]
    print(f"burst: {b['bytes'] >> 20} MiB in {b['seconds']:.2f} s ({b['gb_per_s']:.3f} GB/s)"
          + (f", save() blocked {b['save_blocked_s'] * 1e3:.0f} ms" if "save_blocked_s" in b else ""))
    for phase in ("alone", "during"):
        x = r[phase]
        if not x["files"]:
            print(f"  {phase}: no file read")
            continue
        split = ", ".join(f"{k} {v:.2f}" for k, v in x.get("slow_mean_ms", {}).items())
        print(f"  {phase:6s} {x['files']:6d} files  p50 {x['p50_ms']:.2f} ms  p99 {x['p99_ms']:.2f} ms  "
              f"slow {x['slow']}" + (f" (mean ms: {split})" if split else ""))
    print(f"  from the writer's start to the burst's end ({r['sched_window_s']:.2f} s), ms:")
    for name, s in r["sched_during_ms"].items():
        print(f"    {name:12s} CPU {s['cpu']:7.0f}  run queue {s['run_queue']:7.0f}  on a CPU {s['on_cpu_times']} times")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m stripefs.bench.burst_tail", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", help="a running cluster's cluster.json (default: start one)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--files", type=int, default=2000, help="dataset files (64-256 KiB)")
    ap.add_argument("--readers", type=int, default=1, help="reading processes")
    ap.add_argument("--size", type=int, default=1024, help="MiB the burst writes")
    ap.add_argument("--rate", type=float, default=0.0, help="GB/s the burst is paced to (0: as fast as it goes)")
    ap.add_argument("--staged", action="store_true",
                    help="the burst is a staging.save of a state of --size MiB, waited for until committed")
    ap.add_argument("--slow", type=float, default=3.0, help="ms past which a file read counts as slow")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", help="write the results there")
    a = ap.parse_args(argv)
    if a.size <= 0 or a.readers <= 0 or a.files <= 0 or a.rate < 0:
        ap.error("--size, --readers and --files must be positive, --rate at least 0")
    with cluster_and_pids(a.cluster, a.servers, "burst-tail-") as (path, pids):
        try:
            names = _dataset(path, a.files)
            runs = []
            for _ in range(a.repeat):
                runs.append(measure(path, names, pids, size=a.size << 20, readers=a.readers,
                                    rate=a.rate * 1e9, slow=a.slow / 1e3, staged=a.staged))
                _report(runs[-1])
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"args": vars(a), "runs": runs}, f, indent=1)
        finally:
            if a.cluster is not None:  # someone else's cluster: the dataset goes
                with Client(path) as c, contextlib.suppress(FileNotFoundError):
                    for name in c.listdir("/burst_tail/ds"):
                        c.remove(f"/burst_tail/ds/{name}")
                    c.rmdir("/burst_tail/ds")
                    c.rmdir("/burst_tail")

if __name__ == "__main__":
    main()
