"""Everyday tools on a mount: ``python -m stripefs.bench.tools_bench``.

Times what people do on a shared file system besides training, on the stripefs FUSE
mount of a local cluster, on MooseFS (``--peers``; started from Debian's packages as the
benchmark's peer) and on the local disk, one after the other in the same run:

* ``tar -x`` of a real source tree (the installed numpy package, packed once first);
* ``rsync -a`` of ``/usr/share/doc/`` into the mount, then the same again (nothing to copy:
  every file is only stat'ed);
* ``rm -rf`` of both trees.

Each step runs as the tool's own process (the kernel sees the same requests as from a
user's shell); the times are wall seconds, and every tree is checked afterwards (file count
and bytes of a sample) so a fast wrong answer cannot pass. Example::

    python -m stripefs.bench.tools_bench --peers --json tools.json

A hand tool for issue-sized questions (docs/benchmarks.md), not part of ``stripefs bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

from stripefs.fsclient import Client
from stripefs.fsclient.testing import LocalCluster

from ._peers import MooseRoute
from ._route_base import Route, RouteSkipped, RunEnv
from ._routes import FuseRoute, LocalDiskRoute

STEPS = ("tar -x", "rsync -a", "rsync -a again", "rm -rf")


def _numpy_dir() -> str:
    import numpy

    return os.path.dirname(numpy.__file__)


def _tree(path: str) -> tuple[int, int]:
    """(entries, bytes of regular files) under ``path``."""
    entries = size = 0
    for dirpath, dirs, files in os.walk(path):
        entries += len(dirs) + len(files)
        for name in files:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                size += os.path.getsize(p)
    return entries, size


def _timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    took = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({p.returncode}): {(p.stderr or p.stdout)[-500:]}")
    return took


def run_tools(root: str, tarball: str, src_tree: tuple[int, int], doc: str) -> dict[str, float]:
    """The four steps under ``root`` (an empty directory of the file system measured)."""
    out: dict[str, float] = {}
    tar_dst, rsync_dst = os.path.join(root, "tar"), os.path.join(root, "doc")
    os.makedirs(tar_dst)
    out["tar -x"] = _timed(["tar", "-x", "-f", tarball, "-C", tar_dst])
    got = _tree(tar_dst)
    if got != src_tree:
        raise RuntimeError(f"tar -x left {got} (entries, bytes), the archive holds {src_tree}")
    out["rsync -a"] = _timed(["rsync", "-a", doc + "/", rsync_dst + "/"])
    out["rsync -a again"] = _timed(["rsync", "-a", doc + "/", rsync_dst + "/"])
    if _tree(rsync_dst)[0] != _tree(doc)[0]:
        raise RuntimeError("rsync -a copied a different number of entries")
    out["rm -rf"] = _timed(["rm", "-rf", tar_dst, rsync_dst])
    if os.listdir(root):
        raise RuntimeError(f"rm -rf left {os.listdir(root)}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m stripefs.bench.tools_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", action="store_true", help="also MooseFS (needs root and moosefs-* packages)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--data-sync", choices=("full", "none"), default="full")
    ap.add_argument("--metadata-sync", choices=("full", "normal"), default="full")
    ap.add_argument("--doc", default="/usr/share/doc", help="the tree rsync copies")
    ap.add_argument("--json", help="write the results as JSON")
    a = ap.parse_args(argv)
    missing = [t for t in ("tar", "rsync", "rm") if shutil.which(t) is None]
    if missing:
        ap.error(f"{', '.join(missing)} not installed (apt-get install {' '.join(missing)})")
    results: dict[str, Any] = {"steps": list(STEPS), "routes": {}, "skipped": {},
                               "data_sync": a.data_sync, "metadata_sync": a.metadata_sync}
    with tempfile.TemporaryDirectory(prefix="tools-bench-") as work:
        tarball = os.path.join(work, "numpy.tar")
        with tarfile.open(tarball, "w") as tf:
            tf.add(_numpy_dir(), arcname="numpy")
        entries, size = _tree(_numpy_dir())
        src_tree = (entries + 1, size)  # and the top directory itself
        results["tree"] = {"tar_entries": src_tree[0], "doc_entries": _tree(a.doc)[0]}
        cluster = LocalCluster.start(os.path.join(work, "cluster"), servers=a.servers, data_sync=a.data_sync,
                                      metadata_sync=a.metadata_sync)
        env = RunEnv(os.path.join(work, "cluster", "cluster.json"), work, str(os.getpid()), a.servers)
        routes: list[Route] = [FuseRoute(), LocalDiskRoute()] + ([MooseRoute()] if a.peers else [])
        try:
            with Client(env.cluster_file) as c:
                c.makedirs(FuseRoute()._root(env), exist_ok=True)
            for route in routes:
                try:
                    spec = route.start(env)
                except RouteSkipped as exc:
                    results["skipped"][route.name] = str(exc)
                    print(f"{route.name}: skipped ({exc})", file=sys.stderr)
                    continue
                try:
                    root = os.path.join(spec["root"], "tools")
                    os.makedirs(root, exist_ok=True)
                    results["routes"][route.name] = run_tools(root, tarball, src_tree, a.doc)
                finally:
                    route.stop()
                print(route.name, {k: round(v, 2) for k, v in results["routes"][route.name].items()}, flush=True)
        finally:
            cluster.down()
    _print_table(results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def _print_table(results: dict[str, Any]) -> None:
    routes = results["routes"]
    both = "fuse" in routes and "moosefs" in routes
    head = "| step | " + " | ".join(routes) + (" | stripefs FUSE ÷ MooseFS |" if both else " |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for step in results["steps"]:
        cells = [f"{routes[r][step]:.2f} s" for r in routes]
        if both:
            cells.append(f"{routes['fuse'][step] / max(routes['moosefs'][step], 1e-9):.1f}×")
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
