"""Mount records: what a running mount daemon leaves on disk for others to find.

Two records describe a mount, both JSON, both written atomically:

* the daemon's own record, next to the user's cluster state
  (``<state dir>/stripefs/mounts/<sha1(mountpoint)[:16]>.json``):
  ``{"pid", "start", "mount_id", "mountpoint", "log", "cluster_file", "root"}``.
  ``stripefs umount`` reads it to find the daemon; the batch reader reads it to find
  the cluster. ``start`` is the daemon's start time (:func:`process_start`): a pid
  alone may have been reused by an unrelated process once the daemon died.
* the published state file for other programs (any writer may produce it)::

    $STRIPEFS_MOUNT_STATE_DIR/<quote(mountpoint, safe="")>.json   (default dir /run/stripefs/mounts)
    {"mountpoint": "/mnt/data", "cluster_file": "/srv/c/cluster.json", "pid": 12345, "root": "/"}

  ``quote`` is ``urllib.parse.quote``: ``/mnt/data`` becomes ``%2Fmnt%2Fdata.json``.

Nothing here imports pyfuse3: readers of records need no FUSE library.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any
from urllib.parse import quote

from ..core import default_state_file, mounts, pid_alive

__all__ = [
    "MOUNT_STATE_DIR", "mount_state_path", "record_path", "mount_record", "write_mount_record",
    "remove_mount_record", "mounted_fstype", "process_start", "daemon_alive",
]

MOUNT_STATE_DIR = "/run/stripefs/mounts"


def mount_state_path(mountpoint: str, state_dir: str | None = None) -> str:
    """The published state file for ``mountpoint``."""
    base = state_dir or os.environ.get("STRIPEFS_MOUNT_STATE_DIR") or MOUNT_STATE_DIR
    return os.path.join(base, quote(os.path.abspath(mountpoint), safe="") + ".json")


def record_path(mountpoint: str, *, create_dir: bool = False) -> str:
    """The daemon's own record for ``mountpoint`` (an absolute path)."""
    d = os.path.join(os.path.dirname(default_state_file()), "mounts")
    if create_dir:
        os.makedirs(d, exist_ok=True)
    return os.path.join(d, hashlib.sha1(mountpoint.encode()).hexdigest()[:16] + ".json")


def mount_record(mountpoint: str) -> dict[str, Any] | None:
    """The daemon record of ``mountpoint``, or None when there is none (or it is unreadable)."""
    try:
        with open(record_path(os.path.abspath(mountpoint))) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_mount_record(mountpoint: str, record: dict[str, Any]) -> str:
    """Publish the daemon record for ``mountpoint`` atomically; returns its path."""
    path = record_path(mountpoint, create_dir=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return path


def remove_mount_record(mountpoint: str) -> None:
    try:
        os.unlink(record_path(mountpoint))
    except FileNotFoundError:
        pass


def mounted_fstype(mountpoint: str) -> str | None:
    """The file system type mounted exactly at ``mountpoint`` (works on dead FUSE mounts)."""
    mountpoint = os.path.abspath(mountpoint)
    found = None
    for mp, fstype in mounts():
        if mp == mountpoint:
            found = fstype
    return found


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat`` field 22), or None.

    A pid is reused once its process is gone; (pid, start time) names one process
    for as long as the machine runs.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces and parentheses: split after its last ")".
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def daemon_alive(pid: int | None, start: int | None) -> bool:
    """Is the daemon that recorded ``(pid, start)`` still running?

    With ``start`` (every record and orphan name written since it was added), a live
    process with that pid but another start time is an unrelated process that reused
    the pid: dead. Without it (an older record), any live process with the pid counts
    as alive, the safe side for both callers (nothing is removed or signalled wrongly
    except a stale orphan that is kept).
    """
    if pid is None or not pid_alive(pid):
        return False
    return start is None or process_start(pid) == start
