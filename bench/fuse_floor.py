"""What a small file costs through pyfuse3 alone: ``python -m stripefs.bench.fuse_floor``.

A floor for the mount's small-file reads: a file system of ``--files`` files of 128 KiB
held in memory (new names every round, the mount's 1 s timeouts), served by pyfuse3 on trio with nothing else (no network, no metadata,
no cache logic), read whole in a random order by ``--readers`` processes, each file
opened, read and closed (the kernel sends LOOKUP, OPEN, READ, FLUSH, RELEASE). Prints
files/s and the CPU per file of the daemon and of the readers (from ``/proc``), so that
the stripefs mount's figures (``stripefs bench --workloads dataloader --routes fuse``)
can be read against what the same kernel requests cost a Python daemon that does
nothing but answer them. Run as root (a FUSE mount).

Example::

    python -m stripefs.bench.fuse_floor --files 2000 --readers 2 --rounds 3
"""

from __future__ import annotations

import argparse
import errno
import multiprocessing as mp
import os
import random
import stat
import subprocess
import sys
import tempfile
import time
from typing import Any

FILE_SIZE = 128 << 10


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(mountpoint: str, files: int) -> None:
    """The in-memory file system (runs in the daemon process)."""
    import pyfuse3
    import trio

    data = os.urandom(FILE_SIZE)

    class Ops(pyfuse3.Operations):
        def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
            e = pyfuse3.EntryAttributes()
            e.st_ino = ino
            if ino == pyfuse3.ROOT_INODE:
                e.st_mode, e.st_nlink = stat.S_IFDIR | 0o755, 2
            else:
                e.st_mode, e.st_nlink, e.st_size = stat.S_IFREG | 0o644, 1, FILE_SIZE
            e.entry_timeout = e.attr_timeout = 1.0  # the mount's default timeouts
            return e

        async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
            r, _, k = name.decode().partition("-")  # "<round>-<k>": each round's names are new
            if parent_inode != pyfuse3.ROOT_INODE or not (r.isdigit() and k.isdigit()) or int(k) >= files:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(int(r) * files + int(k) + 2)

        async def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
            return self._attr(inode)

        async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
            return pyfuse3.FileInfo(fh=inode)

        async def read(self, fh: int, off: int, size: int) -> bytes:
            return data[off:min(off + size, FILE_SIZE)]

        async def flush(self, fh: int) -> None:
            pass

        async def release(self, fh: int) -> None:
            pass

    pyfuse3.init(Ops(), mountpoint, set(pyfuse3.default_options) | {"fsname=fuse_floor"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()


def _reader(paths: list[str], out: Any) -> None:
    buf = bytearray(FILE_SIZE + 4096)
    cpu0 = time.process_time()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)
    out.put(time.process_time() - cpu0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stripefs.bench.fuse_floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", metavar="MOUNTPOINT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.files)
        return 0
    mnt = tempfile.mkdtemp(prefix="fuse_floor-")
    daemon = subprocess.Popen([sys.executable, "-m", "stripefs.bench.fuse_floor", "--serve", mnt,
                               "--files", str(args.files)])
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if daemon.poll() is not None or time.monotonic() > deadline:
                print("the floor's file system did not mount", file=sys.stderr)
                return 1
            time.sleep(0.05)
        for r in range(args.rounds):
            paths = [f"{mnt}/{r}-{k}" for k in range(args.files)]  # never looked up before: cold
            random.Random(r).shuffle(paths)
            before, out, t0 = _cpu_s(daemon.pid), mp.Queue(), time.perf_counter()
            procs = [mp.Process(target=_reader, args=(paths[i::args.readers], out)) for i in range(args.readers)]
            for p in procs:
                p.start()
            readers_cpu = sum(out.get() for _ in procs)
            for p in procs:
                p.join()
            wall = time.perf_counter() - t0
            daemon_us = (_cpu_s(daemon.pid) - before) / args.files * 1e6
            print(f"round {r}: {args.files / wall:,.0f} files/s; CPU per file: daemon {daemon_us:.0f} us, "
                  f"readers {readers_cpu / args.files * 1e6:.0f} us", flush=True)
    finally:
        subprocess.run(["umount", mnt], check=False)
        daemon.wait(timeout=30)
        os.rmdir(mnt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
