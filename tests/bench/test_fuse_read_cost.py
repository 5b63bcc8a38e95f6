"""The mount's small-file read cost hand tool (bench/fuse_read_cost.py) on the shared cluster, small."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from stripefs.bench import fuse_read_cost
from stripefs.fsclient import Client

from ..fuse.fuse_helpers import fuse_unusable


@pytest.mark.skipif(bool(fuse_unusable()) or os.geteuid() != 0, reason="needs FUSE and root (drop_caches)")
@pytest.mark.parametrize("options", ["", "ro"])
def test_a_small_round_is_measured_and_cleaned_up(cluster: Any, tmp_path: Path, options: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cost.json"
    fuse_read_cost.main(["--cluster", cluster.file, "--files", "40", "--rounds", "2", "--mount-options", options,
                         "--json", str(out)])
    rounds = json.loads(out.read_text())["rounds"]
    assert len(rounds) == 2
    with Client(cluster.file) as c:
        servers = len(c.status().servers)
    for r in rounds:
        assert r["files"] == 40 and r["files_per_s"] > 0 and r["readers_us"] > 0
        assert r["daemon_us"] == pytest.approx(sum(t["cpu_us"] for t in r["daemon_threads"])) and r["daemon_us"] > 0
        procs = r["processes_us"]
        assert "metadata" in procs and sum(k.startswith("storage") for k in procs) == servers
        assert sum(procs[k] for k in procs if k.startswith("storage")) > 0  # the reads reached the servers
    assert "files/s" in capsys.readouterr().out
    with Client(cluster.file) as c:
        assert not c.exists("/fuse_read_cost")


def test_thread_cpu_counts_this_process() -> None:
    threads = fuse_read_cost.thread_cpu(os.getpid())
    assert (os.getpid(), next(iter(threads))[1]) in threads
    assert all(cpu >= 0 and u >= 0 and s >= 0 for cpu, u, s in threads.values())
    assert sum(cpu for cpu, _u, _s in threads.values()) > 0


@pytest.mark.parametrize("args", [["--files", "0"], ["--readers", "0"], ["--rounds", "-1"]])
def test_bad_arguments_exit_2(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        fuse_read_cost.main(args)
    assert exc.value.code == 2
