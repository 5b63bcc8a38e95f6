"""Helpers of the batch read tests (importable by child processes under spawn)."""

from __future__ import annotations

import random
from typing import Any

from stripefs.fsclient import Client
from stripefs.fsclient.batchread import ReadRing, SharedBuffer

def random_reads(files: dict[str, bytes], n: int, seed: int, max_len: int = 300_000) -> list[tuple[str, int, int]]:
    """Random (path, offset, length) ranges, some running past EOF."""
    rng = random.Random(seed)
    paths = sorted(files)
    reads = []
    for _ in range(n):
        p = rng.choice(paths)
        size = len(files[p])
        off = rng.randrange(0, size + 1000)
        reads.append((p, off, rng.randrange(0, max_len)))
    return reads


def spawn_ctx(method: str) -> Any:
    import multiprocessing

    return multiprocessing.get_context(method)


def run_in_process(method: str, target: Any, args: tuple) -> None:
    """Run ``target(*args)`` in a child started with ``method``; fail on a non-zero exit."""
    p = spawn_ctx(method).Process(target=target, args=args)
    p.start()
    p.join(120)
    assert p.exitcode == 0, f"child ({method}) exited with {p.exitcode}"


def ring_child(cluster_file: str, buf: SharedBuffer, plan: list[tuple[str, int, int, int]]) -> None:
    """A process with its own client and ring reading ``(path, off, n, buf_pos)`` into a shared buffer."""
    with Client(cluster_file) as client:
        ring = ReadRing(client, entries=64)
        files = {p: ring.open(p) for p in {p for p, _o, _n, _b in plan}}
        counts = ring.read([(buf.slice(b, n), files[p], o, n) for p, o, n, b in plan])
        assert counts == [n for _p, _o, n, _b in plan]
        ring.close()
    buf.close()
