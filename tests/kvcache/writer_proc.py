"""A page store writer in a process of its own (tests/kvcache/test_processes.py).

    python writer_proc.py CLUSTER_FILE NAMESPACE PAGE_SIZE CAPACITY PREFIX ROUNDS BATCH

Puts ROUNDS batches (0: forever) of BATCH pages, keys ``PREFIX-<round>-<i>``, each page
``random.Random(key).randbytes(PAGE_SIZE)``; prints ``start R`` and ``done R`` around each.
"""

from __future__ import annotations

import itertools
import random
import sys

from stripefs.kvcache import PageStore


def main(cluster: str, ns: str, page_size: str, capacity: str, prefix: str, rounds: str, batch: str) -> None:
    ps = int(page_size)
    with PageStore(cluster, ns, ps, int(capacity)) as store:
        for r in itertools.count() if int(rounds) == 0 else range(int(rounds)):
            keys = [f"{prefix}-{r}-{i}".encode() for i in range(int(batch))]
            print(f"start {r}", flush=True)
            store.batch_put(keys, [random.Random(k).randbytes(ps) for k in keys])
            print(f"done {r}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
