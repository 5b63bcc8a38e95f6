"""Shared buffers across processes: fork and spawn, several rings reading at once."""

from __future__ import annotations

import pickle

import pytest

from .brhelpers import random_reads, ring_child, spawn_ctx
from stripefs.fsclient.batchread import SharedBuffer


def test_buffer_pickles_by_name_and_maps_the_same_memory() -> None:
    with SharedBuffer(10_000) as buf:
        assert buf.size % 4096 == 0 and buf.size >= 10_000
        other = pickle.loads(pickle.dumps(buf))
        assert other.name == buf.name and not other.owner
        other.view[:5] = b"hello"
        assert buf.view[:5] == b"hello" and buf.numpy()[:5].tobytes() == b"hello"
        other.unlink()  # not the owner: a no-op
        other.close()
        assert buf.view[:5] == b"hello"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_concurrent_rings_in_several_processes(cluster, files: dict[str, bytes], method: str) -> None:
    nproc = 3
    plans, pos = [], 0
    for k in range(nproc):
        plan = []
        for p, o, n in random_reads(files, 25, seed=100 + k, max_len=200_000):
            n = max(0, min(n, len(files[p]) - o))  # exact counts, so the child can check them
            plan.append((p, o, n, pos))
            pos += n
        plans.append(plan)
    with SharedBuffer(pos + 1) as buf:
        ctx = spawn_ctx(method)
        procs = [ctx.Process(target=ring_child, args=(cluster.file, buf, plan)) for plan in plans]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * nproc
        for plan in plans:
            for path, o, n, b in plan:
                assert buf.view[b : b + n] == files[path][o : o + n]
