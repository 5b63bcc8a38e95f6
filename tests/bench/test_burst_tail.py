"""The burst-tail hand tool (bench/burst_tail.py) on the shared cluster, small."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from stripefs.bench import burst_tail
from stripefs.fsclient import Client


def test_a_small_burst_beside_a_reader_is_measured_and_cleaned_up(cluster: Any, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bt.json"
    burst_tail.main(["--cluster", cluster.file, "--files", "20", "--size", "24", "--rate", "0.05",
                     "--json", str(out)])
    run = json.loads(out.read_text())["runs"][0]
    assert run["burst"]["bytes"] == 24 << 20 and run["burst"]["gb_per_s"] <= 0.06  # paced
    assert run["alone"]["files"] > 0 and run["during"]["files"] > 0
    assert run["alone"]["p50_ms"] <= run["alone"]["p99_ms"]
    sched = run["sched_during_ms"]
    with Client(cluster.file) as c:
        servers = len(c.status().servers)
    assert {"metadata", "reader 0", "writer"} <= set(sched) and sum(k.startswith("storage") for k in sched) == servers
    assert sched["writer"]["cpu"] > 0 and all(v["run_queue"] >= 0 for v in sched.values())
    assert "during" in capsys.readouterr().out
    with Client(cluster.file) as c:
        assert not c.exists("/burst_tail")  # the dataset and the burst's file are gone


def test_a_staged_checkpoint_is_the_burst_when_asked(cluster: Any, tmp_path: Path) -> None:
    out = tmp_path / "bt.json"
    burst_tail.main(["--cluster", cluster.file, "--files", "20", "--size", "24", "--rate", "0.05", "--staged",
                     "--json", str(out)])
    run = json.loads(out.read_text())["runs"][0]
    burst = run["burst"]
    # The window runs from save() to the commit: the upload, capped at 50 MB/s, is in it.
    assert burst["bytes"] == 24 << 20 and burst["gb_per_s"] <= 0.06
    assert 0 < burst["save_blocked_s"] < burst["seconds"]
    assert run["during"]["files"] > 0 and run["sched_during_ms"]["writer"]["cpu"] > 0
    with Client(cluster.file) as c:
        assert not c.exists("/burst_tail")  # the checkpoint went with the dataset


def test_schedstat_counts_this_process() -> None:
    threads = burst_tail.schedstat(os.getpid())
    assert threads and sum(r for r, _w, _n in threads.values()) > 0


def test_a_thread_that_ended_does_not_make_the_delta_negative() -> None:
    before = {"1": (100, 50, 3), "2": (900, 900, 9)}  # thread 2 ends, thread 3 starts
    after = {"1": (150, 70, 5), "3": (10, 5, 1)}
    assert burst_tail.sched_delta(before, after) == {"cpu": 60 / 1e6, "run_queue": 25 / 1e6, "on_cpu_times": 3}


@pytest.mark.parametrize("args", [["--size", "0"], ["--readers", "0"], ["--rate", "-1"]])
def test_bad_arguments_exit_2(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        burst_tail.main(args)
    assert exc.value.code == 2
