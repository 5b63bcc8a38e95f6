"""Resolving paths under a stripefs FUSE mount through mountinfo and the mount state file."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.batchread import ReadRing, mount_state_path, resolve_mounted
from stripefs.wire import StripefsError


def fake_mount(tmp_path, fstype: str = "fuse.stripefs", pid: int | None = None, cluster_file: str = "/c.json",
               state: bool = True) -> tuple[str, str, str]:
    """A directory posing as a mount: (mountpoint, mountinfo file, state dir)."""
    mp = tmp_path / "mnt point"  # a space: mountinfo escapes it as \\040
    (mp / "sub").mkdir(parents=True)
    (mp / "sub" / "x.bin").write_bytes(b"x")
    info = tmp_path / "mountinfo"
    esc = str(mp).replace(" ", "\\040")
    info.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        f"90 22 0:50 / {esc} rw,nosuid,nodev shared:9 - {fstype} stripefs rw,user_id=0\n"
    )
    sdir = tmp_path / "state"
    sdir.mkdir()
    if state:
        with open(mount_state_path(str(mp), str(sdir)), "w") as f:
            json.dump({"mountpoint": str(mp), "cluster_file": cluster_file, "pid": pid or os.getpid(), "root": "/data"}, f)
    return str(mp), str(info), str(sdir)


def test_resolves_cluster_inode_and_path(tmp_path) -> None:
    mp, info, sdir = fake_mount(tmp_path)
    target = os.path.join(mp, "sub", "x.bin")
    mf = resolve_mounted(target, mountinfo=info, state_dir=sdir)
    assert mf.cluster_file == "/c.json" and mf.mountpoint == mp
    assert mf.ino == os.stat(target).st_ino and mf.path == "/data/sub/x.bin"
    assert os.path.basename(mount_state_path(mp, sdir)).startswith("%2F")


def test_not_a_stripefs_mount(tmp_path) -> None:
    mp, info, sdir = fake_mount(tmp_path, fstype="ext4")
    with pytest.raises(StripefsError, match="not on a stripefs FUSE mount") as exc:
        resolve_mounted(os.path.join(mp, "sub"), mountinfo=info, state_dir=sdir)
    assert exc.value.errno == errno.EINVAL
    mp2, info2, sdir2 = fake_mount(tmp_path / "b", state=False)
    with pytest.raises(StripefsError, match="without a stripefs state file"):
        resolve_mounted(mp2, mountinfo=info2, state_dir=sdir2)


def test_dead_daemon_is_stale(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mp, info, sdir = fake_mount(tmp_path, pid=dead.pid)
    with pytest.raises(StripefsError) as exc:
        resolve_mounted(mp, mountinfo=info, state_dir=sdir)
    assert exc.value.errno == errno.ESTALE


def test_open_mounted_refuses_another_cluster(cluster, tmp_path) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"metadata": {"host": "127.0.0.1", "port": 1}, "secret": "s"}))
    mp, info, sdir = fake_mount(tmp_path, cluster_file=str(other))
    with Client(cluster.file) as client:
        ring = ReadRing(client)
        with pytest.raises(StripefsError) as exc:
            ring.open_mounted(os.path.join(mp, "sub", "x.bin"), mountinfo=info, state_dir=sdir)
        assert exc.value.errno == errno.EXDEV
