"""``stripefs://`` through fsspec against the native client and a real fsspec peer, in one run.

    python -m stripefs.bench.fsspec_bench [--quick] [--json FILE] [--no-s3]

Workloads (each the median of ``--repeat`` runs, on a fresh local 4-server cluster):

* ``cat_file`` of one large file (1 GiB): fsspec ``cat_file`` vs the native
  ``Client.read_bytes`` (target >= 0.9x), plus the native client reading into a
  reused page-aligned buffer (the ceiling: no result object to allocate);
* ``cat_ranges`` of 2,000 random 64 KiB ranges over 20 files vs a loop of
  single ``cat_file`` calls (target >= 5x), and vs s3fs's ``cat_ranges`` on a
  moto S3 server holding the same files (a real fsspec peer on this machine).

Records follow ``stripefs bench``'s JSON: ``{workload, path, clients, servers,
bytes, seconds, gbps}``; ``ratios`` holds the comparisons.

Caveats:
    * Everything runs on one machine: servers, client and moto share its cores,
      and the chunk files sit in the page cache (warm reads on both routes).
    * A peer that cannot run here is reported as skipped with its reason, never faked.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from stripefs.bench._report import write_json
from stripefs.fsclient import testing
from stripefs.fsclient.fsspec import StripeFileSystem

SERVERS = 4


def _median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
        del out
    return statistics.median(times)


def _record(workload: str, path: str, nbytes: int, seconds: float) -> dict[str, Any]:
    return {"workload": workload, "path": path, "clients": 1, "servers": SERVERS, "bytes": nbytes,
            "seconds": round(seconds, 6), "gbps": round(nbytes / seconds / 1e9, 4)}


def _fill(fs: StripeFileSystem, path: str, size: int, seed: int) -> None:
    """Write ``size`` pseudo-random bytes from one reused aligned block (the generator is not measured)."""
    block = random.Random(seed).randbytes(min(size, 16 << 20))
    with fs.open(path, "wb") as f:
        done = 0
        while done < size:
            n = min(len(block), size - done)
            f.write(memoryview(block)[:n])
            done += n


def bench_cat_file(fs: StripeFileSystem, size: int, repeat: int) -> list[dict[str, Any]]:
    path = "/bench/large.bin"
    _fill(fs, path, size, 1)
    client = fs.client
    buf = mmap.mmap(-1, size)
    with client.open(path, "rb") as f:
        f.pread_into(memoryview(buf), 0)  # pre-fault the reused buffer
        ceiling = _median_seconds(lambda: f.pread_into(memoryview(buf), 0), repeat)
    del buf  # views may still be referenced by finished requests; let GC unmap it
    native = _median_seconds(lambda: client.read_bytes(path), repeat)
    via_fsspec = _median_seconds(lambda: fs.cat_file(path), repeat)
    assert fs.cat_file(path, size - 16) == client.read_bytes(path, size - 16)
    return [_record("cat_file", "native", size, native), _record("cat_file", "fsspec", size, via_fsspec),
            _record("cat_file_reused_buffer", "native", size, ceiling)]


def _ranges(files: list[str], file_size: int, count: int, length: int, seed: int) -> tuple[list[str], list[int], list[int]]:
    rng = random.Random(seed)
    paths = [rng.choice(files) for _ in range(count)]
    starts = [rng.randrange(0, file_size - length) for _ in range(count)]
    return paths, starts, [s + length for s in starts]


def bench_cat_ranges(fs: StripeFileSystem, nfiles: int, file_size: int, count: int, length: int,
                     repeat: int) -> tuple[list[dict[str, Any]], tuple[list[str], list[int], list[int]], list[bytes]]:
    files = [f"/bench/shards/f{i:02d}" for i in range(nfiles)]
    for i, p in enumerate(files):
        _fill(fs, p, file_size, 100 + i)
    paths, starts, ends = _ranges(files, file_size, count, length, 7)
    nbytes = count * length
    batched = _median_seconds(lambda: fs.cat_ranges(paths, starts, ends), repeat)
    loop = _median_seconds(lambda: [fs.cat_file(p, s, e) for p, s, e in zip(paths, starts, ends)], repeat)
    reference = fs.cat_ranges(paths, starts, ends)
    assert reference[:50] == [fs.cat_file(p, s, e) for p, s, e in zip(paths[:50], starts[:50], ends[:50])]
    return ([_record("cat_ranges", "fsspec", nbytes, batched), _record("cat_file_loop", "fsspec", nbytes, loop)],
            (paths, starts, ends), reference)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_s3fs(fs: StripeFileSystem, ranges: tuple[list[str], list[int], list[int]], reference: list[bytes],
               repeat: int) -> dict[str, Any]:
    """s3fs on a moto server holding the same files; returns a record, or ``{"skipped": reason}``."""
    try:
        import boto3
        import s3fs
    except ImportError as exc:
        return {"skipped": f"s3fs/boto3 not installed ({exc.name}); pip install 'moto[server]' s3fs boto3"}
    server = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(server):
        return {"skipped": "moto_server not installed; pip install 'moto[server]'"}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    return {"skipped": "moto_server did not start"}
                time.sleep(0.2)
        creds = {"aws_access_key_id": "x", "aws_secret_access_key": "x", "region_name": "us-east-1"}
        s3 = boto3.client("s3", endpoint_url=url, **creds)
        s3.create_bucket(Bucket="bench")  # s3fs's mkdir fails against moto (location constraint)
        paths, starts, ends = ranges
        for p in sorted(set(paths)):
            s3.put_object(Bucket="bench", Key=p.lstrip("/"), Body=fs.cat_file(p))
        peer = s3fs.S3FileSystem(key="x", secret="x", client_kwargs={"endpoint_url": url, "region_name": "us-east-1"},
                                 skip_instance_cache=True)
        keys = [f"bench/{p.lstrip('/')}" for p in paths]
        assert peer.cat_ranges(keys, starts, ends) == reference
        seconds = _median_seconds(lambda: peer.cat_ranges(keys, starts, ends), repeat)
        return _record("cat_ranges", "s3fs_moto", sum(e - s for s, e in zip(starts, ends)), seconds)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fsspec_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run, not figures)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-s3", action="store_true", help="skip the s3fs-on-moto peer")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv[1:] if argv and argv[0] == "fsspec" else argv)
    large, nfiles, file_size, count, length = ((64 << 20, 4, 4 << 20, 200, 64 << 10) if args.quick
                                               else (1 << 30, 20, 16 << 20, 2000, 64 << 10))
    root = tempfile.mkdtemp(prefix="stripefs-fsspec-bench-")
    testing.up(root, servers=SERVERS)
    try:
        fs = StripeFileSystem(os.path.join(root, "cluster.json"), skip_instance_cache=True)
        results = bench_cat_file(fs, large, args.repeat)
        fs.rm("/bench/large.bin")
        range_results, ranges, reference = bench_cat_ranges(fs, nfiles, file_size, count, length, args.repeat)
        results += range_results
        peer = {"skipped": "--no-s3"} if args.no_s3 else bench_s3fs(fs, ranges, reference, args.repeat)
        if "skipped" not in peer:
            results.append(peer)
        fs.client.close()
    finally:
        testing.down(root)
        shutil.rmtree(root, ignore_errors=True)
    by = {(r["workload"], r["path"]): r["seconds"] for r in results}
    ratios = {
        "cat_file_fsspec_vs_native": by[("cat_file", "native")] / by[("cat_file", "fsspec")],
        "cat_file_fsspec_vs_reused_buffer": by[("cat_file_reused_buffer", "native")] / by[("cat_file", "fsspec")],
        "cat_ranges_vs_cat_file_loop": by[("cat_file_loop", "fsspec")] / by[("cat_ranges", "fsspec")],
    }
    if ("cat_ranges", "s3fs_moto") in by:
        ratios["cat_ranges_vs_s3fs_moto"] = by[("cat_ranges", "s3fs_moto")] / by[("cat_ranges", "fsspec")]
    report = {"results": results, "ratios": {k: round(v, 3) for k, v in ratios.items()},
              "params": {"large_file": large, "files": nfiles, "file_size": file_size, "ranges": count,
                         "range_size": length, "repeat": args.repeat, "servers": SERVERS},
              "peers_skipped": {"s3fs_moto": peer["skipped"]} if "skipped" in peer else {}}
    for r in results:
        print(f"{r['workload']:<24} {r['path']:<10} {r['bytes'] / 2**20:9.1f} MiB {r['seconds']:8.3f} s {r['gbps']:7.3f} GB/s")
    for k, v in report["ratios"].items():
        print(f"{k:<36} {v:7.2f}x")
    for k, v in report["peers_skipped"].items():
        print(f"{k}: skipped ({v})")
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
