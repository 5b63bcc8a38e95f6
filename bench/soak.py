"""Soak the write path: the differential exerciser for minutes, over every route.

    python -m stripefs.bench.soak --minutes 10                  # native and FUSE, new seeds until time is up
    python -m stripefs.bench.soak --minutes 2 --routes native --first-seed 1000

Starts a local cluster (256 KiB chunks, so small files still stripe over every
server), mounts it when FUSE is usable, and runs seeded operation sequences
(``fsclient.testing.differential``) against a local file on each route in turn
until the time is spent. Prints operations per second and bytes compared per
route; a divergence stops the run with its seed and operation list (replay it
with ``STRIPEFS_DIFF_SEEDS=SEED`` in the tests) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from stripefs.bench._report import write_json
from stripefs.fsclient.testing import LocalCluster
from stripefs.fsclient.testing.differential import (
    Divergence,
    LocalRoute,
    MountRoute,
    NativeRoute,
    run_seed,
)

CHUNK = 256 * 1024
OPS = 100
MAX_SIZE = 4 << 20


def _fuse_usable() -> bool:
    return shutil.which("fusermount3") is not None and os.path.exists("/dev/fuse") and os.getuid() == 0


def soak(minutes: float, routes: list[str], first_seed: int, servers: int) -> dict[str, Any]:
    """Run seeds round-robin over ``routes`` for ``minutes``; returns per-route figures."""
    work = tempfile.mkdtemp(prefix="stripefs-soak-")
    stats = {r: {"seeds": 0, "ops": 0, "bytes_compared": 0, "seconds": 0.0} for r in routes}
    mnt = os.path.join(work, "mnt")
    mounted = False
    try:
        with LocalCluster.start(os.path.join(work, "cluster"), servers=servers, chunk_size=CHUNK) as cluster, \
                cluster.client() as a, cluster.client() as b:
            a.makedirs("/soak")
            with a.open("/soak/probe", "wb") as f:
                window = f.window
            if "fuse" in routes:
                os.makedirs(mnt)
                subprocess.run([sys.executable, "-m", "stripefs.fsclient.fuse", "mount", mnt, "--cluster", cluster.file],
                               check=True)
                mounted = True
            made = {"native": lambda: NativeRoute((a, b), "/soak"), "fuse": lambda: MountRoute(mnt + "/soak", a, "/soak")}
            deadline = time.monotonic() + minutes * 60
            seed = first_seed
            while time.monotonic() < deadline:
                for name in routes:
                    oracle_dir = tempfile.mkdtemp(dir=work)
                    t = time.perf_counter()
                    ex = run_seed(made[name](), LocalRoute(oracle_dir), f"{name}-{seed}", seed, ops=OPS,
                                  chunk=CHUNK, window=window, max_size=MAX_SIZE)
                    st = stats[name]
                    st["seconds"] += time.perf_counter() - t
                    st["seeds"] += 1
                    st["ops"] += len(ex.ops)
                    st["bytes_compared"] += ex.bytes_compared
                    shutil.rmtree(oracle_dir)
                    a.remove(f"/soak/{name}-{seed}")
                seed += 1
    finally:
        if mounted:
            subprocess.run([sys.executable, "-m", "stripefs.fsclient.fuse", "umount", mnt], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    for st in stats.values():
        st["ops_per_s"] = round(st["ops"] / st["seconds"], 1) if st["seconds"] else 0.0
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--routes", default="native,fuse", help="comma separated: native, fuse")
    p.add_argument("--first-seed", type=int, default=1000, help="seeds below 1000 are what make test runs")
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    routes = [r for r in a.routes.split(",") if r]
    if "fuse" in routes and not _fuse_usable():
        print("soak: FUSE is not usable here (root, /dev/fuse, fusermount3); native only", file=sys.stderr)
        routes = [r for r in routes if r != "fuse"]
    try:
        stats = soak(a.minutes, routes, a.first_seed, a.servers)
    except Divergence as exc:
        print(f"soak: DIVERGENCE\n{exc}", file=sys.stderr)
        return 1
    for name, st in stats.items():
        print(f"{name:<8} {st['seeds']:>6} seeds {st['ops']:>8} ops {st['ops_per_s']:>8} ops/s "
              f"{st['bytes_compared'] / 1e9:>8.2f} GB compared")
    if a.json:
        write_json(stats, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
