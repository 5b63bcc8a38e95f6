"""What attribute leases buy and cost, measured in one run on a fresh local cluster.

    python -m stripefs.bench.lease_bench [--files 300] [--servers 2] [--metadata-sync full] [--json FILE]
        [--holders 0,8,64] [--creates 200] [--relist-ms 100] [--stopped]

* ``stat`` p50 of paths already stat'ed once: with leases (answered from the client's
  cache) and without (``Client(leases=False)``: a metadata round trip each);
* ``unlink`` p50 by one client of files another client (its own process) holds leases on
  -- each unlink waits for that holder to acknowledge the invalidation -- against the
  same with a holder that asked for none;
* ``create`` p50/p99 in a checkpoint directory that 0, 8 or 64 other clients (``--holders``,
  threads in a few processes of their own) keep listing every ``--relist-ms`` (each
  create invalidates their listing leases and waits for every acknowledgement), and with
  ``--stopped`` the same beside one more lister SIGSTOPped (a create waits for its session,
  not its lease's TTL).

Timed figures on a loaded machine are noisy: compare the two sides of each pair.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import threading
import statistics
import tempfile
import time
from typing import Any

from stripefs.bench._report import write_json


def _p50_us(lat: list[float]) -> float:
    return statistics.median(lat) * 1e6


def _watching(c: Any, leases: bool) -> None:
    """Once ``c``'s lease watch is live (its first stat starts it), when it asks for leases."""
    c.stat("/")
    deadline = time.monotonic() + 10
    while leases and not (c._core.attrs is not None and c._core.attrs.leasing) and time.monotonic() < deadline:
        time.sleep(0.01)


def _timed(op: Any, paths: list[str]) -> dict[str, float]:
    """``op(path)`` for each path in turn: p50 latency and operations per second."""
    lat = []
    t0 = time.perf_counter()
    for p in paths:
        t = time.perf_counter()
        op(p)
        lat.append(time.perf_counter() - t)
    return {"p50_us": _p50_us(lat), "ops_per_s": len(paths) / (time.perf_counter() - t0)}


def _holder(cluster_file: str, paths: list[str], leases: bool, ready: Any, done: Any) -> None:
    from stripefs import fsclient

    with fsclient.Client(cluster_file, leases=leases) as c:
        _watching(c, leases)
        for p in paths:
            c.stat(p)
        ready.set()
        done.wait(120)


def restat(cluster_file: str, paths: list[str], leases: bool) -> dict[str, float]:
    from stripefs import fsclient

    with fsclient.Client(cluster_file, leases=leases) as c:
        _watching(c, leases)
        for p in paths:
            c.stat(p)
        return _timed(c.stat, paths)


def unlink_under_holder(cluster_file: str, d: str, files: int, leases: bool) -> dict[str, float]:
    from stripefs import fsclient

    paths = [f"{d}/f{k:05d}" for k in range(files)]
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    with fsclient.Client(cluster_file, leases=False) as w:
        w.makedirs(d)
        w.create_many(paths)
        proc = ctx.Process(target=_holder, args=(cluster_file, paths, leases, ready, done))
        proc.start()
        try:
            if not ready.wait(120):
                raise RuntimeError("the holder did not start")
            return _timed(w.remove, paths)
        finally:
            done.set()
            proc.join(30)


def _listers(cluster_file: str, d: str, clients: int, relist_s: float, ready: Any, done: Any) -> None:
    """``clients`` clients in this process, each listing ``d`` every ``relist_s`` (a
    reader polling a checkpoint directory): each holds a listing lease on it most of the time."""
    from stripefs import fsclient

    cs = [fsclient.Client(cluster_file) for _ in range(clients)]
    try:
        for c in cs:
            _watching(c, True)
            c.listdir(d)

        def poll(c: Any) -> None:
            while not done.wait(relist_s):
                c.listdir(d)

        threads = [threading.Thread(target=poll, args=(c,), daemon=True) for c in cs]
        for t in threads:
            t.start()
        ready.set()
        done.wait(600)
        for t in threads:
            t.join(10)
    finally:
        for c in cs:
            c.close()


def create_under_listers(cluster_file: str, d: str, creates: int, holders: int, relist_s: float,
                         stopped: bool = False) -> dict[str, float]:
    """Create latency (p50/p99) in ``d`` while ``holders`` clients keep listing it (and,
    with ``stopped``, one more lister that is SIGSTOPped once it holds its lease)."""
    from stripefs import fsclient

    ctx = mp.get_context("spawn")
    done = ctx.Event()
    procs: list[tuple[Any, Any]] = []
    per_proc = 16
    counts = [min(per_proc, holders - k) for k in range(0, holders, per_proc)] + ([1] if stopped else [])
    with fsclient.Client(cluster_file, leases=False) as w:
        w.makedirs(d)
        try:
            for n in counts:
                ready = ctx.Event()
                proc = ctx.Process(target=_listers, args=(cluster_file, d, n, relist_s, ready, done))
                proc.start()
                procs.append((proc, ready))
            for proc, ready in procs:
                if not ready.wait(300):
                    raise RuntimeError("a lister did not start")
            if stopped:
                time.sleep(relist_s * 2)  # its lease is held again
                os.kill(procs[-1][0].pid, signal.SIGSTOP)
            lat = []
            for k in range(creates):
                t = time.perf_counter()
                w.mknod(f"{d}/c{k:05d}")
                lat.append(time.perf_counter() - t)
                time.sleep(relist_s / 4)  # the listers list it again meanwhile (as readers of a checkpoint do)
        finally:
            if stopped and procs:
                os.kill(procs[-1][0].pid, signal.SIGCONT)
            done.set()
            for proc, _ in procs:
                proc.join(30)
    lat.sort()
    return {"p50_ms": statistics.median(lat) * 1e3, "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
            "max_ms": lat[-1] * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.lease_bench")
    p.add_argument("--files", type=int, default=300)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--metadata-sync", choices=["full", "normal"], default="full")
    p.add_argument("--json", default=None)
    p.add_argument("--holders", default="0,8,64",
                   help="comma-separated numbers of clients listing the checkpoint directory (create latency)")
    p.add_argument("--creates", type=int, default=200, help="creates timed per number of holders (0: skip)")
    p.add_argument("--relist-ms", type=float, default=100.0, help="how often each holder lists the directory again")
    p.add_argument("--stopped", action="store_true", help="also with one more holder SIGSTOPped")
    p.add_argument("--only-creates", action="store_true", help="skip the stat and unlink figures")
    args = p.parse_args(argv)
    from stripefs import fsclient
    from stripefs.fsclient import testing

    root = tempfile.mkdtemp(prefix="stripefs-leases-")
    results: dict[str, Any] = {"files": args.files, "servers": args.servers, "metadata_sync": args.metadata_sync}
    try:
        cluster = testing.up(root, servers=args.servers, metadata_sync=args.metadata_sync)
        cfile = os.path.join(cluster["root"], "cluster.json")
        paths = [f"/stat/f{k:05d}" for k in range(args.files)]
        with fsclient.Client(cfile) as c:
            c.makedirs("/stat")
            c.create_many(paths)
            results["lease_ttl"] = c.status().metadata.get("lease_ttl")
        for leases in (False, True) if not args.only_creates else ():
            r = restat(cfile, paths, leases)
            results[f"restat_{'leases' if leases else 'no_leases'}"] = r
            print(f"stat again, leases {'on ' if leases else 'off'}: p50 {r['p50_us']:7.1f} us  "
                  f"{r['ops_per_s']:9.0f} ops/s", flush=True)
        for leases in (False, True) if not args.only_creates else ():
            r = unlink_under_holder(cfile, f"/unlink-{int(leases)}", args.files, leases)
            results[f"unlink_holder_{'leases' if leases else 'no_leases'}"] = r
            print(f"unlink, another client {'holds leases' if leases else 'holds none  '}: p50 {r['p50_us']:7.1f} us  "
                  f"{r['ops_per_s']:7.0f} ops/s", flush=True)
        for holders in [int(h) for h in args.holders.split(",") if h.strip()] if args.creates else []:
            for stopped in (False, True) if args.stopped else (False,):
                r = create_under_listers(cfile, f"/ckpt-{holders}-{int(stopped)}", args.creates, holders,
                                         args.relist_ms / 1000, stopped)
                results[f"create_listed_by_{holders}{'_and_1_stopped' if stopped else ''}"] = r
                print(f"create, listed by {holders:3d} holders{' + 1 stopped' if stopped else '          '}: "
                      f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:7.2f} ms  max {r['max_ms']:7.2f} ms", flush=True)
    finally:
        testing.down(root)
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        write_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
