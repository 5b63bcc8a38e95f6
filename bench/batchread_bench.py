"""Random-sample dataloader reads: the zero-copy ring vs fsspec vs FUSE vs the socket floor.

One run starts a local cluster (4 servers by default), writes a dataset file,
then for each sample size and DataLoader worker count reads random samples
through each route and reports samples/s and GB/s, plus large sequential batch
reads through the ring against the loopback socket floor measured in the same
run (these machines swing 2x between runs; ratios matter).

    python -m stripefs.bench.batchread_bench --size 2GiB --json out.json

Routes: ``zerocopy`` (IndexDataset: a batch through one ring into one shared
tensor), ``fsspec`` (``cat_file`` per sample), ``fuse`` (``os.pread`` per sample
on a ``stripefs mount``), ``floor_socket``. A route that cannot run here is
reported as skipped with its reason.

Caveats:
    * The dataset is written once and read warm from the servers' page cache.
    * The FUSE route needs root and /dev/fuse; the fsspec route needs fsclient.fsspec.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset

from stripefs.bench._report import write_json
from stripefs.bench.floors import floor_socket, parse_size
from stripefs.fsclient import Client, testing
from stripefs.fsclient.batchread import ReadRing
from stripefs.fsclient.batchread.dataset import IndexDataset, loader

PATH = "/bench/dataset.bin"


class _PerSample(Dataset):
    """One read call per sample (what a plain Dataset over fsspec or FUSE does)."""

    def __init__(self, index: list[tuple[int, int]], read: Callable[[int, int], bytes]):
        self.index, self._read = index, read

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> torch.Tensor:
        off, n = self.index[i]
        return torch.frombuffer(bytearray(self._read(off, n)), dtype=torch.uint8)


class _FsspecRead:
    def __init__(self, cluster: str):
        self.cluster, self.fs, self.pid = cluster, None, -1

    def __call__(self, off: int, n: int) -> bytes:
        if self.pid != os.getpid():
            from stripefs.fsclient.fsspec import StripeFileSystem

            self.fs, self.pid = StripeFileSystem(cluster=self.cluster, skip_instance_cache=True), os.getpid()
        return self.fs.cat_file(PATH, start=off, end=off + n)  # type: ignore[union-attr]


class _PreadRead:
    def __init__(self, path: str):
        self.path, self.fd, self.pid = path, -1, -1

    def __call__(self, off: int, n: int) -> bytes:
        if self.pid != os.getpid():
            self.fd, self.pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return os.pread(self.fd, n, off)


def _drain(dl: DataLoader) -> tuple[int, int, float]:
    """(bytes, samples, seconds) after the first batch: worker start-up is not timed."""
    nbytes = samples = 0
    t0 = time.perf_counter()
    for k, batch in enumerate(dl):
        if k == 0:
            t0 = time.perf_counter()
            continue
        nbytes += int(batch.lengths.sum()) if hasattr(batch, "lengths") else batch.numel()
        samples += len(batch)
    return nbytes, samples, time.perf_counter() - t0


def _record(workload: str, path: str, workers: int, servers: int, nbytes: int, secs: float, samples: int) -> dict[str, Any]:
    return {"workload": workload, "path": path, "clients": workers, "servers": servers, "bytes": nbytes,
            "seconds": secs, "gbps": nbytes / secs / 1e9, "samples_per_s": samples / secs}


def _write_dataset(client: Client, size: int) -> None:
    block = mmap.mmap(-1, 64 << 20)
    block.write(os.urandom(64 << 20))
    view = memoryview(block)
    client.makedirs("/bench")
    with client.open(PATH, "wb") as f:
        done = 0
        while done < size:
            n = min(len(view), size - done)
            f.write(view[:n])
            done += n


def _mount(cluster_file: str, mp: str) -> subprocess.Popen | None:
    proc = subprocess.Popen([sys.executable, "-m", "stripefs.fsclient.fuse", "mount", mp, "--cluster", cluster_file, "--foreground"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(100):
        if os.path.ismount(mp):
            return proc
        if proc.poll() is not None:
            return None
        time.sleep(0.1)
    proc.terminate()
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="stripefs-batchread-bench-")
    data = testing.up(root, servers=args.servers)
    cfile = os.path.join(root, "cluster.json")
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    mp, mproc = os.path.join(root, "mnt"), None
    try:
        client = Client(cfile)
        _write_dataset(client, args.size)
        floor = floor_socket(min(args.size, 1 << 30), streams=args.servers)
        results.append({**{k: floor[k] for k in ("path", "bytes", "seconds", "gbps")}, "workload": "socket_floor",
                        "clients": 1, "servers": args.servers})
        # Large sequential batches: 64 MiB per batch through one ring.
        ring = ReadRing(client, entries=64)
        f = ring.open(PATH)
        big = mmap.mmap(-1, 64 << 20)
        bview = memoryview(big)
        ring.read([(bview, f, 0, len(bview))])  # warm
        t0, moved = time.perf_counter(), 0
        for off in range(0, args.size - len(bview) + 1, len(bview)):
            moved += sum(ring.read([(bview[j << 20 : (j + 1) << 20], f, off + (j << 20), 1 << 20) for j in range(64)]))
        results.append(_record("seq_batch_64MiB", "zerocopy", 0, args.servers, moved, time.perf_counter() - t0, moved >> 20))
        ring.close()
        del bview
        os.makedirs(mp)
        try:
            mproc = _mount(cfile, mp) if os.path.exists("/dev/fuse") else None
        except OSError as exc:
            skipped["fuse"] = str(exc)
        if mproc is None:
            skipped.setdefault("fuse", "stripefs mount did not come up (needs root, /dev/fuse, fsclient.fuse)")
        try:
            import stripefs.fsclient.fsspec  # noqa: F401
        except ImportError as exc:
            skipped["fsspec"] = f"fsclient.fsspec not importable: {exc}"
        rng = random.Random(0)
        for sample in args.sample_sizes:
            count = max(64, min(args.samples_bytes // sample, args.max_samples))
            for workers in args.workers:
                # A fresh index per configuration: the FUSE route keeps pages in the kernel
                # cache, and re-reading the same samples would measure that cache.
                index = [(rng.randrange(0, args.size - sample), sample) for _ in range(count)]
                kw = {"num_workers": workers, "multiprocessing_context": "fork", "persistent_workers": False} if workers else {}
                routes: dict[str, Callable[[], DataLoader]] = {
                    "zerocopy": lambda: loader(IndexDataset([(PATH, o, n) for o, n in index], cluster=cfile),
                                               batch_size=args.batch, **kw)}
                if "fsspec" not in skipped:
                    routes["fsspec"] = lambda: DataLoader(_PerSample(index, _FsspecRead(cfile)), batch_size=args.batch, **kw)
                if "fuse" not in skipped:
                    routes["fuse"] = lambda: DataLoader(_PerSample(index, _PreadRead(mp + PATH)), batch_size=args.batch, **kw)
                for name, make in routes.items():
                    nbytes, samples, secs = _drain(make())
                    results.append(_record(f"random_{sample >> 10}KiB", name, workers, args.servers, nbytes, secs, samples))
                    print(json.dumps(results[-1]), flush=True)
        client.close()
    finally:
        if mproc is not None:
            subprocess.run([sys.executable, "-m", "stripefs.fsclient.fuse", "umount", mp], capture_output=True)
            try:
                mproc.wait(10)
            except subprocess.TimeoutExpired:
                mproc.kill()
        testing.down(root)
    return {"results": results, "skipped": skipped, "cluster": {"servers": len(data["servers"])}}


def _summary(out: dict[str, Any]) -> None:
    rows = out["results"]
    floor = next(r["gbps"] for r in rows if r["workload"] == "socket_floor")
    print(f"\n{'workload':<18}{'path':<10}{'workers':>8}{'samples/s':>12}{'GB/s':>8}{'x floor':>9}")
    for r in rows:
        print(f"{r['workload']:<18}{r['path']:<10}{r['clients']:>8}{r.get('samples_per_s', 0):>12.0f}"
              f"{r['gbps']:>8.2f}{r['gbps'] / floor:>9.2f}")
    for name, why in out["skipped"].items():
        print(f"skipped {name}: {why}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("2GiB"), help="dataset size (default 2GiB)")
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--sample-sizes", type=lambda s: [parse_size(x) for x in s.split(",")], default=[1 << 20, 64 << 10])
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--samples-bytes", type=parse_size, default=parse_size("512MiB"), help="bytes read per route and size")
    p.add_argument("--max-samples", type=int, default=4096)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    out = run(args)
    _summary(out)
    if args.json:
        write_json(out, args.json)


if __name__ == "__main__":
    main()
