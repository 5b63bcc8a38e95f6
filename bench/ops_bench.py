"""Small operations against the request-path floor, measured in one run.

    python -m stripefs.bench.ops_bench [--clients 2] [--files 500] [--servers 2] [--reads 2000]
                              [--metadata-sync full,normal] [--json FILE]

Measures, on a fresh local cluster:

* the floor: a bare trio echo server (one small frame in, one out) driven by a
  blocking client -- what one request/response costs here with no protocol;
* a storage ``Ping`` and a metadata ``Ping`` through :class:`rpc.Connection`;
* mdtest-style metadata phases with ``--clients`` processes, each in its own
  directory: create (``open(..., "wb")``), stat, readdir, unlink of ``--files``
  empty files -- aggregate ops/s, p50 latency, and the CPU seconds per operation
  spent by the clients and by the servers (from ``/proc``; the metadata service's
  share apart), which are far less noisy than wall time on a loaded machine; with
  ``--metadata-sync full,normal`` the phases run once per durability setting of the
  metadata store, each on a fresh cluster, in the same run;
* 4 KiB random reads (``pread_into``) of a 64 MiB file: p50 latency.

Every latency is also printed as a ratio to the echo floor of the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import tempfile
import time
from typing import Any

from stripefs.bench._report import write_json

PHASES = ("create", "stat", "readdir", "unlink")


# -- the floor: a bare trio echo ----------------------------------------------------------------

def _echo_server(port_q: Any) -> None:
    import trio

    async def handler(stream: Any) -> None:
        try:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return
                await stream.send_all(data)
        except trio.BrokenResourceError:
            pass

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port_q.put(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(handler, listeners)

    trio.run(main)


def echo_floor(n: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_echo_server, args=(q,), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=60)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = b"x" * 64
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                s.sendall(msg)
                got = 0
                while got < len(msg):
                    got += len(s.recv(4096))
                lat.append(time.perf_counter() - t)
        return {"p50_us": statistics.median(lat) * 1e6}
    finally:
        proc.kill()
        proc.join(5)


# -- pings through the client connection ----------------------------------------------------------

def ping_latency(cluster_file: str, n: int) -> dict[str, float]:
    from stripefs import fsclient
    from stripefs.wire import _messages as m

    out = {}
    with fsclient.Client(cluster_file) as c:
        sid = next(iter(c.routing().servers))
        for name, call in (("storage_ping", lambda: c.call_storage(sid, m.Ping())),
                           ("metadata_ping", lambda: c.call(m.Ping()))):
            for _ in range(50):
                call()
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                call()
                lat.append(time.perf_counter() - t)
            out[name + "_p50_us"] = statistics.median(lat) * 1e6
    return out


# -- metadata phases ------------------------------------------------------------------------------

def _meta_client(cluster_file: str, index: int, files: int, barrier: Any, q: Any, attr_timeout: float = 0.0) -> None:
    from stripefs import fsclient

    d = f"/ops/c{index}"
    names = [f"{d}/f{k:06d}" for k in range(files)]
    out: dict[str, Any] = {}
    with fsclient.Client(cluster_file, attr_timeout=attr_timeout) as c:
        c.makedirs(d)
        ops = {
            "create": lambda p: c.open(p, "wb").close(),
            "stat": lambda p: c.stat(p),
            "readdir": lambda p: c.listdir(d),
            "unlink": lambda p: c.remove(p),
        }
        for phase in PHASES:
            items = names if phase != "readdir" else [d] * max(3, files // 25)
            barrier.wait()
            cpu0, t0 = time.process_time(), time.perf_counter()
            lat = []
            for p in items:
                t = time.perf_counter()
                ops[phase](p)
                lat.append(time.perf_counter() - t)
            out[phase] = {"t0": t0, "t1": time.perf_counter(), "cpu": time.process_time() - cpu0,
                          "ops": len(items), "lat": lat}
            barrier.wait()
    q.put(out)


def _proc_cpu(pid: int) -> float:
    """CPU seconds of process ``pid``: the sum of its threads' scheduler run time (ns
    precision; ``/proc/PID/stat`` counts 10 ms ticks, too coarse for a few hundred ops)."""
    try:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def metadata_phases(cluster_file: str, server_pids: list[int], clients: int, files: int,
                    attr_timeout: float = 0.0, meta_pids: list[int] | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients + 1)
    q = ctx.Queue()
    procs = [ctx.Process(target=_meta_client, args=(cluster_file, i, files, barrier, q, attr_timeout))
             for i in range(clients)]
    for p in procs:
        p.start()
    server_cpu, meta_cpu = {}, {}
    meta_pids = meta_pids or []
    for phase in PHASES:
        barrier.wait()
        c0, m0 = sum(_proc_cpu(p) for p in server_pids), sum(_proc_cpu(p) for p in meta_pids)
        barrier.wait()
        server_cpu[phase] = sum(_proc_cpu(p) for p in server_pids) - c0
        meta_cpu[phase] = sum(_proc_cpu(p) for p in meta_pids) - m0
    outs = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    res = {}
    for phase in PHASES:
        parts = [o[phase] for o in outs]
        n = sum(x["ops"] for x in parts)
        secs = max(x["t1"] for x in parts) - min(x["t0"] for x in parts)
        lat = sorted(v for x in parts for v in x["lat"])
        res[phase] = {"ops": n, "ops_per_s": n / secs, "p50_us": lat[len(lat) // 2] * 1e6,
                      "client_cpu_us_per_op": sum(x["cpu"] for x in parts) / n * 1e6,
                      "server_cpu_us_per_op": server_cpu[phase] / n * 1e6,
                      "metadata_cpu_us_per_op": meta_cpu[phase] / n * 1e6}
    return res


# -- 4 KiB random reads ---------------------------------------------------------------------------

def random_reads(cluster_file: str, n: int, size: int = 64 << 20) -> dict[str, float]:
    import mmap

    from stripefs import fsclient

    rng = random.Random(7)
    with fsclient.Client(cluster_file) as c:
        with c.open("/ops/rand.bin", "wb") as f:
            f.write(os.urandom(1 << 20) * (size >> 20))
        buf = memoryview(mmap.mmap(-1, 4096))
        lat = []
        with c.open("/ops/rand.bin", "rb") as f:
            for _ in range(n):
                off = rng.randrange(size // 4096) * 4096
                t = time.perf_counter()
                f.pread_into(buf, off)
                lat.append(time.perf_counter() - t)
        c.remove("/ops/rand.bin")
    return {"p50_us": statistics.median(lat) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.ops_bench")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--files", type=int, default=500)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--reads", type=int, default=2000)
    p.add_argument("--attr-timeout", type=float, default=0.0, help="Client(attr_timeout=...) of the metadata clients")
    p.add_argument("--metadata-sync", default="full",
                   help="durability settings of the metadata store to measure, comma-separated: full, normal")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from stripefs import fsclient
    from stripefs.fsclient import testing

    syncs = [x.strip() for x in args.metadata_sync.split(",") if x.strip()]
    if not syncs or any(x not in ("full", "normal") for x in syncs):
        p.error("--metadata-sync: a comma-separated list of full, normal")
    results: dict[str, Any] = {"clients": args.clients, "files": args.files, "servers": args.servers,
                               "attr_timeout": args.attr_timeout, "metadata_sync": syncs}
    floor = echo_floor(args.reads)
    results["echo_floor"] = floor
    print(f"bare trio echo p50: {floor['p50_us']:.0f} us", flush=True)
    results["metadata_by_sync"] = {}
    for i, sync in enumerate(syncs):
        root = tempfile.mkdtemp(prefix="stripefs-ops-")
        try:
            cluster = testing.up(root, servers=args.servers, metadata_sync=sync)
            cfile = os.path.join(cluster["root"], "cluster.json")
            pids = list(cluster["pids"])
            meta_pids = [s["pid"] for s in cluster["metadata_services"]]
            with fsclient.Client(cfile) as c:
                c.makedirs("/ops")
                ttl = float(c.status().metadata.get("lease_ttl", 0.0))
            # The clients ask for attribute leases (the default): a stat of a path seen before,
            # or a listing of a directory listed before, is then answered from the client's
            # cache (each path is stat'ed once here; the readdir phase lists one directory
            # again and again: with leases, that phase measures the cache).
            asks = os.environ.get("STRIPEFS_LEASES", "1").strip().lower() not in ("0", "false", "no", "off")
            results["leases"] = asks and ttl > 0
            results["lease_ttl"] = ttl
            if i == 0:
                print(f"leases: {'on, ttl %g s' % ttl if results['leases'] else 'off'}", flush=True)
            if i == 0:
                pings = ping_latency(cfile, args.reads)
                results["pings"] = pings
                for k, v in pings.items():
                    print(f"{k.removesuffix('_p50_us')} p50: {v:.0f} us ({v / floor['p50_us']:.2f}x echo)", flush=True)
            meta = metadata_phases(cfile, pids, args.clients, args.files, args.attr_timeout, meta_pids)
            results["metadata_by_sync"][sync] = meta
            if i == 0:
                results["metadata"] = meta
            print(f"metadata sync {sync}:", flush=True)
            for phase, r in meta.items():
                print(f"  {phase:8s} {r['ops_per_s']:8.0f} ops/s  p50 {r['p50_us']:6.0f} us "
                      f"({r['p50_us'] / floor['p50_us']:.1f}x echo)  cpu/op: client {r['client_cpu_us_per_op']:.0f} us, "
                      f"servers {r['server_cpu_us_per_op']:.0f} us (metadata {r['metadata_cpu_us_per_op']:.0f})",
                      flush=True)
            if i == 0:
                rr = random_reads(cfile, args.reads)
                results["rand_read_4k"] = rr
                print(f"4 KiB random read p50: {rr['p50_us']:.0f} us ({rr['p50_us'] / floor['p50_us']:.2f}x echo)",
                      flush=True)
        finally:
            testing.down(root)
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        write_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
