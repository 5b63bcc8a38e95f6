"""Routes into a file system, started and stopped by the benchmark process.

A :class:`Route` turns a running stripefs cluster (or nothing, for ``local_disk`` and the
peers) into a picklable session *spec* for the client processes. A route that cannot run on
this machine raises :class:`RouteSkipped` with the reason, which the report carries: nothing
is ever faked.

Routes: ``native`` (fsclient.Client), ``fsspec`` (fsclient.fsspec.StripeFileSystem),
``fuse`` (a ``stripefs mount`` this route makes), ``zerocopy`` (fsclient.batchread rings),
``local_disk`` (the same workloads on a local directory). Peers live in ``bench._peers``.
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


class FuseRoute(Route):
    """A ``stripefs mount --foreground`` of the cluster, unmounted at ``stop``."""

    name = "fuse"
    on_cluster = True

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.mnt: str | None = None

    def start(self, env: RunEnv) -> dict[str, Any]:
        cluster = self._cluster(env)
        need_module("pyfuse3", self.name)
        need_module("stripefs.fsclient.fuse", self.name)
        if not os.path.exists("/dev/fuse"):
            raise RouteSkipped("fuse: /dev/fuse is missing")
        self.mnt = os.path.join(env.workdir, f"fuse-mnt-{env.servers}")
        os.makedirs(self.mnt, exist_ok=True)
        log = open(os.path.join(env.workdir, "fuse-mount.log"), "ab")
        daemon_env = {k: v for k, v in os.environ.items() if k != "STRIPEFS_ATTR_TIMEOUT"}  # the kernel caches here
        self.proc = subprocess.Popen(_cli("mount", self.mnt, "--cluster", cluster, "--foreground"), env=daemon_env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        proc = self.proc

        def mounted() -> bool:
            if proc.poll() is not None:
                raise RouteSkipped(f"fuse: stripefs mount exited with status {proc.returncode} "
                                   f"(see {env.workdir}/fuse-mount.log)")
            return os.path.ismount(self.mnt or "")

        try:
            wait_for(mounted, 30, "fuse mount")
        except RouteSkipped:
            self.stop()
            raise
        return {"kind": "posix", "root": os.path.join(self.mnt, self._root(env).lstrip("/"))}

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    def stop(self) -> None:
        if self.mnt and os.path.ismount(self.mnt):
            subprocess.run(_cli("umount", self.mnt), capture_output=True, timeout=30)
            if os.path.ismount(self.mnt):
                subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True,
                               timeout=30)
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
