"""Resolving a path under a stripefs FUSE mount to (cluster, inode): the ``hf3fs_reg_fd`` analogue.

Users of a mount get the fast path for the same files: the batch reader finds
the mount that holds a path in ``/proc/self/mountinfo``, learns the cluster
from a small state file the mount daemon writes, and takes the inode from
``os.stat`` (the FUSE daemon uses stripefs inode numbers as FUSE inode numbers).

The state files and daemon records are described in :mod:`fsclient.fuse._mounts`.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass

from stripefs.wire import ErrorCode, StripefsError

from ..core import mounts, pid_alive
from ..fuse._mounts import mount_state_path, record_path

__all__ = ["MountedFile", "resolve_mounted"]


@dataclass(frozen=True, slots=True)
class MountedFile:
    """Where a mounted path lives in stripefs."""

    cluster_file: str
    ino: int
    path: str  # the stripefs path (root + path inside the mount); informative only
    mountpoint: str


def _inside(path: str, mountpoint: str) -> bool:
    return mountpoint == "/" or path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")


def resolve_mounted(path: str, *, mountinfo: str = "/proc/self/mountinfo", state_dir: str | None = None) -> MountedFile:
    """Map a path under a stripefs FUSE mount to its cluster file and inode.

    Args:
        path: a local path (relative paths are taken from the working directory).
        mountinfo: the mount table to read (tests pass their own).
        state_dir: where mount state files live (default: ``$STRIPEFS_MOUNT_STATE_DIR``
            or ``/run/stripefs/mounts``).

    Returns:
        A :class:`MountedFile`.

    Raises:
        StripefsError: INVALID when the path is not on a FUSE mount with a stripefs
            state file; STALE_ROUTING (ESTALE) when the state file names a dead daemon;
            FileNotFoundError for a missing path.
    """
    real = os.path.realpath(path)
    best = None
    for mp, fstype in mounts(mountinfo):
        if _inside(real, mp) and (best is None or len(mp) > len(best[0])):
            best = (mp, fstype)
    if best is None or not best[1].startswith("fuse"):
        raise StripefsError(ErrorCode.INVALID, "not on a stripefs FUSE mount", path)
    mp = best[0]
    state_file = mount_state_path(mp, state_dir)
    if state_dir is None and not os.path.exists(state_file) and os.path.exists(record_path(mp)):
        state_file = record_path(mp)  # the record of `stripefs mount` carries the cluster file too
    try:
        with open(state_file) as f:
            state = json.load(f)
        cluster_file, pid = str(state["cluster_file"]), int(state["pid"])
        root = str(state.get("root") or "/")
    except FileNotFoundError:
        raise StripefsError(ErrorCode.INVALID, f"{mp} is a FUSE mount without a stripefs state file ({state_file})", path) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StripefsError(ErrorCode.INVALID, f"unreadable mount state file {state_file}: {exc}", path) from exc
    if not pid_alive(pid):
        raise StripefsError(ErrorCode.STALE_ROUTING, f"mount daemon of {mp} (pid {pid}) is gone", path)
    ino = os.stat(real).st_ino
    inner = os.path.relpath(real, mp)
    spath = posixpath.normpath(posixpath.join(root, "" if inner == "." else inner))
    return MountedFile(cluster_file, ino, spath, mp)
