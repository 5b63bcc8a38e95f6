"""``stripefs bench --workloads kvcache``: Zipf batches of pages against a store smaller than
the key space, the page store on native and one file per page on the local disk, in a tiny
configuration (pages of 256 KiB, batches of 32, 2 clients)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stripefs.bench._kvcache_pages import open_pages
from stripefs.bench._kvcache_workload import KvcacheConfig, _Game, _page_id, kvcache_cleanup
from stripefs.bench._pattern import VerifyError
from stripefs.bench._sessions import FsspecSession, NativeSession, PosixSession
from stripefs.bench.cli import _parser, build_config, main

KiB, MiB = 1 << 10, 1 << 20
PAGE, BATCH, KEYS, ROUNDS, CLIENTS = 256 * KiB, 32, 128, 4, 2
CAPACITY = CLIENTS * BATCH * PAGE  # 64 pages of the 128 keys: evictions must happen


@pytest.fixture(scope="module")
def report(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("kvbench")
    out = tmp / "kv.json"
    rc = main(["bench", "--cluster", cluster.file, "--clients", str(CLIENTS), "--routes", "native", "local_disk",
               "--workloads", "kvcache", "--kv-page", "256K", "--kv-batch", str(BATCH),
               "--kv-keys", str(KEYS), "--kv-capacity", str(CAPACITY), "--kv-rounds", str(ROUNDS),
               "--kv-warmup", "2", "--no-floors", "--no-drop-caches", "--no-progress", "--json", str(out),
               "--workdir", str(tmp)])
    assert rc == 0
    return dict(json.loads(out.read_text()))


def record(report: dict[str, Any], path: str, workload: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [r for r in report["results"] if r["path"] == path and r["workload"] == workload]
    [rec] = found
    return rec


@pytest.mark.parametrize("path", ["native", "local_disk"])
def test_gets_hit_and_miss_and_every_hit_is_verified(report: dict[str, Any], path: str) -> None:
    get = record(report, path, "kvcache_get")
    assert get["ops"] == CLIENTS * ROUNDS * BATCH == get["hits"] + get["misses"]
    assert 0 < get["hit_ratio"] < 1 and get["hit_ratio"] == pytest.approx(get["hits"] / get["ops"])
    assert get["bytes"] == get["hits"] * PAGE and get["gbps"] > 0
    assert get["verified_pages"] == get["hits"]  # every hit's stamps checked...
    assert get["verified_bytes"] >= PAGE  # ...and a sample byte for byte
    assert get["checksum_failures"] == get["read_errors"] == get["exists_not_got"] == 0
    assert len(get["latency_quantiles_ms"]) == 21 and 0 < get["latency_p50_ms"] <= get["latency_p99_ms"]
    assert get["pinned_clients"] == 0  # no CUDA here: page-aligned host buffers


@pytest.mark.parametrize("path", ["native", "local_disk"])
def test_misses_are_put_back_and_evict(report: dict[str, Any], path: str) -> None:
    get, put = record(report, path, "kvcache_get"), record(report, path, "kvcache_put")
    assert put["ops"] == get["misses"] and put["bytes"] == put["ops"] * PAGE
    assert put["evictions"] > 0  # the key space is twice the capacity
    assert 0 < put["latency_p50_ms"] <= put["latency_p99_ms"]


def test_native_is_compared_with_the_local_disk(report: dict[str, Any]) -> None:
    get = record(report, "native", "kvcache_get")
    disk = record(report, "local_disk", "kvcache_get")
    assert get["vs_local_disk"] == pytest.approx(get["gbps"] / disk["gbps"])
    assert report["header"]["config"]["kv_page"] == PAGE


def test_no_errors_and_nothing_skipped(report: dict[str, Any]) -> None:
    assert report["errors"] == [] and report["skipped"] == []


@pytest.mark.parametrize("session, route, match", [
    (lambda tmp: PosixSession(str(tmp)), "fuse", "mount"),
    (lambda tmp: FsspecSession("fsspec.implementations.memory:MemoryFileSystem", {}, "/kv"), "s3fs", "object store"),
])
def test_routes_without_a_page_store_are_skipped_with_reason(tmp_path: Path, session: Any, route: str,
                                                             match: str) -> None:
    """The pool reports NotImplementedError as a skip with its message (``bench._pool``)."""
    with pytest.raises(NotImplementedError, match=match):
        open_pages(session(tmp_path), route, "t", PAGE, CAPACITY, None)  # type: ignore[arg-type]


def test_nothing_is_left_in_the_cluster(report: dict[str, Any], cluster: Any) -> None:
    with cluster.client() as c:
        assert not [n for n in c.listdir("/") if n.startswith("bench-")]


def test_cleanup_removes_the_task_pages(cluster: Any, tmp_path: Path) -> None:
    """The clean-up call after the task (the first client's) removes its namespace or files."""
    from stripefs.kvcache import PageStore

    ctx = SimpleNamespace(index=0)
    native = NativeSession(cluster.file, f"/kvclean-{tmp_path.name}")
    try:
        with PageStore(native.client, "t1", PAGE, 4 * PAGE, root=f"{native.root}/kvcache") as store:
            store.batch_put([b"k"], [bytes(PAGE)])
        kvcache_cleanup(native, {"tag": "t1"}, ctx)  # type: ignore[arg-type]
        assert native.listdir("kvcache") == []
        native.client.rmdir(f"{native.root}/kvcache")
        native.client.rmdir(native.root)
    finally:
        native.close()
    posix = PosixSession(str(tmp_path))
    posix.makedirs("kvcache/t1")
    posix.touch("kvcache/t1/0000001")
    kvcache_cleanup(posix, {"tag": "t1"}, ctx)  # type: ignore[arg-type]
    assert posix.listdir("kvcache") == []


def test_a_wrong_page_or_an_unannounced_hit_fails() -> None:
    cfg = KvcacheConfig(PAGE, BATCH, KEYS, CAPACITY, 1, 0)
    game = _Game(None, cfg, SimpleNamespace(index=0), 1.0)  # type: ignore[arg-type]
    game.slots[0][:] = game.pattern.stamped(_page_id(7), 0, PAGE)
    assert game._check([7], [True], [True], measured=True) == PAGE  # the first hit: compared byte for byte
    with pytest.raises(VerifyError, match="stamp"):
        game._check([8], [True], [True], measured=True)  # key 7's bytes under key 8
    with pytest.raises(VerifyError, match="exists"):
        game._check([7], [False], [True], measured=True)
    assert game.counts["verified_pages"] == 1


@pytest.mark.parametrize("args, match", [(["--kv-page", "64K"], "kv-page"), (["--kv-batch", "8"], "kv-batch"),
                                         (["--kv-capacity", "4G"], "smaller than the key space")])
def test_bad_shapes_are_refused(args: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_config(_parser().parse_args(["--workloads", "kvcache", *args]))
    build_config(_parser().parse_args(["--workloads", "seq_read", *args]))  # not run: not checked


def test_default_capacity_is_smaller_than_the_key_space() -> None:
    cfg = build_config(_parser().parse_args(["--workloads", "kvcache", "--clients", "4"]))
    kv = KvcacheConfig.of(cfg.__dict__)
    assert (kv.page, kv.batch) == (MiB, 64)
    assert kv.rounds is None and kv.warmup is None  # --duration decides
    assert 4 * 64 * MiB <= kv.capacity_bytes(4) < kv.keys * MiB
