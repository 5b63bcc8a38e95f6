"""The checkpoint mover's metrics: ``stripefs mover --metrics`` uploading a real staged
checkpoint, scraped while it works. No timing is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

import torch

from stripefs import staging
from stripefs._cli_top import Endpoint, scrape


def test_the_mover_counts_what_it_uploads_and_its_backlog(cluster: Any, testdir: str, tmp_path: Any) -> None:
    sdir = str(tmp_path / "staging")
    url = f"{testdir}/step-1"
    state = {"w": torch.randn(300_000), "b": torch.arange(1000)}
    h = staging.save(state, url, staging_dir=sdir, cluster=cluster.file, upload=False, background_mover=False)
    assert h.wait(60, durable="local")
    h._done.wait(60)
    payload = 300_000 * 4 + 1000 * 8
    mover = subprocess.Popen([sys.executable, "-m", "stripefs", "mover", "--staging", sdir, "--cluster", cluster.file,
                              "--interval", "0.3", "--metrics", "127.0.0.1:0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert mover.stderr is not None
        line = mover.stderr.readline()
        found = re.search(r"metrics at http://(\S+)/metrics", line)
        assert found, f"the mover did not say where its metrics are: {line!r}"
        endpoint = Endpoint("mover", "mover", found.group(1))
        # A standalone mover runs 10 steps of CPU priority below its shell (--nice): the
        # whole process, so a dataloader's reads on the same cores go first.
        with open(f"/proc/{mover.pid}/stat") as f:
            nice = int(f.read().rsplit(")", 1)[1].split()[16])
        assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
        deadline = time.monotonic() + 60
        while True:
            s = scrape(endpoint)
            assert not s.error, s.error
            committed = s.total("stripefs_mover_checkpoints_total", outcome="committed")
            backlog = s.total("stripefs_mover_backlog_checkpoints")
            assert committed + backlog == 1, (committed, backlog)  # the one checkpoint: waiting or done
            if committed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert committed == 1
        assert s.total("stripefs_mover_uploaded_bytes_total") >= payload
        assert s.total("stripefs_mover_backlog_bytes") == 0 and s.total("stripefs_mover_lag_seconds") == 0
        assert s.total("stripefs_mover_last_commit_replicas") == 1  # every chunk on its one replica
        assert s.total("stripefs_mover_degraded_commits_total") == 0
        assert s.total("stripefs_mover_checkpoints_total", outcome="failed") == 0
    finally:
        mover.terminate()
        mover.wait(30)
    loaded = staging.load(staging.latest(testdir, cluster=cluster.file), cluster=cluster.file, prefer_local=False)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
