"""FUSE mount benchmark: stripefs through its mount vs the native client, local disk and peers.

One run measures, on this machine and in the same run (these VMs are noisy: only ratios within a run mean much):

* sequential write (``dd bs=1M conv=fsync``) and read after dropping caches
  (``dd bs=1M``) of one file through the mount, and the same bytes through the
  native client -> ratios fuse/native (targets: read >= 0.6, write >= 0.5);
* ``fio`` sequential 1 MiB read/write and 4 KiB random read IOPS on the mount;
* ``torch.save`` / ``torch.load`` of a state dict through the mount vs local disk;
* GlusterFS and MooseFS (started by bench._peers) with the same dd
  method -> ratios stripefs/peer (target >= 2). A peer that cannot start is
  reported as skipped with the reason, never faked.

Run as root (drop_caches, mounts): ``python -m stripefs.bench.fuse_bench --size-mb 1024 --json out.json``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from stripefs.bench._report import write_json

GiB = 1 << 30


def record(results: list[dict[str, Any]], workload: str, path: str, nbytes: int, seconds: float, **extra: Any) -> None:
    r = {"workload": workload, "path": path, "clients": 1, "servers": extra.pop("servers", 0), "bytes": nbytes,
         "seconds": round(seconds, 4), "gbps": round(nbytes / seconds / 1e9, 3) if seconds else 0.0, **extra}
    results.append(r)
    print(f"  {workload:<22} {path:<12} {r['gbps']:7.3f} GB/s" + (f"  {extra}" if extra else ""), flush=True)


def drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass


def sh(cmd: str, timeout: float = 900) -> str:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{cmd!r}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def dd_pair(results: list[dict[str, Any]], directory: str, path: str, mb: int) -> dict[str, float]:
    """The method used for every system: dd write with fsync, drop caches, dd read."""
    f = os.path.join(directory, f"dd-{os.getpid()}.bin")
    w = timed(lambda: sh(f"dd if=/dev/zero of={f} bs=1M count={mb} conv=fsync status=none"))
    drop_caches()
    r = timed(lambda: sh(f"dd if={f} of=/dev/null bs=1M status=none"))
    sh(f"rm -f {f}")
    record(results, "seq_write_dd", path, mb << 20, w)
    record(results, "seq_read_dd", path, mb << 20, r)
    return {"write": (mb << 20) / w / 1e9, "read": (mb << 20) / r / 1e9}


def native_pair(results: list[dict[str, Any]], cluster_file: str, mb: int) -> dict[str, float]:
    from stripefs.fsclient import Client

    with Client(cluster_file) as c:
        buf = mmap.mmap(-1, 16 << 20)
        buf.write(bytes(16 << 20))
        view = memoryview(buf)

        def write() -> None:
            with c.open("/native.bin", "wb") as f:
                for _ in range(mb // 16):
                    f.write(view)

        def read() -> None:
            with c.open("/native.bin", "rb") as f:
                while f.readinto(view):
                    pass

        w = timed(write)
        drop_caches()
        r = timed(read)
        c.remove("/native.bin")
        view.release()
    record(results, "seq_write", "native", mb << 20, w)
    record(results, "seq_read", "native", mb << 20, r)
    return {"write": (mb << 20) / w / 1e9, "read": (mb << 20) / r / 1e9}


def fio(results: list[dict[str, Any]], directory: str, mb: int, seconds: int) -> None:
    if shutil.which("fio") is None:
        print("  fio: skipped (not installed)")
        return
    base = f"fio --name=b --directory={directory} --ioengine=psync --output-format=json --filename=fio.bin"
    for rw, extra in (("write", f"--bs=1M --size={mb}m --end_fsync=1"), ("read", f"--bs=1M --size={mb}m")):
        drop_caches()
        job = json.loads(sh(f"{base} --rw={rw} {extra}"))["jobs"][0][rw]
        record(results, f"seq_{rw}_fio", "fuse", job["io_bytes"], job["runtime"] / 1000)
    drop_caches()
    job = json.loads(sh(f"{base} --rw=randread --bs=4k --size={mb}m --time_based --runtime={seconds} --numjobs=1"))
    rr = job["jobs"][0]["read"]
    record(results, "randread_4k_fio", "fuse", rr["io_bytes"], rr["runtime"] / 1000, iops=round(rr["iops"]))
    os.unlink(os.path.join(directory, "fio.bin"))


def torch_pair(results: list[dict[str, Any]], mnt: str, local: str, mb: int) -> None:
    try:
        import torch
    except ImportError:
        print("  torch: skipped (not installed)")
        return
    state = {f"layer{i}.weight": torch.randn((mb << 20) // 4 // 16) for i in range(16)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    for path, d in (("fuse", mnt), ("local_disk", local)):
        f = os.path.join(d, "state.pt")

        def save() -> None:
            torch.save(state, f)
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        record(results, "torch_save", path, nbytes, timed(save))
        drop_caches()
        record(results, "torch_load", path, nbytes, timed(lambda: torch.load(f)))
        os.unlink(f)


# -- main ----------------------------------------------------------------------------------
def run(mb: int, peers: bool, torch_mb: int, fio_seconds: int) -> list[dict[str, Any]]:
    from stripefs.fsclient import testing
    from stripefs.fsclient.fuse import main as fuse_main

    results: list[dict[str, Any]] = []
    scratch = tempfile.mkdtemp(prefix="stripefs-fusebench-", dir=os.environ.get("BENCH_DIR", "/var/tmp"))
    root, mnt = os.path.join(scratch, "cluster"), os.path.join(scratch, "mnt")
    os.makedirs(mnt)
    testing.up(root, servers=4)
    cluster_file = os.path.join(root, "cluster.json")
    try:
        if fuse_main(["mount", mnt, "--cluster", cluster_file]) != 0:
            raise SystemExit("stripefs mount failed")
        try:
            print(f"stripefs, 4 servers, {mb} MiB file:")
            fuse = dd_pair(results, mnt, "fuse", mb)
            native = native_pair(results, cluster_file, mb)
            print(f"  ratio fuse/native: write {fuse['write'] / native['write']:.2f}, read {fuse['read'] / native['read']:.2f}")
            fio(results, mnt, mb, fio_seconds)
            local = os.path.join(scratch, "local")
            os.makedirs(local)
            torch_pair(results, mnt, local, torch_mb)
            local_dd = dd_pair(results, local, "local_disk", min(mb, 1024))
            del local_dd
            peer_mb = min(mb, 1024)
            ours = dd_pair(results, mnt, "fuse_1g", peer_mb) if peer_mb != mb else fuse
        finally:
            fuse_main(["umount", mnt])
        if peers:
            # The peers are started exactly as `stripefs bench --peers` starts them (bench._peers).
            from ._peers import GlusterRoute, MooseRoute
            from ._route_base import RouteSkipped, RunEnv

            for route in (GlusterRoute(), MooseRoute()):
                name = route.name
                pdir = os.path.join(scratch, name)
                os.makedirs(pdir)
                try:
                    info = route.start(RunEnv(cluster_file=None, workdir=pdir, run_id=str(os.getpid() % 10000)))
                except RouteSkipped as exc:  # a peer that cannot start is reported, never faked
                    print(f"{name}: skipped ({exc})")
                    results.append({"workload": "peer", "path": name, "skipped": str(exc)[:300]})
                    continue
                try:
                    os.makedirs(info["root"], exist_ok=True)
                    print(f"{name}:")
                    peer = dd_pair(results, info["root"], name, peer_mb)
                    print(f"  ratio stripefs/{name}: write {ours['write'] / peer['write']:.2f}, "
                          f"read {ours['read'] / peer['read']:.2f}")
                finally:
                    route.stop()
    finally:
        testing.down(root)
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=2048, help="file size for the stripefs runs (default 2 GiB)")
    p.add_argument("--torch-mb", type=int, default=1024, help="state dict size for torch.save/load")
    p.add_argument("--fio-seconds", type=int, default=10)
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--json", help="write {results: [...]} here")
    a = p.parse_args(argv)
    if os.getuid() != 0:
        print("fuse_bench needs root (mounts, drop_caches)", file=sys.stderr)
        return 2
    results = run(a.size_mb, not a.no_peers, a.torch_mb, a.fio_seconds)
    if a.json:
        write_json({"results": results}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
