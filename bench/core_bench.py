"""Core data path vs this machine's floors, measured in one run.

    python -m stripefs.bench.core_bench [--size 1G] [--servers 4] [--clients 1,2,4] [--json FILE]

Measures (a) the socket floor: ``--servers`` sendfile streams over loopback into
page-aligned ``recv_into`` buffers, same total size; (b) the disk floor: the
same bytes written with the storage servers' durability (4 MiB pieces, fdatasync
after each) by as many writer threads as there are servers; (c) native client
sequential write and read of one file striped over the servers (reads with a
warm page cache); (d) the same with N concurrent client processes, each on its
own file, same total bytes. Prints GB/s and the ratios against the floors.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from stripefs.bench._report import write_json
from stripefs.bench.floors import floor_disk_write, floor_socket, machine_facts, parse_size


def _client_proc(cluster_file: str, path: str, size: int, barrier: Any, q: Any) -> None:
    from stripefs import fsclient

    buf = mmap.mmap(-1, size)
    buf.write(os.urandom(1 << 20) * (size >> 20) + os.urandom(size % (1 << 20)))
    dst = mmap.mmap(-1, size)
    dst.write(b"\1" * size)  # pre-fault the destination (a fresh buffer halves throughput)
    with fsclient.Client(cluster_file) as c:
        barrier.wait()
        t0 = time.perf_counter()
        with c.open(path, "wb") as f:
            f.write(buf)
        t1 = time.perf_counter()
        barrier.wait()
        reads = []
        for _ in range(3):
            barrier.wait()
            t2 = time.perf_counter()
            with c.open(path, "rb") as f:
                n = f.readinto(dst)
            reads.append((t2, time.perf_counter()))
        ok = n == size and dst[:4096] == buf[:4096] and dst[-4096:] == buf[-4096:] and dst[size // 2 : size // 2 + 4096] == buf[size // 2 : size // 2 + 4096]
    q.put({"write": (t0, t1), "reads": reads, "ok": ok})


def run_clients(cluster_file: str, nclients: int, total: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(nclients)
    q = ctx.Queue()
    size = total // nclients
    procs = [ctx.Process(target=_client_proc, args=(cluster_file, f"/bench/c{nclients}-{i}", size, barrier, q)) for i in range(nclients)]
    for p in procs:
        p.start()
    outs = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    if not all(o["ok"] for o in outs):
        raise SystemExit("benchmark read back wrong bytes")
    wsec = max(o["write"][1] for o in outs) - min(o["write"][0] for o in outs)
    rsecs = [max(o["reads"][i][1] for o in outs) - min(o["reads"][i][0] for o in outs) for i in range(3)]
    return {"clients": nclients, "bytes": size * nclients, "write_s": wsec, "read_s": statistics.median(rsecs),
            "write_gbps": size * nclients / wsec / 1e9, "read_gbps": size * nclients / statistics.median(rsecs) / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.core_bench")
    p.add_argument("--size", default="1G")
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--clients", default="1,2,4")
    p.add_argument("--chunk-size", default="4M")
    p.add_argument("--root", default=None, help="cluster root (default: a temp dir, removed afterwards)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    total, chunk = parse_size(args.size), parse_size(args.chunk_size)
    from stripefs import fsclient
    from stripefs.fsclient import testing

    root = args.root or tempfile.mkdtemp(prefix="stripefs-bench-")
    results: dict[str, Any] = {"machine": machine_facts(), "size": total, "servers": args.servers, "chunk_size": chunk}
    try:
        print(f"socket floor: {args.servers} sendfile streams -> recv_into, {total >> 20} MiB ...", flush=True)
        results["floor_socket"] = floor_socket(total, streams=args.servers)
        print(f"  {results['floor_socket']['gbps']:.2f} GB/s", flush=True)
        print(f"disk floor: {args.servers} writers, {chunk >> 20} MiB pieces, fdatasync each ...", flush=True)
        results["floor_disk"] = floor_disk_write(total, root, chunk=chunk, fsync="per_chunk", files=args.servers)
        print(f"  {results['floor_disk']['gbps']:.2f} GB/s", flush=True)
        cluster = testing.up(root, servers=args.servers, chunk_size=chunk)
        cfile = os.path.join(cluster["root"], "cluster.json")
        with fsclient.Client(cfile) as c:
            c.makedirs("/bench")
        results["native"] = []
        for n in [int(x) for x in args.clients.split(",")]:
            r = run_clients(cfile, n, total)
            results["native"].append(r)
            print(f"native, {n} client process(es): write {r['write_gbps']:.2f} GB/s "
                  f"({r['write_gbps'] / results['floor_disk']['gbps']:.2f}x disk floor), "
                  f"read {r['read_gbps']:.2f} GB/s ({r['read_gbps'] / results['floor_socket']['gbps']:.2f}x socket floor)", flush=True)
        testing.down(root)
    finally:
        if args.root is None:
            try:
                testing.down(root)
            except OSError:
                pass
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        write_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
