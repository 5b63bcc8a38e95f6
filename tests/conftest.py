"""Shared fixtures: real clusters on loopback (real processes), clients, per-test directories."""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Any, Callable, Iterator

import pytest

# Keep `stripefs up` in tests from touching the user's "last cluster" file.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="stripefs-test-state-")
os.environ.pop("STRIPEFS_CLUSTER", None)

from stripefs.fsclient import Client  # noqa: E402
from stripefs.fsclient.testing import LocalCluster  # noqa: E402

TEST_CHUNK = 256 * 1024  # small chunks so small test files still stripe over every server
_counter = itertools.count()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One 4-server cluster for the whole session (256 KiB chunks)."""
    h = LocalCluster.start(str(tmp_path_factory.mktemp("cluster")), servers=4, chunk_size=TEST_CHUNK, gc_grace=2.0)
    yield h
    h.down()


@pytest.fixture
def make_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalCluster]]:
    """Factory for private clusters (tests that restart or kill servers)."""
    made: list[LocalCluster] = []

    def make(**kw: Any) -> LocalCluster:
        kw.setdefault("servers", 4)
        kw.setdefault("chunk_size", TEST_CHUNK)
        kw.setdefault("gc_grace", 2.0)
        h = LocalCluster.start(str(tmp_path_factory.mktemp("private-cluster")), **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        try:
            h.down()
        except OSError:
            pass


def flip_byte(path: str, at: int) -> None:
    """Damage one byte of a file on disk (every bit of it flipped)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def flip_chunk_byte(roots: list[str], ino: int, at: int, index: int = 0) -> int:
    """Damage byte ``at`` of chunk ``(ino, index)`` in every copy held under the storage
    roots, wherever it lies (a chunk file or a container log). Returns the copies damaged."""
    from stripefs.storage import chunk_places

    done = 0
    for root in roots:
        for i, path, offset in chunk_places(root, ino):
            if i == index:
                flip_byte(path, offset + at)
                done += 1
    return done


@pytest.fixture
def file_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk stores made by this test (in this process or in the servers it starts) keep new
    small chunks in chunk files: tests of the file engine's own layout and crash behaviour
    (the container logs have theirs, tests/core/test_small_chunks.py)."""
    from stripefs.storage import _chunks

    monkeypatch.setattr(_chunks, "SMALL_CHUNKS", "files")
    monkeypatch.setenv("STRIPEFS_SMALL_CHUNKS", "files")  # and the servers a test starts


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    c = cluster.client()
    yield c
    c.close()


@pytest.fixture
def testdir(client: Client, request: pytest.FixtureRequest) -> str:
    """A fresh directory inside the shared cluster for one test."""
    name = "".join(ch if ch.isalnum() else "_" for ch in request.node.name)[:80]
    path = f"/t/{name}-{next(_counter)}-{os.getpid()}"
    client.makedirs(path)
    return path


def metadata_metric(cluster_file: str, name: str, **match: str) -> float:
    """The metadata services' metric ``name`` (its samples matching ``match``, summed; the
    cluster must have been started with ``STRIPEFS_METRICS`` set)."""
    from stripefs._cli_top import endpoints, scrape

    found = [e for e in endpoints(cluster_file) if e.role == "metadata"]
    assert found, "the metadata service serves no metrics"
    total = 0.0
    for e in found:
        s = scrape(e)
        assert not s.error, s.error
        total += s.total(name, **match)
    return total


def metadata_requests(cluster_file: str, msg: str) -> float:
    """``msg`` requests the metadata service has answered so far."""
    return metadata_metric(cluster_file, "stripefs_rpc_requests_total", msg=msg)


def listing_body(i: int, n: int = 3000) -> bytes:
    """File ``/data/f{i}``'s bytes in the leased-listing tests."""
    return (b"file-%04d-" % i * (n // 10 + 1))[:n]


def change_files_elsewhere(cluster: Any, k: int) -> None:
    """Another client changes files of ``/data`` without changing a name there: rewrites
    ``f{k}`` in place (same size, the old mtime put back, as ``cp -p`` leaves it), appends
    ``longer`` to ``f{k+1}``, chmods ``f{k+4}`` to 0600."""
    with cluster.client() as c:
        before = c.stat(f"/data/f{k}")
        with c.open(f"/data/f{k}", "r+b") as f:
            f.write(listing_body(k).upper())
        c.utime(f"/data/f{k}", (before.atime_ns, before.mtime_ns))
        with c.open(f"/data/f{k + 1}", "ab") as f:
            f.write(b"longer")
        c.chmod(f"/data/f{k + 4}", 0o600)


@pytest.fixture
def metered_cluster(make_cluster: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch) -> LocalCluster:
    """A private one-server cluster whose services serve metrics (``metadata_requests``)."""
    monkeypatch.setenv("STRIPEFS_METRICS", "127.0.0.1:0")
    cluster = make_cluster(servers=1)
    monkeypatch.delenv("STRIPEFS_METRICS")
    return cluster
