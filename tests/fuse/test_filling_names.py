"""A directory the mount is filling gets its names fetched under a listing lease
(``fsclient/fuse/_listings.py``: ``filling``): the kernel's lookup before each create is
answered "no such name" by the daemon instead of a round trip each, and another client's
change to the directory is seen at once all the same (it takes the lease back first)."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest

from ..conftest import metadata_requests

FILES = 40


def _lookups(cluster_file: str) -> float:
    return metadata_requests(cluster_file, "Lookup")


def test_filling_a_directory_costs_no_lookup_per_new_name(metered_mount: Any) -> None:
    cluster, mp = metered_mount
    with cluster.client() as c:
        c.makedirs("/fill")  # made elsewhere: the mount knows none of its names
        before = _lookups(cluster.file)
        for i in range(FILES):
            with open(f"{mp}/fill/f{i}", "wb") as f:
                f.write(b"%d" % i * 100)
        looked_up = _lookups(cluster.file) - before
        # Two lookups that said "no such name" make it a directory being filled; the
        # names are fetched once and the other creates ask nothing (each asked before).
        assert looked_up <= 5, f"{looked_up:.0f} lookups for {FILES} new names"
        assert sorted(c.listdir("/fill")) == sorted(f"f{i}" for i in range(FILES))
        for i in range(FILES):
            assert c.read_bytes(f"/fill/f{i}") == b"%d" % i * 100


def test_another_clients_change_is_seen_at_once_in_a_directory_being_filled(metered_mount: Any) -> None:
    cluster, mp = metered_mount
    with cluster.client() as c:
        c.makedirs("/fill")
        for i in range(6):  # enough misses for the names to be fetched under a lease
            with open(f"{mp}/fill/f{i}", "wb") as f:
                f.write(b"ours")
        assert not os.path.exists(f"{mp}/fill/theirs")  # answered from the leased names
        c.write_bytes("/fill/theirs", b"made elsewhere")  # takes the mount's lease back first
        with open(f"{mp}/fill/theirs", "rb") as f:
            assert f.read() == b"made elsewhere"
        c.rename("/fill/theirs", "/fill/moved")
        assert os.path.exists(f"{mp}/fill/moved") and not os.path.exists(f"{mp}/fill/theirs")
        # The mount goes on filling the directory after the lease was taken back.
        for i in range(6, 12):
            with open(f"{mp}/fill/f{i}", "wb") as f:
                f.write(b"ours")
        assert sorted(os.listdir(f"{mp}/fill")) == sorted([f"f{i}" for i in range(12)] + ["moved"])
        assert sorted(c.listdir("/fill")) == sorted([f"f{i}" for i in range(12)] + ["moved"])


def test_a_name_too_long_is_refused_where_the_names_are_known(mnt: str, testdir: str) -> None:
    """The kernel checks no name length: a "no such name" from known names must not let
    a create of a 256-byte name through (the service refused it at its lookup)."""
    d = f"{mnt}{testdir}/made_here"
    os.mkdir(d)  # made through the mount: its names (none) are known
    with pytest.raises(OSError) as info:
        os.open(f"{d}/" + "n" * 256, os.O_CREAT | os.O_WRONLY)
    assert info.value.errno == errno.ENAMETOOLONG
    os.close(os.open(f"{d}/" + "n" * 255, os.O_CREAT | os.O_WRONLY))
    assert os.listdir(d) == ["n" * 255]
