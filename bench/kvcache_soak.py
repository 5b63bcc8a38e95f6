"""Fault soak of the KV-cache page store: batches of puts and gets while storage servers are
killed with SIGKILL and come back, every hit checked byte for byte.

    python -m stripefs.bench.kvcache_soak --minutes 10 [--servers 3] [--replicas 2] [--page 16K] [--capacity 2G]

Starts a local cluster (default 3 servers, 2 copies of every chunk) and one client
process that, until the time is spent, puts a batch of new keys (each page follows from
its key) and gets a random batch of keys it has put, while a schedule kills a random
storage server every ``--every`` seconds and restarts it ``--down`` seconds later. Judged:

* **garbled**: a hit whose bytes are not its key's page (must be 0; the store's CRC32C
  makes a bad page a miss, this checks that promise from outside);
* **lost**: a key of a batch ``batch_put`` acknowledged that misses at the end, once every
  server is back (must be none; the capacity holds every page the run puts, and a run in
  which the store evicted anything fails rather than guess which misses were evictions);
* **half**: a key of a put that raised which is there with other bytes (must be none: a
  failed put's pages are whole or absent).

Puts that raised (the chain being repaired after a kill, past the client's retry budget)
and gets that missed meanwhile are counted, not failures. Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from stripefs.fsclient import Client
from stripefs.fsclient.testing import LocalCluster
from stripefs.kvcache import PageStore
from stripefs.wire import StripefsError

SETTLE = 30.0  # seconds the final check retries a miss while returned servers catch up


def page_of(key: bytes, size: int) -> bytes:
    """The page stored under ``key``: any hit can be checked against it."""
    return random.Random(key).randbytes(size)


@dataclass
class SoakReport:
    seconds: float = 0.0
    puts_acked: int = 0  # batches
    puts_failed: int = 0
    gets: int = 0  # batches
    hits: int = 0
    misses_during: int = 0  # misses of acknowledged keys while the faults ran
    get_errors: int = 0
    garbled: int = 0
    killed: int = 0
    restarted: int = 0
    evictions: int = 0  # pages the store evicted (capacity): "lost" is judged only without any
    checked_at_end: int = 0
    lost: list[str] = field(default_factory=list)
    half: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first few put/get errors, for the log

    def ok(self) -> bool:
        return not (self.garbled or self.lost or self.half or self.evictions)


def _killer(cluster: LocalCluster, kills: list[tuple[float, int, float]], t0: float, report: SoakReport,
            stop: threading.Event) -> None:
    """Play ``kills``: (seconds after start, server index, seconds down) each."""
    for at, index, down in kills:
        if stop.wait(max(0.0, t0 + at - time.monotonic())):
            return
        pid = cluster.data["servers"][index]["pid"]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        report.killed += 1
        stop.wait(down)
        cluster.up()  # starts what is not running: the killed server, on its root and port
        report.restarted += 1


def _check_hits(keys: list[bytes], bufs: list[bytearray], hits: list[bool], page: int, report: SoakReport) -> None:
    for k, b, hit in zip(keys, bufs, hits):
        if hit:
            report.hits += 1
            if bytes(b) != page_of(k, page):
                report.garbled += 1


def _note(report: SoakReport, what: str, exc: Exception) -> None:
    if len(report.errors) < 10:
        report.errors.append(f"{what}: {exc}")


def soak(cluster: LocalCluster, ns: str, *, seconds: float, page: int, batch: int,
         kills: list[tuple[float, int, float]], seed: int = 0, capacity_pages: int = 1 << 16) -> SoakReport:
    """Run the soak on ``cluster`` for ``seconds`` with ``kills`` (see :func:`_killer`).
    ``capacity_pages`` must hold every page the run puts: an evicted page would read as
    lost (a run that evicted anything is reported, not judged)."""
    rng = random.Random(seed)
    report = SoakReport()
    acked: list[bytes] = []
    failed: list[bytes] = []
    stop = threading.Event()
    with Client(cluster.file) as client, PageStore(client, ns, page, capacity_pages * page) as store:
        t0 = time.monotonic()
        killer = threading.Thread(target=_killer, args=(cluster, kills, t0, report, stop), daemon=True)
        killer.start()
        n = 0
        while time.monotonic() - t0 < seconds:
            keys = [f"{seed}-{n}-{i}".encode() for i in range(batch)]
            n += 1
            try:
                store.batch_put(keys, [page_of(k, page) for k in keys])
                acked += keys
                report.puts_acked += 1
            except StripefsError as exc:
                failed += keys
                report.puts_failed += 1
                _note(report, "put", exc)
            if not acked:
                continue
            want = rng.sample(acked, min(batch, len(acked)))
            bufs = [bytearray(page) for _ in want]
            try:
                hits = store.batch_get_into(want, bufs)
            except StripefsError as exc:
                report.get_errors += 1
                _note(report, "get", exc)
                continue
            report.gets += 1
            report.misses_during += hits.count(False)
            _check_hits(want, bufs, hits, page, report)
        report.seconds = time.monotonic() - t0
        killer.join()  # the last restart happens even past the end
        stop.set()
        report.evictions = store.stats().evictions
        if not report.evictions:
            _final_check(store, acked, failed, page, report)
    return report


def _final_check(store: PageStore, acked: list[bytes], failed: list[bytes], page: int, report: SoakReport) -> None:
    """Every acknowledged key the capacity still holds must hit (retried while servers settle);
    a failed put's key that hits must hold its whole page."""
    report.checked_at_end = len(acked)
    missing = list(acked)
    deadline = time.monotonic() + SETTLE
    while missing:
        for i in range(0, len(missing), 64):
            keys = missing[i:i + 64]
            bufs = [bytearray(page) for _ in keys]
            try:
                hits = store.batch_get_into(keys, bufs)
            except StripefsError as exc:
                _note(report, "final get", exc)
                hits = [False] * len(keys)
            _check_hits(keys, bufs, hits, page, report)
            missing[i:i + 64] = [k if not h else b"" for k, h in zip(keys, hits)]
        missing = [k for k in missing if k]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    report.lost = [k.decode() for k in missing]
    for i in range(0, len(failed), 64):
        keys = failed[i:i + 64]
        bufs = [bytearray(page) for _ in keys]
        hits = store.batch_get_into(keys, bufs)
        report.half += [k.decode() for k, b, h in zip(keys, bufs, hits) if h and bytes(b) != page_of(k, page)]


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.kvcache_soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--page", default="16K", help="page size (bytes, or with K/M)")
    p.add_argument("--batch", type=int, default=16, help="pages per put and per get")
    p.add_argument("--capacity", default="2G", help="the namespace's capacity: more than the run puts")
    p.add_argument("--every", type=float, default=20.0, help="seconds between kills")
    p.add_argument("--down", type=float, default=5.0, help="seconds a killed server stays down")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    seconds = a.minutes * 60
    kills = [(at, rng.randrange(a.servers), a.down) for at in
             [a.every * (k + 1) for k in range(int(seconds // a.every))] if at + a.down < seconds]
    with tempfile.TemporaryDirectory(prefix="stripefs-kvsoak-") as work, \
            LocalCluster.start(os.path.join(work, "cluster"), servers=a.servers, replicas=a.replicas) as cluster:
        page = _size(a.page)
        report = soak(cluster, "soak", seconds=seconds, page=page, batch=a.batch, kills=kills, seed=a.seed,
                      capacity_pages=_size(a.capacity) // page)
    out: dict[str, Any] = asdict(report)
    out["lost"], out["half"] = out["lost"][:20], out["half"][:20]
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(asdict(report), f, indent=1)
    return 0 if report.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
