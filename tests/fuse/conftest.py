"""Real FUSE mounts of the test cluster, made with the `stripefs mount` command itself."""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

import pytest

from stripefs.fsclient.fuse import main as fuse_main, mounted_fstype

from ..conftest import metadata_metric
from .fuse_helpers import fuse_unusable


_SKIP = fuse_unusable()
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)


def do_mount(mountpoint: str, cluster_file: str, *opts: str) -> None:
    os.makedirs(mountpoint, exist_ok=True)
    args = ["mount", mountpoint, "--cluster", cluster_file]
    for o in opts:
        args += ["-o", o]
    assert fuse_main(args) == 0, f"stripefs mount {mountpoint} failed"


def do_umount(mountpoint: str) -> None:
    if mounted_fstype(mountpoint) is not None:
        if fuse_main(["umount", mountpoint]) != 0:
            fuse_main(["umount", mountpoint, "--lazy"])


@pytest.fixture(scope="session")
def mnt(cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The shared cluster, mounted once for the session. Yields the mount point."""
    mp = str(tmp_path_factory.mktemp("mnt"))
    do_mount(mp, cluster.file)
    yield mp
    do_umount(mp)


@pytest.fixture
def mdir(mnt: str, testdir: str) -> str:
    """A fresh directory for one test, seen through the mount."""
    return mnt + testdir


def until_mount_leases(cluster_file: str, path: str, timeout: float = 30.0) -> None:
    """Until a lookup of ``path`` through a mount of the metered cluster ``cluster_file``
    is granted a lease (the daemon's lease watch is live: until then its answers carry the
    mount's plain timeouts). ``path``'s entry must not be in the kernel's cache already."""
    deadline = time.monotonic() + timeout
    while True:
        before = metadata_metric(cluster_file, "stripefs_metadata_lease_grants_total")
        os.stat(path)
        if metadata_metric(cluster_file, "stripefs_metadata_lease_grants_total") > before:
            return
        assert time.monotonic() < deadline, "the mount's lease watch did not start"
        time.sleep(0.05)


@pytest.fixture
def metered_mount(metered_cluster: Any, tmp_path: Any) -> Iterator[tuple[Any, str]]:
    """``metered_cluster``, mounted: yields (cluster, mount point)."""
    mp = str(tmp_path / "mnt")
    do_mount(mp, metered_cluster.file)
    try:
        yield metered_cluster, mp
    finally:
        do_umount(mp)
