"""``stripefs bench`` in tiny configurations: every workload on every route, real clients.

Each record must carry the bytes the workload really moved (checked against what was
written), and the data read back is verified against the pattern, so a fast-but-wrong route
cannot pass. Peers that cannot start are reported as skipped with a reason.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from stripefs.bench import BenchConfig, run_bench
from stripefs.bench._pattern import Pattern, VerifyError, file_id
from stripefs.bench._routes import RouteSkipped, RunEnv, make_route
from stripefs.bench._seed import dataset_sizes
from stripefs.bench._sessions import open_session
from stripefs.bench._tasks import BATCH_PARTS, WORKLOADS, record_names
from stripefs.bench.cli import main

KiB, MiB = 1 << 10, 1 << 20
SIZE, BLOCK, CLIENTS = 1 * MiB, 256 * KiB, 2
DL_FILES, SW_FILES = 24, 6
ROUTES = ["native", "fsspec", "zerocopy", "fuse", "local_disk"]
BATCHING = {"native", "zerocopy"}  # routes whose sessions batch metadata calls
FIXED = {"workload", "path", "clients", "servers", "bytes", "seconds", "gbps"}


@pytest.fixture(scope="module")
def report(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of every workload over every route (2 clients, 1 MiB each)."""
    cfg = BenchConfig(clients=[CLIENTS], routes=ROUTES, workloads=list(WORKLOADS), size=SIZE,
                      block=BLOCK, duration=0.2, files=8, shards=2, cluster=cluster.file,
                      workdir=str(tmp_path_factory.mktemp("bench")), floors=False, timeout=120,
                      dl_files=DL_FILES, sw_files=SW_FILES, drop_caches=False,
                      rand_size=2 * MiB)
    return run_bench(cfg)


def ran_routes(report: dict[str, Any]) -> list[str]:
    skipped = {s["path"] for s in report["skipped"] if "workload" not in s}
    return [r for r in ROUTES if r not in skipped]


def records(report: dict[str, Any], path: str, workload: str) -> list[dict[str, Any]]:
    return [r for r in report["results"] if r["path"] == path and r["workload"] == workload]


def test_no_workload_failed(report: dict[str, Any]) -> None:
    assert report["errors"] == []
    assert {"native", "local_disk"} <= set(ran_routes(report))
    for s in report["skipped"]:  # whatever did not run says why
        assert s["reason"]


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_each_workload_on_each_route(report: dict[str, Any], workload: str) -> None:
    skipped = {(s["path"], s.get("workload")) for s in report["skipped"]}
    for path in ran_routes(report):
        if (path, workload) in skipped:
            continue
        for name in record_names(workload):
            if name in BATCH_PARTS and path not in BATCHING:
                assert records(report, path, name) == []  # no batched calls: no such record
                continue
            [rec] = records(report, path, name)
            assert FIXED <= rec.keys()
            assert rec["servers"] == 4 and rec["seconds"] > 0
            assert rec["gbps"] == pytest.approx(rec["bytes"] / rec["seconds"] / 1e9)
            json.dumps(rec)  # plain JSON types only


@pytest.mark.parametrize("workload", ["seq_write", "seq_read", "seq_read_cached", "shared_write",
                                      "shared_read", "checkpoint"])
def test_byte_counts_match_what_was_written(report: dict[str, Any], workload: str) -> None:
    skipped = {(s["path"], s.get("workload")) for s in report["skipped"]}
    for path in ran_routes(report):
        if (path, workload) in skipped:
            assert path in ("fsspec",) and workload == "shared_write"
            continue
        [rec] = records(report, path, workload)
        assert rec["clients"] == CLIENTS
        assert rec["bytes"] == CLIENTS * SIZE
        assert rec["ops"] == CLIENTS * SIZE // BLOCK
        assert rec["verified_bytes"] > 0  # sample compared byte for byte
        assert rec["latency_p50_ms"] <= rec["latency_p99_ms"]


@pytest.mark.parametrize("workload, req", [("rand_read_4k", 4 * KiB), ("rand_read_64k", 64 * KiB),
                                           ("rand_read_1m", MiB), ("rand_read_4k_cached", 4 * KiB)])
def test_random_reads_count_requests(report: dict[str, Any], workload: str, req: int) -> None:
    for path in ran_routes(report):
        [rec] = records(report, path, workload)
        assert rec["ops"] > 0 and rec["bytes"] == rec["ops"] * req
        assert rec["ops_per_s"] == pytest.approx(rec["ops"] / rec["seconds"])
        assert rec["verified_bytes"] >= req  # the first read of each client is exact-checked


def test_metadata_and_mixed_parts(report: dict[str, Any]) -> None:
    for path in ran_routes(report):
        for phase in ("meta_create", "meta_stat", "meta_unlink"):
            [rec] = records(report, path, phase)
            assert rec["ops"] == CLIENTS * 8 and rec["bytes"] == 0
        for phase in BATCH_PARTS:  # files, not calls
            found = records(report, path, phase)
            assert [(r["ops"], r["bytes"], r["clients"]) for r in found] == \
                ([(CLIENTS * 8, 0, CLIENTS)] if path in BATCHING else [])
        [rd] = records(report, path, "mixed_read")
        [wr] = records(report, path, "mixed_write")
        assert rd["clients"] + wr["clients"] == CLIENTS
        assert wr["bytes"] == wr["clients"] * SIZE
        assert rd["ops"] > 0


def test_dataloader_reads_every_file_once(report: dict[str, Any]) -> None:
    sizes = dataset_sizes(DL_FILES)
    assert all(64 * KiB <= x <= 256 * KiB and x % 4096 == 0 for x in sizes)
    assert len(set(sizes.tolist())) > 1  # sizes vary (from a fixed seed)
    for path in ran_routes(report):
        [rec] = records(report, path, "dataloader")
        assert rec["clients"] == CLIENTS and rec["ops"] == DL_FILES
        assert rec["bytes"] == int(sizes.sum())
        assert rec["latency_p50_ms"] <= rec["latency_p99_ms"]
        assert rec["verified_bytes"] >= sizes[0]  # at least one file compared byte for byte
        assert 0 <= rec["cpu_servers_s"] <= rec["cpu_s"] and "cpu_ms_per_op" in rec
        if path == "native":  # the storage servers did the serving: 24 small files are a few
            # ms of their CPU, under the 10 ms tick that charges it, so look at the whole run
            assert sum(r.get("cpu_servers_s", 0) for r in report["results"] if r["path"] == "native") > 0
        if path == "local_disk":
            assert rec["cpu_servers_s"] == 0


def test_dataloader_batched_reads_every_file_once_in_batches(report: dict[str, Any]) -> None:
    sizes = dataset_sizes(DL_FILES)
    for path in ran_routes(report):
        [rec] = records(report, path, "dataloader_batched")
        assert rec["ops"] == DL_FILES and rec["bytes"] == int(sizes.sum())  # files, not batches
        assert rec["verified_bytes"] >= sizes[0]


def test_small_writes_counts_files_and_bytes(report: dict[str, Any]) -> None:
    for path in ran_routes(report):
        [rec] = records(report, path, "small_writes")
        assert rec["ops"] == CLIENTS * SW_FILES
        assert CLIENTS * SW_FILES * 4 * KiB <= rec["bytes"] <= CLIENTS * SW_FILES * 64 * KiB
        assert rec["ops_per_s"] == pytest.approx(rec["ops"] / rec["seconds"])
        assert rec["verified_bytes"] > 0 and rec["latency_p50_ms"] <= rec["latency_p99_ms"]


def test_burst_interference_reports_the_latency_ratio(report: dict[str, Any]) -> None:
    for path in ran_routes(report):
        [alone] = records(report, path, "burst_alone")
        [during] = records(report, path, "burst_interference")
        [burst] = records(report, path, "burst_write")
        [solo] = records(report, path, "burst_write_alone")
        assert alone["clients"] == during["clients"] == 1 and burst["clients"] == solo["clients"] == 1
        assert alone["ops"] >= 1 and during["ops"] >= 1
        assert burst["bytes"] == solo["bytes"] == SIZE  # one writer, one checkpoint of ``size`` bytes, twice
        assert during["p99_ratio"] == pytest.approx(during["latency_p99_ms"]
                                                    / alone["latency_p99_ms"])
        assert during["burst_gbps"] == burst["gbps"]
        assert during["burst_ratio"] == pytest.approx(burst["gbps"] / solo["gbps"])


def test_restore_loads_every_state_whole_and_checks_it(report: dict[str, Any]) -> None:
    from stripefs.bench._seed import RESTORE_TENSORS

    skipped = {(s["path"], s.get("workload")): s["reason"] for s in report["skipped"]}
    assert "state loader" in skipped[("zerocopy", "restore")]  # the same staging.load as native
    for path in ran_routes(report):
        if path == "zerocopy":
            continue
        for count in RESTORE_TENSORS:
            [rec] = records(report, path, f"restore_{count}")
            per_tensor = max(1, SIZE // count // 4) * 4
            assert rec["ops"] == CLIENTS  # one load per client, all at once
            assert rec["bytes"] == rec["verified_bytes"] == CLIENTS * count * per_tensor


def test_restore_finds_a_state_that_is_not_the_one_saved(tmp_path: Path) -> None:
    from stripefs.bench._seed import prepare_restore, restore, restore_tensors
    from stripefs.bench._sessions import PosixSession
    from stripefs.bench._workloads import ClientContext

    import torch

    s = PosixSession(str(tmp_path))
    task = {"tag": "t", "size": 64 * KiB, "evict": False}
    ctx: Any = ClientContext(0, 1, type("B", (), {"wait": lambda self, t=None: 0})(), [0], None, Pattern(BLOCK))
    prepare_restore(s, task, ctx)
    assert restore(s, task, ctx)["restore_16"].verified == 64 * KiB
    state = dict(restore_tensors(64 * KiB, 1000))
    state["layer0999.weight"][7] += 1  # one float of the last tensor
    s.save_state("restore/t/c0-t1000", state)
    with pytest.raises(VerifyError, match="layer0999"):
        restore(s, task, ctx)
    state = dict(restore_tensors(64 * KiB, 1000))
    state["extra"] = torch.zeros(1)
    s.save_state("restore/t/c0-t1000", state)
    with pytest.raises(VerifyError, match="extra"):
        restore(s, task, ctx)


def test_burst_writers_sets_how_many_clients_write_the_burst(cluster: Any, tmp_path: Path) -> None:
    cfg = BenchConfig(clients=[4], routes=["native"], workloads=["burst_interference"], size=SIZE,
                      block=BLOCK, duration=0.2, cluster=cluster.file, workdir=str(tmp_path), floors=False,
                      timeout=120, dl_files=DL_FILES, drop_caches=False, burst_writers=1)
    run = run_bench(cfg)
    assert run["errors"] == []
    [alone] = records(run, "native", "burst_alone")
    [during] = records(run, "native", "burst_interference")
    [burst] = records(run, "native", "burst_write")
    [solo] = records(run, "native", "burst_write_alone")
    assert alone["clients"] == during["clients"] == 3 and burst["clients"] == solo["clients"] == 1
    assert burst["bytes"] == solo["bytes"] == SIZE


def test_burst_writers_must_leave_a_reader() -> None:
    from stripefs.bench.cli import _parser, build_config

    assert build_config(_parser().parse_args(["--clients", "4", "--burst-writers", "1"])).burst_writers == 1
    for bad in (["--clients", "2", "--burst-writers", "2"], ["--burst-writers", "0"]):
        with pytest.raises(ValueError, match="burst-writers"):
            build_config(_parser().parse_args(bad))


def test_fsspec_offset_writes_are_skipped_with_reason(report: dict[str, Any]) -> None:
    if "fsspec" not in ran_routes(report):
        pytest.skip("fsspec route not available")
    [s] = [s for s in report["skipped"] if s["path"] == "fsspec" and s.get("workload")]
    assert s["workload"] == "shared_write" and "offset" in s["reason"]


def test_pattern_catches_wrong_data() -> None:
    p = Pattern(64 * KiB)
    fid = file_id("seq/c0")
    good = bytearray(p.stamped(fid, 128 * KiB, 64 * KiB))
    assert p.check(memoryview(good), fid, 128 * KiB, exact=True) == 64 * KiB
    with pytest.raises(VerifyError, match="stamp"):
        p.check(memoryview(good), fid, 0)  # bytes of another offset
    with pytest.raises(VerifyError, match="stamp"):
        p.check(memoryview(good), file_id("seq/c1"), 128 * KiB)  # another file's bytes
    with pytest.raises(VerifyError, match="stamp"):
        p.check(memoryview(bytearray(64 * KiB)), fid, 128 * KiB)  # zeros
    good[5000] ^= 1
    p.check(memoryview(good), fid, 128 * KiB)  # stamps alone miss a flipped byte...
    with pytest.raises(VerifyError, match="differs"):
        p.check(memoryview(good), fid, 128 * KiB, exact=True)  # ...the exact sample does not


def test_missing_peer_is_skipped_with_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no glusterd, no mfsmaster on this PATH
    env = RunEnv(None, str(tmp_path), "t1")
    for name in ("glusterfs", "moosefs"):
        with pytest.raises(RouteSkipped, match="not installed"):
            make_route(name).start(env)
    rep = run_bench(BenchConfig(clients=[1], routes=["glusterfs", "moosefs"],
                                workloads=["seq_write"], size=SIZE, block=BLOCK, floors=False,
                                workdir=str(tmp_path)))
    assert rep["results"] == [] and rep["errors"] == []
    assert {s["path"] for s in rep["skipped"]} == {"glusterfs", "moosefs"}
    assert all("not installed" in s["reason"] for s in rep["skipped"])


def test_the_fuse_route_reads_its_dataset_through_a_read_only_mount(cluster: Any, tmp_path: Path) -> None:
    """As a training job mounts it: the dataset through ``-o ro``, writes through the other."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("FUSE mounts need root and /dev/fuse")
    route = make_route("fuse")
    spec = route.start(RunEnv(cluster.file, str(tmp_path), "ro1", servers=4))
    try:
        assert len(route.pids()) == 2
        s = open_session(spec)
        try:
            assert s.datasets is not s and s.datasets.root == spec["dataset_root"]
            s.makedirs("dataset/d")
            w = s.create("dataset/d/f")
            w.write(memoryview(b"x" * 5000))
            w.close()
            buf = bytearray(8192)
            r = s.datasets.open_read("dataset/d/f", direct=True)
            try:
                assert r.pread_into(memoryview(buf), 0) == 5000 and bytes(buf[:5000]) == b"x" * 5000
            finally:
                r.close()
            with pytest.raises(OSError) as err:  # the dataset's mount refuses every change
                os.open(os.path.join(spec["dataset_root"], "dataset/d/g"), os.O_WRONLY | os.O_CREAT, 0o644)
            assert err.value.errno == errno.EROFS
        finally:
            s.close()
            shutil.rmtree(os.path.dirname(spec["root"]))  # /bench-ro1 on the shared cluster
    finally:
        route.stop()
    assert route.pids() == [] and not any(os.path.ismount(tmp_path / d) for d in os.listdir(tmp_path))


def test_cli_json_and_plot(cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    rc = main(["bench", "--cluster", cluster.file, "--clients", "2", "--size", "1M",
               "--block", "256K", "--routes", "native", "--workloads", "seq_write", "seq_read",
               "--json", str(out), "--plot", str(png), "--no-progress", "--no-drop-caches",
               "--tables", str(tmp_path / "out.md"), "--workdir", str(tmp_path)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert {"machine", "config", "command", "stripefs", "duration_s"} <= rep["header"].keys()
    assert rep["header"]["machine"]["cores"] >= 1
    paths = {r["path"] for r in rep["results"]}
    assert {"native", "floor_socket", "floor_memcpy"} <= paths
    for r in rep["results"]:
        assert FIXED <= r.keys()
    [rd] = [r for r in rep["results"] if r["path"] == "native" and r["workload"] == "seq_read"]
    assert rd["bytes"] == 2 * MiB and rd["vs_floor_socket"] > 0
    [floor] = [r for r in rep["results"] if r["path"] == "floor_socket"]
    assert len(floor["samples_gbps"]) == 4  # two before the routes, two after: the best counts
    assert round(floor["gbps"], 3) == max(floor["samples_gbps"])
    assert floor["bytes"] >= 256 * MiB  # a steady state, not connection set-up
    assert rep["invalid"] == [] and rep["header"]["validity"].startswith("checked")
    assert rep["header"]["cold_reads"].startswith("posix_fadvise")  # --no-drop-caches
    tables = (tmp_path / "out.md").read_text()
    assert "#### seq_read" in tables and "| native |" in tables
    assert png.stat().st_size > 10_000
    assert "seq_read" in capsys.readouterr().out
    assert not any(p.name.startswith("stripefs-bench-") for p in tmp_path.iterdir())


def test_drop_caches_needs_root() -> None:
    from stripefs.bench._orchestrate import drop_caches

    can = os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)
    assert drop_caches() is can


@pytest.mark.parametrize("args", [["--size", "1000"], ["--clients", "0"], ["--size", "lots"],
                                  ["--routes", "nfs"], ["--duration", "0"], ["--metadata-sync", "never"],
                                  ["--metadata-sync", "normal", "--cluster", "127.0.0.1:1"]])
def test_bad_arguments_exit_2(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", *args])
    assert exc.value.code == 2


def test_header_names_the_metadata_sync(report: dict[str, Any]) -> None:
    assert report["header"]["metadata_sync"] == "full"  # the test cluster's, asked from it


def test_metadata_sync_reaches_the_config() -> None:
    from stripefs.bench.cli import _parser, build_config

    assert build_config(_parser().parse_args(["--metadata-sync", "normal"])).metadata_sync == "normal"
    assert build_config(_parser().parse_args([])).metadata_sync is None


def test_cluster_directory_is_cleaned(cluster: Any, report: dict[str, Any]) -> None:
    with cluster.client() as c:
        assert not [n for n in c.listdir("/") if n.startswith("bench-")]
    assert os.path.exists(cluster.file)


def test_attr_timeout_reaches_the_config_and_the_header(report: dict[str, Any]) -> None:
    from stripefs.bench.cli import _parser, build_config

    assert report["header"]["attr_timeout"] == 0.0  # none asked for: every stat crosses the network
    assert "STRIPEFS_ATTR_TIMEOUT" not in os.environ  # the run put the environment back
    assert build_config(_parser().parse_args(["--attr-timeout", "1"])).attr_timeout == 1.0
    assert build_config(_parser().parse_args([])).attr_timeout is None
    with pytest.raises(ValueError, match="attr-timeout"):
        build_config(_parser().parse_args(["--attr-timeout", "-1"]))
