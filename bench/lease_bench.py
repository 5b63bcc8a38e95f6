"""What attribute leases buy and cost, measured in one run on a fresh local cluster.

    python -m stripefs.bench.lease_bench [--files 300] [--servers 2] [--metadata-sync full] [--json FILE]

* ``stat`` p50 of paths already stat'ed once: with leases (answered from the client's
  cache) and without (``Client(leases=False)``: a metadata round trip each);
* ``unlink`` p50 by one client of files another client (its own process) holds leases on
  -- each unlink waits for that holder to acknowledge the invalidation -- against the
  same with a holder that asked for none.

Timed figures on a loaded machine are noisy: compare the two sides of each pair.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.lease_bench")
    p.add_argument("--files", type=int, default=300)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--metadata-sync", choices=["full", "normal"], default="full")
    p.add_argument("--json", default=None)
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
        for leases in (False, True):
            r = restat(cfile, paths, leases)
            results[f"restat_{'leases' if leases else 'no_leases'}"] = r
            print(f"stat again, leases {'on ' if leases else 'off'}: p50 {r['p50_us']:7.1f} us  "
                  f"{r['ops_per_s']:9.0f} ops/s", flush=True)
        for leases in (False, True):
            r = unlink_under_holder(cfile, f"/unlink-{int(leases)}", args.files, leases)
            results[f"unlink_holder_{'leases' if leases else 'no_leases'}"] = r
            print(f"unlink, another client {'holds leases' if leases else 'holds none  '}: p50 {r['p50_us']:7.1f} us  "
                  f"{r['ops_per_s']:7.0f} ops/s", flush=True)
    finally:
        testing.down(root)
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        write_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
