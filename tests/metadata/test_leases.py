"""Lease locks in the store (every backend), and through clients (real cluster, kill -9)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from stripefs.metadata._locks import Leases
from stripefs.metadata._store import Store
from stripefs.wire._errors import StripefsError

A, B = b"owner-a!", b"owner-b!"
S = 1_000_000_000


@pytest.fixture
def leases(store: Store) -> Leases:
    return Leases(store)


def test_one_holder_at_a_time_with_growing_fencing_tokens(leases: Leases) -> None:
    t1 = leases.acquire("/ckpt", A, 10 * S, now_ns=0).token
    with pytest.raises(BlockingIOError):
        leases.acquire("/ckpt", B, 10 * S, now_ns=5 * S)
    assert leases.acquire("/ckpt", A, 10 * S, now_ns=5 * S).token == t1  # renewal keeps the token
    with pytest.raises(BlockingIOError):
        leases.acquire("/ckpt", B, 10 * S, now_ns=14 * S)  # renewed until 15 s
    t2 = leases.acquire("/ckpt", B, 10 * S, now_ns=15 * S).token  # expired: B takes it
    assert t2 > t1
    assert not leases.release("/ckpt", A)  # A's lease is gone; nothing to release
    assert leases.release("/ckpt", B)
    t3 = leases.acquire("/ckpt", A, 10 * S, now_ns=16 * S).token
    assert t3 > t2  # the token never goes back, even after a release
    assert leases.acquire("/other", B, 10 * S, now_ns=16 * S).token == 1  # keys are independent


def test_bad_lease_requests_are_refused(leases: Leases) -> None:
    for key, owner, ttl in (("", A, S), ("k\x00", A, S), ("k", b"short", S), ("k", A, 1), ("k", A, 7200 * S)):
        with pytest.raises(StripefsError) as info:
            leases.acquire(key, owner, ttl)
        assert info.value.errno == errno.EINVAL


def test_client_leases_exclude_each_other_and_release_on_close(cluster) -> None:
    with cluster.client() as c1, cluster.client() as c2:
        key = f"/leases/{os.getpid()}-close"
        lease = c1.lease(key, ttl=0.6)
        assert lease.held
        with pytest.raises(BlockingIOError):
            c2.lease(key, ttl=0.6, wait=False)
        time.sleep(1.0)  # longer than the TTL: the renewal thread keeps it
        with pytest.raises(BlockingIOError):
            c2.lease(key, wait=False)
        assert lease.held
        c1.close()  # the session ends
        with c2.lease(key, ttl=1.0, wait=False) as l2:
            assert l2.token > lease.token
        with c2.lease(key, ttl=1.0, timeout=1.0) as l3:  # released by the with block
            assert l3.held


def test_a_killed_holder_loses_its_lease_after_the_ttl(cluster) -> None:
    key = f"/leases/{os.getpid()}-kill"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time, fsclient
        c = fsclient.Client({cluster.file!r})
        c.lease({key!r}, ttl=1.0)
        print("held", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with cluster.client() as c:
            with pytest.raises(BlockingIOError):
                c.lease(key, wait=False)
            os.kill(holder.pid, signal.SIGKILL)
            t = time.monotonic()
            with c.lease(key, ttl=1.0, timeout=10.0):
                waited = time.monotonic() - t
        assert waited < 5.0
    finally:
        holder.kill()
        holder.wait()
