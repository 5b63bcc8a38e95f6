"""The page store across processes and faults: a second process's pages, a writer killed
with SIGKILL in the middle of its batches, a page corrupted on disk or in its file, a put
whose storage is gone."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.testing import LocalCluster
from stripefs.kvcache import PageStore
from stripefs.wire import StripefsError

from ..conftest import flip_chunk_byte
from .conftest import page_of

PS = 64 * 1024
WRITER = str(Path(__file__).with_name("writer_proc.py"))


def writer(cluster: LocalCluster, ns: str, prefix: str, rounds: int, batch: int,
           capacity: int = 4096 * PS) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, WRITER, cluster.file, ns, str(PS), str(capacity), prefix, str(rounds),
                             str(batch)], stdout=subprocess.PIPE, text=True)


def check(store: PageStore, keys: list[bytes]) -> list[bool]:
    bufs = [bytearray(PS) for _ in keys]
    hits = store.batch_get_into(keys, bufs)
    for k, b, hit in zip(keys, bufs, hits):
        assert not hit or bytes(b) == page_of(k, PS), k  # never a half or foreign page
    return hits


def test_another_process_puts_this_one_gets(cluster: LocalCluster, client: Client, ns: str) -> None:
    proc = writer(cluster, ns, "p", rounds=2, batch=20)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == ["start", "0", "done", "0", "start", "1", "done", "1"]
    with PageStore(client, ns, PS, 4096 * PS) as store:
        assert check(store, [f"p-{r}-{i}".encode() for r in range(2) for i in range(20)]) == [True] * 40


def test_a_writer_killed_mid_batch_leaves_no_half_page(cluster: LocalCluster, client: Client, ns: str) -> None:
    rng = random.Random(7)
    with PageStore(client, ns, PS, 4096 * PS) as store:
        for attempt in range(3):
            proc = writer(cluster, ns, f"k{attempt}", rounds=0, batch=48)
            assert proc.stdout is not None
            lines = []
            while not any(line.startswith("start 2") for line in lines):  # two whole batches, then kill in the third
                lines.append(proc.stdout.readline().strip())
            time.sleep(rng.uniform(0.0, 0.15))
            proc.send_signal(signal.SIGKILL)
            lines += proc.communicate(timeout=30)[0].split("\n")
            done = {int(x.split()[1]) for x in lines if x.startswith("done")}
            last = max(int(x.split()[1]) for x in lines if x.startswith("start"))
            assert {0, 1} <= done
            for r in range(last + 1):
                hits = check(store, [f"k{attempt}-{r}-{i}".encode() for i in range(48)])
                if r in done:
                    assert all(hits), r  # a batch that returned is all there


def _segment_path(client: Client, store: PageStore, key: bytes) -> str:
    target = client.stat(f"{store.ns.dir}/idx/{key.hex()}", follow=False).target
    assert target is not None
    return store.ns.seg_path(target.split(":")[0])


def test_a_corrupted_page_is_a_counted_miss(cluster: LocalCluster, client: Client, ns: str) -> None:
    with PageStore(client, ns, PS, 64 * PS) as store:
        keys = [b"on-disk", b"in-file", b"entry", b"fine"]
        for k in keys:  # one segment each
            store.batch_put([k], [page_of(k, PS)])
        # 1. A byte of the page flipped in its chunk file on a storage server (below every checksum).
        ino = client.stat(_segment_path(client, store, b"on-disk")).ino
        assert flip_chunk_byte([s["root"] for s in cluster.data["servers"]], ino, 100) == 1
        # 2. The page rewritten through the file system (the storage checksums agree with it),
        # 3. and a page's table entry (after the one page of its segment) likewise.
        for key, at in ((b"in-file", 100), (b"entry", PS + 30)):
            with client.open(_segment_path(client, store, key), "r+b") as f:
                f.seek(at)
                f.write(b"\x00garbage")
        bufs = [bytearray(b"\xee" * PS) for _ in keys]
        assert store.batch_get_into(keys, bufs) == [False, False, False, True]
        assert [bytes(b) == bytes(PS) for b in bufs[:3]] == [True] * 3  # zeroed, never the bad bytes
        s = store.stats()
        assert (s.checksum_failures, s.misses, s.hits, s.read_errors) == (3, 3, 1, 0)


def test_a_put_that_cannot_be_stored_raises(make_cluster: Callable[..., LocalCluster], ns: str) -> None:
    h = make_cluster(servers=2)
    with h.client(retry_for=1.0) as c, PageStore(c, ns, PS, 64 * PS) as store:
        store.batch_put([b"before"], [page_of(b"before", PS)])
        for s in h.data["servers"]:
            os.kill(s["pid"], signal.SIGKILL)
        with pytest.raises(StripefsError):
            store.batch_put([b"a", b"b"], [page_of(b"a", PS), page_of(b"b", PS)])
        assert store.exists([b"a", b"b"]) == [False, False]
        assert store.stats().puts == 1
