"""``stripefs mount`` and ``stripefs umount``.

``stripefs mount MOUNTPOINT [--cluster C] [--foreground] [-o opt,opt=val]``
checks what it can before mounting (``/dev/fuse``, the mount point, the
cluster) so failures read clearly, then starts the daemon detached (unless
``--foreground``) and returns only once the mount answers a ``stat``, or with
the daemon's error. ``stripefs umount MOUNTPOINT [--lazy]`` unmounts, clears a
mount whose daemon died (``Transport endpoint is not connected``), and waits
for the daemon to finish.

Stopping: on SIGTERM, SIGINT or SIGHUP, and when the kernel ends the mount
(unmount, or the last handle closed after a lazy unmount), the daemon drains
every file still open -- write-behind buffers sent, lengths committed -- before
it exits, so a file held open (a log) keeps everything written to it.

Options (``-o``): ours are ``attr_timeout=S``, ``entry_timeout=S``,
``direct_io``, ``readahead_kb=N``, ``write_buffer_mb=N``, ``qos=interactive|bulk|background``
(the class of the mount's chunk writes at the storage servers), ``ro`` (a read-only mount:
the kernel refuses every change, and the daemon tells it a close needs no FLUSH); anything
else (``allow_other``, ...) goes to libfuse. ``default_permissions`` is always on.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from stripefs.wire import StripefsError, messages as m

from ..core import Client, find_cluster
from ._mounts import (daemon_alive, mount_record, mounted_fstype, process_start, record_path, remove_mount_record,
                      write_mount_record)

READY_TIMEOUT = 30.0
# Seconds umount waits for the daemon to exit. After a lazy detach with files still open,
# umount returns after this long and the daemon goes on serving them until the last close.
UMOUNT_WAIT = 15.0
STOP_WAIT = 30.0  # seconds umount then waits for a signalled daemon to commit its open files and exit


class MountError(Exception):
    """A mount or unmount that cannot proceed; the message says why."""


# -- options ---------------------------------------------------------------------------------
def parse_options(opts: list[str]) -> tuple[Any, set[str]]:
    """Split ``-o`` values into our :class:`FuseConfig` and the libfuse option set."""
    from ._operations import FuseConfig

    cfg = FuseConfig()
    fuse_opts = {"default_permissions", "fsname=stripefs", "subtype=stripefs"}
    if os.getuid() == 0:
        fuse_opts.add("allow_other")  # a root daemon serves every user of the node
    for opt in (o.strip() for group in opts for o in group.split(",")):
        key, _, value = opt.partition("=")
        try:
            if key in ("attr_timeout", "entry_timeout"):
                setattr(cfg, key, float(value))
            elif key == "readahead_kb":
                cfg.readahead_kb = int(value)
            elif key == "write_buffer_mb":
                cfg.write_buffer_mb = int(value)
                if cfg.write_buffer_mb <= 0:
                    raise ValueError
            elif key == "direct_io":
                cfg.direct_io = True
            elif key == "qos":
                if value not in m.QOS_CLASSES:
                    raise MountError(f"bad mount option {opt!r}: qos is one of {', '.join(m.QOS_CLASSES)}")
                cfg.qos = value
            elif key == "noallow_other":
                fuse_opts.discard("allow_other")
            elif key in ("ro", "rw"):
                cfg.read_only = key == "ro"  # the last one given counts, as for mount(8)
                fuse_opts.discard("rw" if key == "ro" else "ro")
                fuse_opts.add(key)
            elif opt:
                fuse_opts.add(opt)
        except ValueError:
            raise MountError(f"bad mount option {opt!r}") from None
    return cfg, fuse_opts


# -- mount -----------------------------------------------------------------------------------
def preflight(mountpoint: str, cluster: str | None) -> None:
    """Fail early and clearly: no /dev/fuse, bad or busy mount point, unreachable cluster."""
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        raise MountError(f"cannot use /dev/fuse: {exc.strerror} (is the fuse module loaded / the device passed in?)") from None
    if mounted_fstype(mountpoint) is not None:
        raise MountError(f"{mountpoint} is busy: something is already mounted there (stripefs umount {mountpoint})")
    if not os.path.isdir(mountpoint):
        raise MountError(f"mount point {mountpoint} is not an existing directory")
    try:
        with Client(cluster) as c:
            c.call(m.Statfs(), timeout=5.0)
    except StripefsError as exc:
        raise MountError(f"cluster unreachable: {exc.message}") from None
    except OSError as exc:
        raise MountError(f"cluster unreachable: {exc}") from None


def serve(mountpoint: str, cluster: str | None, options: list[str], ready_fd: int | None = None, *,
          metrics: str | None = None, access_log: str | None = None) -> int:
    """Run the daemon in this process until unmounted or signalled; ``metrics`` (HOST:PORT)
    serves Prometheus metrics, ``access_log`` (a file) logs every request (``_observe.py``)."""
    import pyfuse3
    import trio

    from ._operations import StripeOperations

    cfg, fuse_opts = parse_options(options)
    client = Client(cluster, qos=cfg.qos)
    ops = StripeOperations(client, cfg)
    from stripefs.rpc._metrics import serve_metrics
    from stripefs.rpc._settings import quiet_collector

    from ..core._accesslog import AccessLog
    from ._observe import observe

    served = serve_metrics(metrics, role="fuse") if metrics else None
    alog = AccessLog(access_log) if access_log else None
    observe(ops, access_log=alog, metrics=served is not None)
    # cluster_file lets fsclient.batchread map files under the mount to (cluster, inode).
    # start + mount_id: umount and the orphan clean-up of other mounts tell this daemon
    # from a process that reuses its pid after it is gone.
    record = {"pid": os.getpid(), "start": process_start(os.getpid()), "mount_id": ops.mount_id,
              "mountpoint": mountpoint, "log": os.environ.get("STRIPEFS_MOUNT_LOG"),
              "cluster_file": client.config.path, "root": "/"}
    if served is not None:
        record["metrics"] = "%s:%d" % served
    write_mount_record(mountpoint, record)

    def tell(text: str) -> None:
        if ready_fd is not None:
            try:
                os.write(ready_fd, text.encode() + b"\n")
                os.close(ready_fd)
            except OSError:
                pass

    try:
        pyfuse3.init(ops, mountpoint, fuse_opts)
    except RuntimeError as exc:
        tell(f"error: FUSE mount of {mountpoint} failed: {exc}")
        client.close()
        _remove_own_record(mountpoint)
        return 1

    async def announce() -> None:
        # The mount answers once the kernel's INIT is served by pyfuse3.main below.
        st = await trio.to_thread.run_sync(os.stat, mountpoint)
        _set_readahead(st.st_dev, cfg.readahead_kb)
        removed = await ops.clean_orphans()
        if removed:
            logging.info("removed %d stale orphans", removed)
        tell("ok")

    async def signals(sigs: Any) -> None:
        async for signum in sigs:
            logging.info("%s: committing open files, then stopping", signal.Signals(signum).name)
            pyfuse3.terminate()

    async def main() -> None:
        # The receiver stays installed until the drain below is done: a second signal must
        # not kill the daemon (the default action) while it commits the open files.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            try:
                async with trio.open_nursery() as nursery:
                    ops.attach(nursery)  # background work (storage connections, listings) until the loop ends
                    nursery.start_soon(announce)
                    nursery.start_soon(signals, sigs)
                    await pyfuse3.main(min_tasks=4, max_tasks=64)
                    nursery.cancel_scope.cancel()
            finally:
                # Whatever ended the loop (a signal, an unmount, the last handle of a lazily
                # detached mount, an error): no handle can reach the open files any more, so
                # their buffered bytes are sent and their lengths committed now or never.
                with trio.CancelScope(shield=True):
                    drained = await ops.drain()
                if drained:
                    logging.info("committed %d file(s) still open at exit", drained)

    quiet_collector()  # a full collection stopped every reader of the mount for 10-15 ms
    try:
        trio.run(main)
    except BaseException as exc:
        tell(f"error: daemon failed: {exc!r}")
        raise
    finally:
        pyfuse3.close(unmount=mounted_fstype(mountpoint) is not None)
        if alog is not None:
            alog.close()
        client.close()
        _remove_own_record(mountpoint)
    return 0


def _remove_own_record(mountpoint: str) -> None:
    """Remove the mount record if it is still this daemon's. After a lazy unmount this
    daemon may serve its open files long after ``umount`` returned, and the mount point may
    carry a new mount (with its own daemon's record) by the time it exits."""
    record = mount_record(mountpoint)
    if record is not None and record.get("pid") == os.getpid():
        remove_mount_record(mountpoint)


def _set_readahead(dev: int, kb: int) -> None:
    """Raise the kernel readahead of the mount (its bdi), so sequential reads come as
    large, parallel FUSE requests instead of 128 KiB ones. Needs root; best effort."""
    if kb <= 0:
        return
    try:
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", "w") as f:
            f.write(str(kb))
    except OSError as exc:
        logging.info("readahead unchanged: %s", exc)


def mount(mountpoint: str, cluster: str | None, options: list[str], foreground: bool, *,
          metrics: str | None = None, access_log: str | None = None) -> int:
    mountpoint = os.path.abspath(mountpoint)
    parse_options(options)  # bad options fail here, not in the daemon
    preflight(mountpoint, cluster)
    if cluster is None:  # the daemon resolves the same cluster even if the "last cluster" changes
        cluster = find_cluster(None).path or os.environ.get("STRIPEFS_CLUSTER")
    if foreground:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return serve(mountpoint, cluster, options, metrics=metrics, access_log=access_log)
    log_path = record_path(mountpoint, create_dir=True)[:-5] + ".log"
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "stripefs.fsclient.fuse", "mount", mountpoint, "--foreground", "--ready-fd", str(w)]
    if cluster:
        cmd += ["--cluster", cluster]
    for opt in options:
        cmd += ["-o", opt]
    if metrics:
        cmd += ["--metrics", metrics]
    if access_log:
        cmd += ["--access-log", os.path.abspath(access_log)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "STRIPEFS_MOUNT_LOG": log_path,
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, pass_fds=(w,),
                                start_new_session=True, cwd="/", env=env)
    os.close(w)
    answer = _read_ready(r, proc)
    if answer != "ok":
        if proc.poll() is None:
            proc.terminate()
        raise MountError(answer.removeprefix("error: ") or f"daemon exited with status {proc.poll()} (log: {log_path})")
    return 0


def _read_ready(fd: int, proc: subprocess.Popen[bytes]) -> str:
    import select

    deadline = time.monotonic() + READY_TIMEOUT
    data = b""
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
                if data.endswith(b"\n"):
                    break
        else:
            return f"the mount did not answer within {READY_TIMEOUT:.0f}s"
    finally:
        os.close(fd)
    return data.decode(errors="replace").strip()


# -- umount ----------------------------------------------------------------------------------
def umount(mountpoint: str, lazy: bool = False) -> int:
    mountpoint = os.path.abspath(mountpoint)
    fstype = mounted_fstype(mountpoint)
    record = mount_record(mountpoint)
    if fstype is None:
        raise MountError(f"{mountpoint} is not mounted")
    if not fstype.startswith("fuse"):
        raise MountError(f"{mountpoint} is a {fstype} mount, not stripefs")
    pid = record.get("pid") if record else None
    start = record.get("start") if record else None
    # (pid, start time): a dead daemon's pid may belong to an unrelated process by now.
    dead = not daemon_alive(pid, start)
    res = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if res.returncode != 0:
        if not (lazy or dead):
            raise MountError(f"cannot unmount {mountpoint}: {res.stderr.strip()} (files open? try --lazy)")
        # A dead daemon's mount, or asked to: detach now, the kernel drops it when unused.
        res = subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True, text=True)
        if res.returncode != 0:
            res = subprocess.run(["umount", "-l", mountpoint], capture_output=True, text=True)
        if res.returncode != 0:
            raise MountError(f"cannot unmount {mountpoint}: {res.stderr.strip()}")
    if pid is not None and not dead:
        # The daemon exits once the kernel ends the mount: at once after a plain unmount,
        # after the last close of a handle after a lazy one.
        if not _wait_exit(pid, start, 0.5):
            if lazy:
                _leave_serving(mountpoint, pid, start)
            elif not _wait_exit(pid, start, UMOUNT_WAIT):
                # Unmounted, yet still running: stop it. It drains every open file (buffered
                # bytes sent, lengths committed) before it exits; wait for that too, so the
                # commits are done when umount returns.
                print(f"stripefs umount: the daemon of {mountpoint} (pid {pid}) still runs after {UMOUNT_WAIT:.0f}s; "
                      "stopping it (it commits the files still open first)", file=sys.stderr)
                if daemon_alive(pid, start):
                    os.kill(pid, signal.SIGTERM)
                if not _wait_exit(pid, start, STOP_WAIT):
                    print(f"stripefs umount: daemon {pid} still running after {STOP_WAIT:.0f}s", file=sys.stderr)
    remove_mount_record(mountpoint)
    return 0


def _leave_serving(mountpoint: str, pid: int, start: int | None) -> None:
    """After a lazy detach: wait up to ``UMOUNT_WAIT`` for the last open file to close, then
    return with the daemon still serving the files open through it.

    The daemon is never signalled here: a lazy unmount detaches the name only, and files
    opened before it keep working (reads, writes, fsync) for as long as they stay open --
    hours for a log or a dataloader. The kernel ends the mount at the last close; the
    daemon then commits what is left and exits by itself.
    """
    print(f"stripefs umount: {mountpoint} detached; waiting up to {UMOUNT_WAIT:.0f}s for its open "
          "files to close", file=sys.stderr)
    if not _wait_exit(pid, start, UMOUNT_WAIT):
        print(f"stripefs umount: files are still open; the daemon (pid {pid}) keeps serving them and exits "
              "after the last one is closed", file=sys.stderr)


def _wait_exit(pid: int, start: int | None, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the daemon ``(pid, start)`` to exit; True once it has."""
    deadline = time.monotonic() + timeout
    while True:
        _reap(pid)
        if not daemon_alive(pid, start):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# -- entry point -----------------------------------------------------------------------------
def build_parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"stripefs {cmd}")
    p.add_argument("mountpoint")
    if cmd == "mount":
        p.add_argument("--cluster", help="cluster.json path or host:port (default: STRIPEFS_CLUSTER, last `stripefs up`)")
        p.add_argument("--foreground", "-f", action="store_true", help="serve in this process, do not detach")
        p.add_argument("-o", dest="options", action="append", default=[], help="mount options, comma separated")
        p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
        p.add_argument("--metrics", metavar="HOST:PORT",
                       help="serve Prometheus metrics there (PORT 0: any free port; off by default)")
        p.add_argument("--access-log", metavar="FILE",
                       help="log every request to FILE (bounded; `stripefs profile FILE` sums it up; off by default)")
    else:
        p.add_argument("--lazy", "-l", action="store_true", help="detach now even if files are open")
    return p


def main(argv: list[str]) -> int:
    """``argv[0]`` is ``mount`` or ``umount``. Returns the exit status."""
    if not argv or argv[0] not in ("mount", "umount"):
        print("usage: stripefs mount|umount MOUNTPOINT ...", file=sys.stderr)
        return 2
    cmd = argv[0]
    a = build_parser(cmd).parse_args(argv[1:])
    try:
        if cmd == "umount":
            return umount(a.mountpoint, a.lazy)
        if a.ready_fd is not None:  # the detached daemon started by `mount`
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
            return serve(os.path.abspath(a.mountpoint), a.cluster, a.options, a.ready_fd,
                         metrics=a.metrics, access_log=a.access_log)
        return mount(a.mountpoint, a.cluster, a.options, a.foreground, metrics=a.metrics,
                     access_log=os.path.abspath(a.access_log) if a.access_log else None)
    except (MountError, StripefsError) as exc:
        print(f"stripefs {cmd}: {exc}", file=sys.stderr)
        return 1

