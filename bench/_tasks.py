"""The table of workloads a client process can run, and their untimed preparation.

``WORKLOADS`` maps a workload name to its function (``bench._workloads`` for the classic
ones, ``bench._seed`` for the seed workloads); ``PREPARE`` holds, for each cold read
workload, what must be written before the benchmark process drops the caches; ``CLEANUP``
what a workload leaves behind, removed in a call of its own (so that its CPU is not counted
as the workload's); ``FINISH`` what a workload adds to its records once they are aggregated.
"""

from __future__ import annotations

from typing import Any

from ._seed import SEED, SEED_CLEANUP, SEED_FINISH, SEED_PARTS, SEED_PREPARE
from ._sessions import Session
from ._workloads import CLASSIC, CLASSIC_PREPARE, ClientContext, PartResult

__all__ = ["WORKLOADS", "PREPARE", "CLEANUP", "FINISH", "BATCH_PARTS", "run_workload", "record_names"]

WORKLOADS = {**CLASSIC, **SEED}
PREPARE = {**CLASSIC_PREPARE, **SEED_PREPARE}
CLEANUP = dict(SEED_CLEANUP)
FINISH = dict(SEED_FINISH)

# Produced only by routes whose sessions batch metadata calls (bench._sessions.BatchedSession).
BATCH_PARTS = ["meta_create_batch", "meta_stat_batch", "meta_unlink_batch"]
_PARTS = {"metadata": ["meta_create", "meta_stat", "meta_readdir", "meta_unlink", *BATCH_PARTS],
          "mixed": ["mixed_read", "mixed_write"],
          "burst_interference": ["burst_alone", "burst_interference", "burst_write_alone", "burst_write"], **SEED_PARTS}


def record_names(workload: str) -> list[str]:
    """The record names a workload produces (``BATCH_PARTS`` on batching routes only)."""
    return _PARTS.get(workload, [workload])


def run_workload(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    """Run ``task['workload']`` in this client (only its preparation when ``task['prepare']``,
    only its clean-up when ``task['cleanup']``).

    Raises:
        KeyError: an unknown workload.
    """
    if task.get("prepare"):
        PREPARE[task["workload"]](s, task, ctx)
        return {}
    if task.get("cleanup"):
        CLEANUP[task["workload"]](s, task, ctx)
        return {}
    return WORKLOADS[task["workload"]](s, task, ctx)
