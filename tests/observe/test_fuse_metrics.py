"""A FUSE mount's metrics endpoint and access log during a real workload through the mount."""

from __future__ import annotations

import os
from typing import Any

import pytest

from stripefs import cli
from stripefs._cli_profile import summarize
from stripefs._cli_top import endpoints, scrape
from stripefs.fsclient.fuse import main as fuse_main, mounted_fstype

from ..fuse.fuse_helpers import fuse_unusable

_SKIP = fuse_unusable()
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)

N = 16
ROUNDS = 20  # reads of each file
SIZE = 5000


def test_mount_counts_its_requests_and_logs_them(metered: Any, tmp_path: Any,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    mp, log = str(tmp_path / "mnt"), str(tmp_path / "fuse.log")
    os.makedirs(mp)
    # direct_io: every read reaches the daemon (no page cache in between), so N reads are N requests.
    assert fuse_main(["mount", mp, "--cluster", metered.file, "-o", "direct_io", "--metrics", "127.0.0.1:0",
                      "--access-log", log]) == 0
    try:
        [fuse] = [e for e in endpoints(metered.file) if e.role == "fuse"]
        assert fuse.name == f"fuse {mp}"
        payload = os.urandom(SIZE)
        os.makedirs(f"{mp}/data/train")
        for i in range(N):
            with open(f"{mp}/data/train/f{i}", "wb") as f:
                f.write(payload)
        before = scrape(fuse)
        for _ in range(ROUNDS):
            for i in range(N):
                with open(f"{mp}/data/train/f{i}", "rb") as f:
                    assert f.read() == payload
        after = scrape(fuse)
        assert not before.error and not after.error
        def moved(name: str, **match: str) -> float:
            return after.total(name, **match) - before.total(name, **match)

        assert moved("stripefs_fuse_ops_total", op="open") >= N * ROUNDS
        assert moved("stripefs_fuse_ops_total", op="read") >= N * ROUNDS
        assert moved("stripefs_fuse_bytes_total", op="read") == N * SIZE * ROUNDS
        assert moved("stripefs_fuse_op_seconds_count", op="read") >= N
        # Every open decided about the kernel's pages.
        decided = moved("stripefs_fuse_page_cache_opens_total", decision="keep") + moved(
            "stripefs_fuse_page_cache_opens_total", decision="drop")
        assert decided == moved("stripefs_fuse_ops_total", op="open") >= N * ROUNDS
        # The daemon's collector is tuned (rpc._settings.quiet_collector): a young collection
        # every 35,000 allocations, not every 700, so a full one (which stopped every reader
        # of the mount for 10-15 ms) comes 50x less often; none in this workload.
        assert moved("python_gc_collections_total", generation="0") == 0  # 3 with the default threshold
        assert cli.main(["top", "--once", "--interval", "0.1", "--cluster", metered.file]) == 0
        assert f"fuse {mp}" in capsys.readouterr().out
    finally:
        if mounted_fstype(mp) is not None:
            assert fuse_main(["umount", mp]) == 0  # the daemon writes out its log as it exits
    summary = summarize(open(log))
    by_op = {r["op"]: r for r in summary["by_op"]}
    assert by_op["write"]["bytes"] == N * SIZE
    assert by_op["read"]["bytes"] == N * SIZE * ROUNDS
    assert by_op["open"]["count"] >= N
    assert summary["hot_dirs"][0]["dir"] == "/data/train"
