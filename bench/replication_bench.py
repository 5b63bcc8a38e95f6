"""Chain replication: its cost, failover, resync, measured in one run on 3 local servers.

    python -m stripefs.bench.replication_bench [--size 512M] [--servers 3] [--chunk-size 4M] [--json FILE]

Measures (1) sequential write and read of one file (native client, one process,
page-aligned reused buffers) with R = 1, 2, 3, as GB/s and as a ratio to R = 1;
(2) failover with R = 2: a reader and a writer loop while one storage server is
killed with SIGKILL; the read gap (last good read before the kill to the first
after it), the time until writes succeed again and until the metadata service
marks the server offline; (3) resync: write ``--resync-size`` while it is down,
restart it (``testing.up`` restarts only dead processes) and time until it is
``serving`` again: the bytes of the chunks it missed per second; (4) read
throughput before the kill, while degraded and during the resync.

Every read is checked against the source (stamped 1 MiB blocks, so a chunk from
the wrong offset or file fails); the program exits 1 if any check failed.

Caveats:
    * One client process on the same machine as the servers: on a 2-core VM the
      client and 3 servers share the cores, so R = 3 pays in CPU as well as disk.
    * A resync shorter than one read block gives a noisy "read during resync"
      figure; bytes are credited to a window in proportion to each block's overlap.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import signal
import statistics
import struct
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

from stripefs.bench._report import write_json
from stripefs.bench.floors import machine_facts, parse_size
from stripefs.wire import ServerInfo

MiB = 1 << 20
STAMP = struct.Struct("!QQ")  # (file tag, MiB index) at the start of every MiB
now = time.monotonic


def make_source(size: int, tag: int) -> mmap.mmap:
    """Page-aligned, pre-faulted buffer: random 1 MiB repeated, each MiB stamped (tag, index)."""
    buf = mmap.mmap(-1, size)
    arr = np.frombuffer(buf, dtype=np.uint8)
    block = np.random.default_rng(tag).integers(0, 256, MiB, dtype=np.uint8)
    for off in range(0, size, MiB):
        n = min(MiB, size - off)
        arr[off:off + n] = block[:n]
        if n >= STAMP.size:
            arr[off:off + STAMP.size] = np.frombuffer(STAMP.pack(tag, off // MiB), dtype=np.uint8)
    del arr  # an exported view would stop mmap.close()
    return buf


def same(a: Any, b: Any) -> bool:
    return bool(np.array_equal(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)))


def sample_ok(dst: memoryview, src: mmap.mmap, off: int, n: int) -> bool:
    """Compare the head, the middle and the tail (4 KiB each) of a block read at ``off``."""
    k = min(4096, n)
    return all(dst[p:p + k] == src[off + p:off + p + k] for p in (0, (n - k) // 2, n - k))


def rec(workload: str, servers: int, replicas: int, nbytes: int, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"workload": workload, "path": "native", "clients": 1, "servers": servers, "replicas": replicas,
            "bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0, **extra}


class Loop(threading.Thread):
    """Repeat ``op(i)`` until stopped; log (start, end, bytes, ok) for every call."""

    def __init__(self, op: Callable[[int], int]):
        super().__init__(daemon=True)
        self.op = op
        self.log: list[tuple[float, float, int, bool]] = []
        self.errors: list[str] = []
        self.halt = threading.Event()
        self.bad = 0  # calls whose bytes did not match the source

    def run(self) -> None:
        i = 0
        while not self.halt.is_set():
            t0 = now()
            try:
                n = self.op(i)
                self.log.append((t0, now(), n, n >= 0))
                self.bad += n < 0  # a sample mismatch: wrong bytes served
            except OSError as exc:  # a failed read or write is clearly an error; record it
                self.log.append((t0, now(), 0, False))
                self.errors.append(repr(exc))
            i += 1

    def stop(self) -> "Loop":
        self.halt.set()
        self.join(150)
        return self

    def bytes_in(self, w0: float, w1: float) -> float:
        """Bytes credited to [w0, w1], in proportion to each call's overlap with it."""
        return sum(n * max(0.0, min(e, w1) - max(s, w0)) / max(e - s, 1e-9) for s, e, n, ok in self.log if ok)


def reader(c: Any, path: str, src: mmap.mmap, block: int) -> Loop:
    """A loop reading ``path`` block by block straight from the servers (no client cache)."""
    attr = c.stat(path)
    dst = mmap.mmap(-1, block)
    view = memoryview(dst)
    nblocks = -(-attr.size // block)

    def op(i: int) -> int:
        off = (i % nblocks) * block
        n = c.read_into(attr.ino, attr.layout, attr.size, off, view)
        return n if sample_ok(view, src, off, n) else -1
    return Loop(op)


def write_file(c: Any, path: str, src: mmap.mmap) -> float:
    t0 = now()
    with c.open(path, "wb") as f:
        f.write(src)
    return now() - t0


def server(c: Any, sid: int) -> ServerInfo:
    return next(s for s in c.status().servers if s.server_id == sid)


def wait_state(c: Any, sid: int, state: str, timeout: float) -> float:
    deadline = now() + timeout
    while server(c, sid).state != state:
        if now() > deadline:
            raise TimeoutError(f"server {sid} not {state} after {timeout:.0f}s: {c.status().servers}")
        time.sleep(0.05)
    return now()


def missed_bytes(c: Any, paths: list[str], sid: int) -> tuple[int, int]:
    """(chunks, bytes) of ``paths`` whose chain holds ``sid``: what it must copy back."""
    chunks = nbytes = 0
    for p in paths:
        attr = c.stat(p)
        for pl in c.placement(p):
            if sid in pl["replicas"]:
                chunks += 1
                nbytes += min(attr.layout.chunk_size, attr.size - pl["index"] * attr.layout.chunk_size)
    return chunks, nbytes


def cost_of_replication(root: str, args: argparse.Namespace, src: mmap.mmap, dst: mmap.mmap) -> list[dict[str, Any]]:
    """Phase 1: one file written and read 3 times with R = 1, 2, 3."""
    from stripefs.fsclient import Client, testing

    out: list[dict[str, Any]] = []
    for r in (1, 2, 3):
        croot = os.path.join(root, f"r{r}")
        try:
            info = testing.up(croot, servers=args.servers, replicas=r, chunk_size=args.chunk_size)
            with Client(os.path.join(info["root"], "cluster.json")) as c:
                wsec = write_file(c, "/seq", src)
                reads = []
                for _ in range(3):
                    t0 = now()
                    with c.open("/seq", "rb") as f:
                        n = f.readinto(dst)
                    reads.append(now() - t0)
                ok = n == len(src) and same(dst, src)
        finally:
            testing.down(croot)
            shutil.rmtree(croot, ignore_errors=True)
        out.append(rec("seq_write", args.servers, r, len(src), wsec, verified=ok))
        out.append(rec("seq_read", args.servers, r, len(src), statistics.median(reads), verified=ok,
                       runs=[round(x, 4) for x in reads]))
    for w in ("seq_write", "seq_read"):
        base = next(x["gbps"] for x in out if x["workload"] == w and x["replicas"] == 1)
        for x in out:
            if x["workload"] == w:
                x["ratio_to_r1"] = x["gbps"] / base
    return out


def failures(root: str, args: argparse.Namespace, src: mmap.mmap, src2: mmap.mmap) -> list[dict[str, Any]]:
    """Phases 2-4 on one R = 2 cluster: failover, degraded writes and reads, resync."""
    from stripefs.fsclient import Client, testing

    kw = dict(servers=args.servers, replicas=2, chunk_size=args.chunk_size)
    croot, n, chunk = os.path.join(root, "r2-fail"), args.servers, args.chunk_size
    block = min(len(src), 4 * chunk)
    out: list[dict[str, Any]] = []
    try:
        info = testing.up(croot, **kw)
        cfile = os.path.join(info["root"], "cluster.json")
        with Client(cfile) as c, Client(cfile) as cr, Client(cfile) as cw:
            write_file(c, "/base", src)
            probe_len = min(len(src), n * chunk)  # one chunk on each chain
            write_file(c, "/probe", src[:probe_len])
            # (4a) reads with every server serving
            rd = reader(cr, "/base", src, block)
            rd.start()
            time.sleep(args.settle)
            rd.stop()
            w0, w1 = rd.log[0][0], rd.log[-1][1]
            normal = rec("read_normal", n, 2, int(rd.bytes_in(w0, w1)), w1 - w0, read_block=block)
            bad = rd.bad
            # (2) failover: a reader (one chunk per call) and a writer (one chunk per chain per call)
            pattr = cw.stat("/probe")
            # Kill a server holding the probe's first chunk, so the writer really has to wait
            # for the failover (a probe whose chains all avoid the victim would not).
            victim = c.placement("/probe")[0]["replicas"][0]
            pview = memoryview(src)[:probe_len]
            wr = Loop(lambda i: (cw.write_from(pattr.ino, pattr.layout, 0, pview), probe_len)[1])
            rd = reader(cr, "/base", src, chunk)
            rd.start(), wr.start()
            time.sleep(args.settle)
            ready_by = now() + 30  # on a loaded machine the loops may not have finished one op yet
            while now() < ready_by and not (any(x[3] for x in list(rd.log)) and any(x[3] for x in list(wr.log))):
                time.sleep(0.05)
            os.kill(server(c, victim).pid, signal.SIGKILL)
            t_kill = now()
            t_off = wait_state(c, victim, "offline", 30)
            deadline = now() + 40  # the client retry budget is 30 s: a write must have resumed by then
            while now() < deadline and not any(s >= t_kill and ok for s, _e, _n, ok in wr.log):
                time.sleep(0.05)
            time.sleep(args.settle)
            rd.stop(), wr.stop()
            before = [e for s, e, _n, ok in rd.log if ok and e <= t_kill]
            after = [e for s, e, _n, ok in rd.log if ok and e > t_kill]
            wafter = [e for s, e, _n, ok in wr.log if ok and s >= t_kill]
            ends = sorted(e for s, e, _n, ok in rd.log if ok)
            w0, w1 = rd.log[0][0], rd.log[-1][1]
            out.append(rec("failover", n, 2, int(rd.bytes_in(w0, w1)), w1 - w0,
                           read_gap_s=(after[0] - before[-1]) if before and after else None,
                           max_read_stall_s=max((b - a for a, b in zip(ends, ends[1:])), default=None),
                           write_resume_s=(wafter[0] - t_kill) if wafter else None,
                           offline_after_s=t_off - t_kill, victim=victim, read_errors=len(rd.errors),
                           write_errors=len(wr.errors), errors=(rd.errors + wr.errors)[:3]))
            bad += rd.bad
            # (4b) degraded reads, (3) writes while the server is down
            rd = reader(cr, "/base", src, block)
            rd.start()
            time.sleep(args.settle)
            rd.stop()
            w0, w1 = rd.log[0][0], rd.log[-1][1]
            degraded = rec("read_degraded", n, 2, int(rd.bytes_in(w0, w1)), w1 - w0, read_block=block)
            bad += rd.bad
            out.append(rec("write_degraded", n, 2, len(src2), write_file(c, "/outage", src2)))
            chunks, missed = missed_bytes(c, ["/outage", "/probe"], victim)
            # (3) restart; (4c) a reader runs through the resync
            rd = reader(cr, "/base", src, block)
            rd.start()
            time.sleep(min(args.settle, 0.5))
            t_restart = now()
            testing.up(croot, **kw)  # restarts only the dead server; it registers as syncing
            t_up = now()
            states = {server(c, victim).state}
            t_serving = wait_state(c, victim, "serving", 300)
            rd.stop()
            bad += rd.bad
            out.append(rec("resync", n, 2, missed, t_serving - t_restart, chunks_missed=chunks,
                           mib_per_s=missed / MiB / (t_serving - t_restart),
                           process_start_s=t_up - t_restart, sync_s=t_serving - t_up,
                           mib_per_s_after_start=missed / MiB / max(t_serving - t_up, 1e-9),
                           state_after_restart=sorted(states)))
            during = rec("read_during_resync", n, 2, int(rd.bytes_in(t_up, t_serving)), t_serving - t_up,
                         read_block=block, reads_overlapping=sum(1 for s, e, _n, ok in rd.log if ok and e > t_up and s < t_serving))
            for x in (normal, degraded, during):
                x["ratio_to_normal"] = x["gbps"] / normal["gbps"] if normal["gbps"] else None
                out.append(x)
            # Read back what was written while the server was away (resynced replicas serve a share).
            dst = mmap.mmap(-1, len(src2))
            with c.open("/outage", "rb") as f:
                ok = f.readinto(dst) == len(src2) and same(dst, src2)
            ok = ok and cw.read_bytes("/probe") == src[:probe_len] and bad == 0
            for x in out:
                x["verified"] = ok
    finally:
        testing.down(croot)
        shutil.rmtree(croot, ignore_errors=True)
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'workload':<20} {'R':>2} {'MiB':>8} {'seconds':>8} {'GB/s':>7}  notes"]
    keys = ("ratio_to_r1", "ratio_to_normal", "read_gap_s", "max_read_stall_s", "write_resume_s",
            "offline_after_s", "mib_per_s", "mib_per_s_after_start", "chunks_missed", "process_start_s", "sync_s", "verified")
    for r in results:
        notes = " ".join(f"{k}={r[k]:.3f}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r)
        lines.append(f"{r['workload']:<20} {r['replicas']:>2} {r['bytes'] / MiB:>8.1f} {r['seconds']:>8.3f} "
                     f"{r['gbps']:>7.3f}  {notes}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.replication_bench", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("512M"), help="file size for phases 1 and 4")
    p.add_argument("--resync-size", type=parse_size, default=None, help="bytes written while a server is down (default --size)")
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--chunk-size", type=parse_size, default=parse_size("4M"))
    p.add_argument("--settle", type=float, default=2.0, help="seconds each read window and pause lasts")
    p.add_argument("--root", default=None, help="scratch dir for the clusters (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.servers < 3:
        p.error("--servers must be at least 3 (R = 3 and a victim that is not alone in its chains)")
    root = tempfile.mkdtemp(prefix="stripefs-repl-", dir=args.root)
    src, src2 = make_source(args.size, 1), make_source(args.resync_size or args.size, 2)
    dst = mmap.mmap(-1, args.size)
    dst.write(b"\1" * args.size)  # pre-fault: a fresh destination halves throughput
    report: dict[str, Any] = {"machine": machine_facts(), "size": args.size, "servers": args.servers,
                              "chunk_size": args.chunk_size}
    try:
        print(f"replication cost: R = 1, 2, 3 on {args.servers} servers, {args.size / MiB:.0f} MiB ...", flush=True)
        results = cost_of_replication(root, args, src, dst)
        print("failover, degraded I/O and resync with R = 2 ...", flush=True)
        results += failures(root, args, src, src2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["results"] = results
    report["verified"] = all(r.get("verified") for r in results)
    print(table(results))
    if args.json:
        write_json(report, args.json)
    if not report["verified"]:
        print("VERIFICATION FAILED: wrong bytes or a failed check (see the JSON)")
    return 0 if report["verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
