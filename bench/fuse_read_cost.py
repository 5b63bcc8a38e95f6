"""What a small file read through the mount costs, per process and thread:
``python -m stripefs.bench.fuse_read_cost``.

Starts a local cluster (or uses ``--cluster``) and mounts it (``--mount-options``, e.g.
``ro``). Each round writes ``--files`` new files of 64-256 KiB with the native client,
drops the kernel's caches, then ``--readers`` processes read them whole through the mount
in a random order (open with ``O_DIRECT``, one read, close: LOOKUP, OPEN, READ, FLUSH,
RELEASE), and it prints files/s and the CPU per file of every process of ours, the mount's
daemon thread by thread (with a user/system split at the clock tick's resolution), from
``/proc`` before and after the reads (so
the writes before them and other work on the machine do not count).

Example::

    python -m stripefs.bench.fuse_read_cost --files 3000 --rounds 2 --mount-options ro

A hand tool to profile the mount's small-file path (docs/benchmarks.md); the benchmark
against floors and peers is ``stripefs bench --workloads dataloader --routes fuse``. Run as
root (a FUSE mount, ``drop_caches``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import multiprocessing as mp
import os
import random
import tempfile
import time
from typing import Any, Iterator

from stripefs.fsclient import Client

from ._local import cluster_and_pids
from ._orchestrate import drop_caches
from ._routes import FuseMount, RouteSkipped
from .burst_tail import sched_delta, schedstat

_TICK = os.sysconf("SC_CLK_TCK")
MAX_FILE = 256 << 10


def thread_cpu(pid: int) -> dict[tuple[int, str], tuple[float, float, float]]:
    """``(tid, name) -> (CPU s, user s, system s)`` of every live thread of ``pid``: the CPU
    time from the scheduler (nanoseconds), its user/system split from ``stat`` (ticks)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError):  # ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[(int(tid), name)] = (ns / 1e9, int(fields[11]) / _TICK, int(fields[12]) / _TICK)
    return out



def _reader(paths: list[str], out: Any) -> None:
    buf = mmap.mmap(-1, MAX_FILE)  # page-aligned, as O_DIRECT wants
    cpu0, t0 = time.process_time(), time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.readv(fd, [buf])
        finally:
            os.close(fd)
    out.put((time.perf_counter() - t0, time.process_time() - cpu0))


@contextlib.contextmanager
def _mounted(cluster: str, options: str) -> Iterator[tuple[str, int]]:
    """A ``stripefs mount --foreground`` of ``cluster``: (mount point, daemon pid)."""
    with tempfile.TemporaryDirectory(prefix="fuse-read-cost-") as d:
        mount = FuseMount(cluster, os.path.join(d, "mnt"), options, os.path.join(d, "daemon.log"))
        try:
            try:
                mount.wait_mounted()
            except RouteSkipped as exc:
                with open(os.path.join(d, "daemon.log"), errors="replace") as f:
                    raise SystemExit(f"the mount did not come up: {exc}\n{f.read()[-2000:]}") from None
            assert mount.proc is not None
            yield mount.mnt, mount.proc.pid
        finally:
            mount.stop()


def _write_round(cluster: str, r: int, files: int) -> list[str]:
    rng = random.Random(r)
    names = [f"/fuse_read_cost/r{r}/f{k}" for k in range(files)]
    data = rng.randbytes(MAX_FILE)
    with Client(cluster) as c:
        c.makedirs(f"/fuse_read_cost/r{r}", exist_ok=True)
        for name in names:
            c.write_bytes(name, data[:4096 * rng.randint(16, 64)])
    return names


def measure(mnt: str, daemon: int, pids: dict[str, int], names: list[str],
            readers: int) -> dict[str, Any]:
    """One round: ``readers`` processes read ``names`` through ``mnt``, cold."""
    paths = [mnt + name for name in names]
    random.Random(len(paths)).shuffle(paths)
    if not drop_caches():
        raise SystemExit("drop_caches needs root: the reads would not be cold")
    before, before_threads = {k: schedstat(p) for k, p in pids.items()}, thread_cpu(daemon)
    out = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=_reader, args=(paths[i::readers], out)) for i in range(readers)]
    for p in procs:
        p.start()
    got = [out.get() for _ in procs]
    for p in procs:
        p.join()
    after, after_threads = {k: schedstat(p) for k, p in pids.items()}, thread_cpu(daemon)
    n = len(paths)
    threads = []
    for key, (cpu, user, system) in sorted(after_threads.items()):
        c0, u0, s0 = before_threads.get(key, (0.0, 0.0, 0.0))
        if (cpu - c0) / n * 1e6 >= 0.5:  # threads that did something per file (idle ones are left out)
            threads.append({"thread": key[1], "cpu_us": (cpu - c0) / n * 1e6, "user_us": (user - u0) / n * 1e6,
                            "sys_us": (system - s0) / n * 1e6})
    return {
        "files": n,
        "files_per_s": n / max(wall for wall, _cpu in got),
        "readers_us": sum(cpu for _wall, cpu in got) / n * 1e6,
        "daemon_us": sum(t["cpu_us"] for t in threads),
        "daemon_threads": threads,
        "processes_us": {k: sched_delta(before[k], after[k])["cpu"] / n * 1e3 for k in pids},  # ms -> us
    }


def _report(r: dict[str, Any]) -> None:
    print(f"{r['files']} files: {r['files_per_s']:,.0f} files/s; CPU per file, us: readers {r['readers_us']:.0f}, "
          f"daemon {r['daemon_us']:.0f}", flush=True)
    for t in r["daemon_threads"]:
        print(f"    daemon thread {t['thread']:24s} {t['cpu_us']:5.0f} (user {t['user_us']:.0f}, sys {t['sys_us']:.0f})")
    for name, us in r["processes_us"].items():
        print(f"    {name:38s} {us:5.0f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m stripefs.bench.fuse_read_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", help="a running cluster's cluster.json (default: start one)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--files", type=int, default=3000, help="files per round (64-256 KiB)")
    ap.add_argument("--readers", type=int, default=2, help="reading processes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mount-options", default="", metavar="OPTS", help="the mount's -o options, e.g. ro")
    ap.add_argument("--json", help="write the results there")
    a = ap.parse_args(argv)
    if a.files <= 0 or a.readers <= 0 or a.rounds <= 0 or a.servers <= 0:
        ap.error("--files, --readers, --rounds and --servers must be positive")
    with cluster_and_pids(a.cluster, a.servers, "fuse-read-cost-") as (cluster, pids):
        try:
            with _mounted(cluster, a.mount_options) as (mnt, daemon):
                rounds = []
                for r in range(a.rounds):
                    names = _write_round(cluster, r, a.files)
                    rounds.append(measure(mnt, daemon, pids, names, a.readers))
                    _report(rounds[-1])
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"args": vars(a), "rounds": rounds}, f, indent=1)
        finally:
            with Client(cluster) as c, contextlib.suppress(FileNotFoundError):  # the files go
                for r in range(a.rounds):
                    d = f"/fuse_read_cost/r{r}"
                    if c.exists(d):
                        for name in c.listdir(d):
                            c.remove(f"{d}/{name}")
                        c.rmdir(d)
                c.rmdir("/fuse_read_cost")


if __name__ == "__main__":
    main()
