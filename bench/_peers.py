"""Peer file systems, started and stopped by the benchmark itself.

``glusterfs`` (one brick, FUSE client), ``moosefs`` (master + 2 chunkservers, 1 copy, FUSE
client, all inside a network namespace because MooseFS refuses 127.0.0.1) and ``s3fs``
(fsspec over a moto S3 server). Each start either yields a working mount/endpoint or raises
``RouteSkipped`` with the reason; a peer is never faked.

Caveats:
    * GlusterFS and MooseFS need root and their Debian packages (``glusterfs-server``,
      ``moosefs-master moosefs-chunkserver moosefs-client``); s3fs needs ``moto[server]``,
      ``s3fs`` and ``boto3`` in this interpreter's environment.
    * MooseFS daemons and ``mfsmount`` run in a network namespace of their own (``nsenter
      --net``, not ``ip netns exec``, which would also hide the mount in a new mount namespace).
    * Cold reads: the benchmark drops the kernel page cache before every read workload, and
      random reads use ``O_DIRECT``; GlusterFS's client-side io-cache and quick-read are
      switched off (they would serve re-reads from the mount process). MooseFS's mount reads
      ahead into its own buffers only after 10 MiB of sequential reads of a file
      (``mfsreadaheadtrigger``): random reads and whole-file dataset reads never start it.
    * A glusterd already running on this machine (port 24007) makes the peer skip rather than
      touch someone else's daemon.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
from typing import Any

from ._route_base import Route, RouteSkipped, RunEnv, wait_for

__all__ = ["GlusterRoute", "MooseRoute", "S3Route"]


def _run(args: list[str], what: str, timeout: float = 60) -> str:
    """Run a set-up command; RouteSkipped with its output when it fails."""
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RouteSkipped(f"{what}: {exc}") from exc
    if p.returncode != 0:
        raise RouteSkipped(f"{what}: `{' '.join(args)}` failed: {(p.stderr or p.stdout).strip()[-300:]}")
    return p.stdout


def _need(*programs: str, package: str) -> None:
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        raise RouteSkipped(f"{', '.join(missing)} not installed (apt-get install {package})")
    if os.geteuid() != 0:
        raise RouteSkipped("needs root (mounts and daemons)")


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class GlusterRoute(Route):
    name = "glusterfs"
    servers = 1

    def __init__(self) -> None:
        self.p = ""
        self.steps: list[list[str]] = []  # undo commands, run in reverse

    def start(self, env: RunEnv) -> dict[str, Any]:
        _need("glusterd", "gluster", package="glusterfs-server")
        if _port_open("127.0.0.1", 24007):
            raise RouteSkipped("a glusterd is already running here (port 24007)")
        self.p = p = os.path.join(env.workdir, "glusterfs")
        os.makedirs(os.path.join(p, "wd"), exist_ok=True)
        for where in ("mnt", "mnt-ro"):
            os.makedirs(os.path.join(p, where), exist_ok=True)
        with open("/etc/glusterfs/glusterd.vol") as f:
            vol = f.read()
        lines = [ln for ln in vol.splitlines() if "working-directory" not in ln]
        at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("type "))
        lines.insert(at + 1, f"    option working-directory {p}/wd")
        with open(os.path.join(p, "glusterd.vol"), "w") as f:
            f.write("\n".join(lines) + "\n")
        host, vol_name = socket.gethostname(), f"gvbench{env.run_id}"
        cli = ["gluster", "--mode=script"]
        try:
            _run(["glusterd", "-f", f"{p}/glusterd.vol", "-p", f"{p}/glusterd.pid"], "glusterd")
            self.steps.append(["kill-pidfile", f"{p}/glusterd.pid"])
            wait_for(lambda: _port_open("127.0.0.1", 24007), 30, "glusterd")
            _run(cli + ["volume", "create", vol_name, f"{host}:{p}/brick1", "force"], "gluster create")
            self.steps.append(cli + ["volume", "delete", vol_name])
            # The client's own caches (io-cache, quick-read) keep file data in the mount
            # process, where dropping the kernel's page cache cannot reach it: off, so that
            # GlusterFS reads are as cold as everyone else's.
            for option in ("performance.io-cache", "performance.quick-read"):
                _run(cli + ["volume", "set", vol_name, option, "off"], f"gluster set {option}")
            _run(cli + ["volume", "start", vol_name], "gluster start")
            self.steps.append(cli + ["volume", "stop", vol_name, "force"])
            for where, options in (("mnt", []), ("mnt-ro", ["-o", "ro"])):  # the dataset is read read-only
                _run(["mount", "-t", "glusterfs", *options, f"{host}:/{vol_name}", f"{p}/{where}"], "gluster mount")
                self.steps.append(["umount", "-l", f"{p}/{where}"])
        except BaseException:
            self.stop()
            raise
        return {"kind": "posix", "root": os.path.join(p, "mnt", "bench"),
                "dataset_root": os.path.join(p, "mnt-ro", "bench")}

    def stop(self) -> None:
        while self.steps:
            step = self.steps.pop()
            if step[0] == "kill-pidfile":
                try:
                    with open(step[1]) as f:
                        os.kill(int(f.read().strip()), signal.SIGTERM)
                except (OSError, ValueError):
                    pass
                # the brick process (glusterfsd) is stopped by `volume stop`
            else:
                subprocess.run(step, capture_output=True, timeout=60)


_MFS_IP = "10.77.2.1"
_MFS_PORTS = {"ml": 19419, "cs": 19420, "cl": 19421}


def _mounted(proc: subprocess.Popen[bytes], mnt: str, log: str) -> bool:
    """Whether ``proc``'s FUSE mount is up at ``mnt``; RouteSkipped once it exited."""
    if proc.poll() is not None:
        raise RouteSkipped(f"the mount of {mnt} exited with status {proc.returncode} (see {log})")
    return os.path.ismount(mnt)


def stop_mount(proc: subprocess.Popen, mountpoint: str) -> None:
    """Unmount a FUSE client's mountpoint (lazily) and end its process (killed past 10 s)."""
    subprocess.run(["umount", "-l", mountpoint], capture_output=True, timeout=30)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class MooseRoute(Route):
    name = "moosefs"
    servers = 2

    def __init__(self) -> None:
        self.ns = ""
        self.p = ""
        self.mounts: list[tuple[subprocess.Popen[bytes], str]] = []
        self.daemons: list[list[str]] = []

    def _write(self, name: str, text: str) -> str:
        path = os.path.join(self.p, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def start(self, env: RunEnv) -> dict[str, Any]:
        _need("mfsmaster", "mfschunkserver", "mfsmount", "ip",
              package="moosefs-master moosefs-chunkserver moosefs-client")
        empty = "/var/lib/mfs/metadata.mfs.empty"
        if not os.path.exists(empty):
            raise RouteSkipped(f"moosefs: {empty} missing (moosefs-master install incomplete)")
        self.p = p = os.path.join(env.workdir, "moosefs")
        self.ns = f"mfsbench{env.run_id}"
        for d in ("master", "cs0", "cs1", "hdd0", "hdd1", "mnt", "mnt-ro"):
            os.makedirs(os.path.join(p, d), exist_ok=True)
        shutil.copy(empty, os.path.join(p, "master", "metadata.mfs"))
        common = "WORKING_USER = root\nWORKING_GROUP = root\n"
        self._write("mfsexports.cfg", "* / rw,alldirs,maproot=0:0\n")
        master = self._write("master.cfg", common + f"DATA_PATH = {p}/master\n"
                             f"EXPORTS_FILENAME = {p}/mfsexports.cfg\n" + "".join(
                                 f"MATO{k.upper()}_LISTEN_HOST = {_MFS_IP}\n"
                                 f"MATO{k.upper()}_LISTEN_PORT = {port}\n"
                                 for k, port in _MFS_PORTS.items()))
        ns = ["ip", "netns", "exec", self.ns]
        try:
            _run(["ip", "netns", "add", self.ns], "moosefs netns")
            self.daemons.append(["ip", "netns", "del", self.ns])
            _run(["ip", "-n", self.ns, "link", "set", "lo", "up"], "moosefs netns lo")
            _run(["ip", "-n", self.ns, "addr", "add", f"{_MFS_IP}/32", "dev", "lo"], "moosefs addr")
            _run(ns + ["mfsmaster", "-c", master, "start"], "mfsmaster")
            self.daemons.append(ns + ["mfsmaster", "-c", master, "stop"])
            for i in range(2):
                self._write(f"mfshdd{i}.cfg", f"{p}/hdd{i}\n")
                cs = self._write(f"cs{i}.cfg", common + f"DATA_PATH = {p}/cs{i}\n"
                                 f"HDD_CONF_FILENAME = {p}/mfshdd{i}.cfg\n"
                                 f"MASTER_HOST = {_MFS_IP}\nMASTER_PORT = {_MFS_PORTS['cs']}\n"
                                 f"BIND_HOST = {_MFS_IP}\nCSSERV_LISTEN_HOST = {_MFS_IP}\n"
                                 f"CSSERV_LISTEN_PORT = {19422 + i}\n")
                _run(ns + ["mfschunkserver", "-c", cs, "start"], f"mfschunkserver {i}")
                self.daemons.append(ns + ["mfschunkserver", "-c", cs, "stop"])
            # only the *network* namespace: the FUSE mounts land in ours, visible to clients;
            # the dataset is read through a second, read-only mount (as FuseRoute does)
            netns = ["nsenter", f"--net=/run/netns/{self.ns}"]
            for where, options in (("mnt", []), ("mnt-ro", ["-o", "ro"])):
                with open(os.path.join(p, "mfsmount.log"), "ab") as log:
                    proc = subprocess.Popen(netns + ["mfsmount", "-f", f"{p}/{where}", "-H", _MFS_IP,
                                                     "-P", str(_MFS_PORTS["cl"]), *options],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
                self.mounts.append((proc, f"{p}/{where}"))
            for proc, mnt in self.mounts:
                wait_for(functools.partial(_mounted, proc, mnt, f"{p}/mfsmount.log"), 30, "moosefs mount")
            _run(netns + ["mfssetgoal", "-r", "1", f"{p}/mnt"], "mfssetgoal")
        except BaseException:
            self.stop()
            raise
        return {"kind": "posix", "root": os.path.join(p, "mnt", "bench"),
                "dataset_root": os.path.join(p, "mnt-ro", "bench")}

    def stop(self) -> None:
        while self.mounts:
            stop_mount(*self.mounts.pop())
        while self.daemons:
            subprocess.run(self.daemons.pop(), capture_output=True, timeout=60)


class S3Route(Route):
    name = "s3fs"
    servers = 1

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, env: RunEnv) -> dict[str, Any]:
        moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
        if not os.path.exists(moto):
            moto = shutil.which("moto_server") or ""
        try:
            import boto3
            import s3fs  # noqa: F401
        except ImportError as exc:
            raise RouteSkipped(f"s3fs: {exc} (pip install 'moto[server]' s3fs boto3)") from exc
        if not moto:
            raise RouteSkipped("s3fs: moto_server not installed (pip install 'moto[server]')")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(os.path.join(env.workdir, "moto.log"), "ab")
        self.proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _port_open("127.0.0.1", port), 30, "moto_server")
            # s3fs's mkdir trips over moto's location constraint: make the bucket with boto3
            boto3.client("s3", endpoint_url=url, aws_access_key_id="x", aws_secret_access_key="x",
                         region_name="us-east-1").create_bucket(Bucket="bench")
        except BaseException:
            self.stop()
            raise
        return {"kind": "fsspec", "cls": "s3fs:S3FileSystem", "root": f"bench/{env.run_id}",
                "options": {"client_kwargs": {"endpoint_url": url}, "key": "x", "secret": "x",
                            "use_listings_cache": False}}

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
