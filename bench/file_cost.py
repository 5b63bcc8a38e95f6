"""What one small durable file costs, per process: ``python -m stripefs.bench.file_cost``.

Starts a local cluster (or uses ``--cluster``), then N client processes each write
``--files`` files of 4-64 KiB in one of three ways, and prints files/s, the median
latency per file, and the CPU per file of every process of ours: the writers, the
metadata service and each storage server (from ``/proc/<pid>/stat`` before and after,
so other work on the machine does not count):

* ``open``: ``open("wb")``, write, ``fsync``, close (create, chunk write, length commit);
* ``bytes``: ``Client.write_bytes`` one file at a time (bytes first, one commit);
* ``batch``: ``Client.write_files`` of all of a process's files at once.

Example::

    python -m stripefs.bench.file_cost --modes open bytes batch --files 300 --clients 2

A hand tool to profile the small-write path (docs/benchmarks.md), not a benchmark with
floors and peers (``stripefs bench --workloads small_writes`` is).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

from stripefs.fsclient import Client

from ._local import cluster_and_pids

MODES = ("open", "bytes", "batch")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sizes(n: int) -> list[int]:
    return [4096 * (1 + k % 16) for k in range(n)]


def _writer(cluster: str, mode: str, n: int, tag: str, out: Any) -> None:
    with Client(cluster) as c:
        d = f"/file_cost/{tag}/{os.getpid()}"
        c.makedirs(d, exist_ok=True)
        data = os.urandom(65536)
        lat: list[float] = []
        cpu0 = time.process_time()  # imports and connecting are not the file's cost
        t0 = time.perf_counter()
        if mode == "batch":
            for r in c.write_files([(f"{d}/f{k}", data[:size]) for k, size in enumerate(_sizes(n))]):
                if isinstance(r, OSError):
                    raise r
        else:
            for k, size in enumerate(_sizes(n)):
                t = time.perf_counter()
                if mode == "open":
                    with c.open(f"{d}/f{k}", "wb") as f:
                        f.write(data[:size])
                        f.fsync()
                else:
                    c.write_bytes(f"{d}/f{k}", data[:size])
                lat.append(time.perf_counter() - t)
        out.put((time.perf_counter() - t0, statistics.median(lat) if lat else 0.0,
                 time.process_time() - cpu0))


def measure(cluster: str, mode: str, files: int, clients: int, pids: dict[str, int]) -> dict[str, Any]:
    """One run: ``clients`` processes write ``files`` files each in ``mode``."""
    before = {name: _cpu_s(pid) for name, pid in pids.items()}
    out: Any = mp.get_context("spawn").Queue()
    tag = f"{mode}-{time.time_ns()}"
    procs = [mp.get_context("spawn").Process(target=_writer, args=(cluster, mode, files, tag, out))
             for _ in range(clients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    total = files * clients
    return {
        "mode": mode,
        "files_per_s": total / max(r[0] for r in results),
        "p50_ms": 1000 * statistics.mean(r[1] for r in results),
        "cpu_ms_per_file": {"writers": 1000 * sum(r[2] for r in results) / total,
                            **{name: 1000 * (_cpu_s(pid) - before[name]) / total for name, pid in pids.items()}},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m stripefs.bench.file_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", help="a running cluster's cluster.json (default: start one)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--files", type=int, default=300, help="files per client process")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    a = ap.parse_args(argv)
    with cluster_and_pids(a.cluster, a.servers, "file-cost-") as (path, pids):
        servers = sum(name.startswith("storage") for name in pids)
        print(f"{a.clients} writers x {a.files} files of 4-64 KiB, {servers} storage servers")
        for mode in a.modes:
            r = measure(path, mode, a.files, a.clients, pids)
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_file"].items())
            print(f"{mode:6s} {r['files_per_s']:7.0f} files/s  p50 {r['p50_ms']:5.2f} ms  CPU ms/file: {cpu}")

if __name__ == "__main__":
    main()
