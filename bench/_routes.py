"""Routes into a file system, started and stopped by the benchmark process.

A :class:`Route` turns a running stripefs cluster (or nothing, for ``local_disk`` and the
peers) into a picklable session *spec* for the client processes. A route that cannot run on
this machine raises :class:`RouteSkipped` with the reason, which the report carries: nothing
is ever faked.

Routes: ``native`` (fsclient.Client), ``fsspec`` (fsclient.fsspec.StripeFileSystem),
``fuse`` (two mounts this route makes: the dataset is read through a read-only one),
``zerocopy`` (fsclient.batchread rings), ``local_disk`` (the same workloads on a local
directory). Peers live in ``bench._peers``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from . import _peers
from ._route_base import Route, RouteSkipped, RunEnv, need_module, wait_for

__all__ = ["Route", "RouteSkipped", "RunEnv", "ROUTES", "PEERS", "make_route", "wait_for"]


class NativeRoute(Route):
    name = "native"
    on_cluster = True

    def start(self, env: RunEnv) -> dict[str, Any]:
        return {"kind": "native", "cluster": self._cluster(env), "root": self._root(env)}


class ZerocopyRoute(Route):
    name = "zerocopy"
    on_cluster = True

    def start(self, env: RunEnv) -> dict[str, Any]:
        need_module("stripefs.fsclient.batchread", self.name)
        return {"kind": "zerocopy", "cluster": self._cluster(env), "root": self._root(env)}


class FsspecRoute(Route):
    name = "fsspec"
    on_cluster = True

    def start(self, env: RunEnv) -> dict[str, Any]:
        need_module("stripefs.fsclient.fsspec", self.name)
        return {"kind": "fsspec", "cls": "stripefs.fsclient.fsspec:StripeFileSystem",
                "options": {"cluster": self._cluster(env)}, "root": self._root(env)}


class LocalDiskRoute(Route):
    """The same workloads on the local file system under the scratch directory."""

    name = "local_disk"

    def start(self, env: RunEnv) -> dict[str, Any]:
        root = os.path.join(env.workdir, "local_disk")
        os.makedirs(root, exist_ok=True)
        return {"kind": "posix", "root": root}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "stripefs.fsclient.fuse", *args]


class FuseMount:
    """One ``stripefs mount --foreground`` of a cluster at ``mnt`` (``-o options``), its
    daemon's output in ``log``; ``stop`` unmounts it and waits for the daemon."""

    def __init__(self, cluster: str, mnt: str, options: str, log: str):
        os.makedirs(mnt, exist_ok=True)
        self.mnt = mnt
        args = _cli("mount", mnt, "--cluster", cluster, "--foreground") + (["-o", options] if options else [])
        env = {k: v for k, v in os.environ.items() if k != "STRIPEFS_ATTR_TIMEOUT"}  # the kernel caches here
        with open(log, "ab") as out:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)

    def wait_mounted(self, timeout: float = 30) -> None:
        """Return once mounted; RouteSkipped when the daemon exits or ``timeout`` passes."""
        def mounted() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RouteSkipped(f"fuse: stripefs mount of {self.mnt} exited with status {self.proc.returncode}")
            return os.path.ismount(self.mnt)

        wait_for(mounted, timeout, "fuse mount")

    def stop(self) -> None:
        if os.path.ismount(self.mnt):
            subprocess.run(_cli("umount", self.mnt), capture_output=True, timeout=30)
            if os.path.ismount(self.mnt):
                subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True, timeout=30)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None


class FuseRoute(Route):
    """Two ``stripefs mount``s of the cluster, as a training job mounts it: the dataset
    read through a read-only one (``-o ro``), everything else through a read-write one;
    both unmounted at ``stop``."""

    name = "fuse"
    on_cluster = True

    def __init__(self) -> None:
        self.mounts: list[FuseMount] = []

    def start(self, env: RunEnv) -> dict[str, Any]:
        cluster = self._cluster(env)
        need_module("pyfuse3", self.name)
        need_module("stripefs.fsclient.fuse", self.name)
        if not os.path.exists("/dev/fuse"):
            raise RouteSkipped("fuse: /dev/fuse is missing")
        log = os.path.join(env.workdir, "fuse-mount.log")
        try:
            for where, options in ((f"fuse-mnt-{env.servers}", ""), (f"fuse-ro-{env.servers}", "ro")):
                self.mounts.append(FuseMount(cluster, os.path.join(env.workdir, where), options, log))
            for mount in self.mounts:
                mount.wait_mounted()
        except RouteSkipped as exc:
            self.stop()
            raise RouteSkipped(f"{exc} (see {log})") from exc
        root = self._root(env).lstrip("/")
        rw, ro = (os.path.join(mount.mnt, root) for mount in self.mounts)
        return {"kind": "posix", "root": rw, "dataset_root": ro}

    def pids(self) -> list[int]:
        return [mount.proc.pid for mount in self.mounts if mount.proc is not None]

    def stop(self) -> None:
        while self.mounts:
            self.mounts.pop().stop()


ROUTES = ["native", "fsspec", "fuse", "zerocopy", "local_disk"]
PEERS = ["glusterfs", "moosefs", "s3fs"]


def make_route(name: str) -> Route:
    """A fresh route object by name. Raises ValueError for an unknown name."""
    table: dict[str, type[Route]] = {
        "native": NativeRoute, "fsspec": FsspecRoute, "fuse": FuseRoute,
        "zerocopy": ZerocopyRoute, "local_disk": LocalDiskRoute,
        "glusterfs": _peers.GlusterRoute, "moosefs": _peers.MooseRoute, "s3fs": _peers.S3Route,
    }
    if name not in table:
        raise ValueError(f"unknown route {name!r}; choose from {', '.join(table)}")
    return table[name]()
