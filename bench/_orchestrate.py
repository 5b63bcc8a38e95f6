"""The benchmark plan: clusters x client counts x routes x workloads, plus floors.

For every number of storage servers the benchmark starts a local cluster (unless given one
with ``cluster``), starts the routes once, then for every number of clients measures the
socket floor with the same process count and runs every workload on every route through a
:class:`~bench._pool.ClientPool`. ``local_disk`` and the peers do not depend on the stripefs
server count and run with the first one only.

Caveats:
    * Route and peer failures to *start* are reported as skipped; a workload that *fails*
      (an error or a verification mismatch) is reported in ``errors`` and makes the run fail.
    * Reads are cold: before every read workload the clients write what it needs (untimed),
      then this process drops the kernel page cache (``sync; echo 3 >
      /proc/sys/vm/drop_caches``, root only; without root the clients evict their own files
      with ``posix_fadvise``, which leaves the storage servers' page cache warm). The header
      says which (``cold_reads``).
    * Every networked record is checked against the socket floor of the run
      (``bench._validity``); records above it are listed in ``invalid``.
    * ``cpu_s`` on a record is the CPU time (user + system) of the processes of the run that
      served it -- the client processes, the storage and metadata servers of a cluster the
      benchmark started or was given, the FUSE daemon -- over the task (its untimed clean-up
      excluded); ``cpu_servers_s`` the servers' and daemon's share. Peers' daemons are not
      counted.
    * Everything the run writes lives in a scratch directory (and ``/bench-RUNID`` inside an
      existing cluster) that is removed at the end.
"""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from . import floors
from ._pool import ClientPool, WorkloadError, WorkloadSkipped
from ._ratios import add_peer_ratios
from ._routes import PEERS, Route, RouteSkipped, RunEnv, make_route
from ._seed import dataset_sizes
from ._tasks import CLEANUP, FINISH, PREPARE, record_names
from ._validity import check_validity
from ._workloads import PartResult

__all__ = ["BenchConfig", "run_bench", "aggregate", "drop_caches", "cpu_seconds"]

QUANTILES = [i / 20 for i in range(21)]  # stored per record: enough to draw a latency CDF
# Random reads need a file larger than any window a client keeps: the native client and our
# FUSE daemon hold two readahead windows of at most 32 MiB each (fsclient's MAX_WINDOW).
RAND_MIN = 2 * 2 * (32 << 20)
FLOOR_MIN_BYTES = 256 << 20
FLOOR_SAMPLES = 2  # per measurement; the runner measures before and after the routes


@dataclass
class BenchConfig:
    """What to run; sizes are bytes, ``size`` is per client."""

    clients: list[int] = field(default_factory=lambda: [2])
    servers: list[int] = field(default_factory=lambda: [4])
    routes: list[str] = field(default_factory=lambda: ["native", "fsspec", "fuse", "zerocopy",
                                                       "local_disk"])
    workloads: list[str] = field(default_factory=list)
    size: int = 256 << 20
    block: int = 16 << 20
    duration: float = 3.0
    files: int = 500
    shards: int = 4
    chunk_size: int = 4 << 20
    cluster: str | None = None
    workdir: str | None = None
    floors: bool = True
    timeout: float = 300.0
    dl_files: int = 20000
    sw_files: int = 1000
    drop_caches: bool = True  # False: clients evict their own files (no global side effect)
    rand_size: int | None = None  # random-read file per client; None: max(size, RAND_MIN)
    metadata_sync: str | None = None  # the local cluster's --metadata-sync (None: full)
    data_sync: str | None = None  # the local cluster's --data-sync (None: full)
    attr_timeout: float | None = None  # native-library clients' attribute cache (None: theirs)
    burst_writers: int | None = None  # burst_interference: clients that write (None: half, rounded down)
    kv_page: int = 1 << 20  # kvcache: bytes per page (bench._kvcache_workload)
    kv_batch: int = 64  # kvcache: keys per batch
    kv_keys: int = 1000  # kvcache: the key space
    kv_capacity: int | None = None  # kvcache: the store's bytes (None: a quarter of the keys' pages)
    kv_rounds: int | None = None  # kvcache: measured batches per client (None: for ``duration`` s)
    kv_warmup: int | None = None  # kvcache: untimed batches per client before them (None: ``duration`` s)


def _quantile(sorted_lat: list[float], q: float) -> float:
    return sorted_lat[min(len(sorted_lat) - 1, int(q * (len(sorted_lat) - 1) + 0.5))]


def aggregate(name: str, path: str, servers: int,
              per_client: list[dict[str, dict[str, Any]]]) -> dict[str, Any] | None:
    """One record from every client's part ``name``: span from first start to last end."""
    parts = [PartResult(**p[name]) for p in per_client if name in p]
    if not parts:
        return None
    nbytes = sum(p.nbytes for p in parts)
    seconds = max(max(p.t1 for p in parts) - min(p.t0 for p in parts), 1e-9)
    ops = sum(p.ops for p in parts)
    rec: dict[str, Any] = {"workload": name, "path": path, "clients": len(parts),
                           "servers": servers, "bytes": nbytes, "seconds": seconds,
                           "gbps": nbytes / seconds / 1e9, "ops": ops, "ops_per_s": ops / seconds,
                           "verified_bytes": sum(p.verified for p in parts)}
    for p in parts:  # a workload's own counters (hits, evictions, ...)
        for k, v in p.counts.items():
            rec[k] = rec.get(k, 0) + v
    lat = sorted(x for p in parts for x in p.lat)
    if lat:
        rec["latency_p50_ms"] = _quantile(lat, 0.50) * 1e3
        rec["latency_p99_ms"] = _quantile(lat, 0.99) * 1e3
        rec["latency_quantiles_ms"] = [round(_quantile(lat, q) * 1e3, 4) for q in QUANTILES]
    return rec


def _expected_bytes(workload: str, clients: int, cfg: BenchConfig) -> int | None:
    if workload in ("seq_write", "seq_read", "seq_read_cached", "shared_write", "shared_read",
                    "checkpoint"):
        return clients * cfg.size
    if workload in ("dataloader", "dataloader_batched"):
        return int(dataset_sizes(cfg.dl_files).sum())
    return None


def drop_caches() -> bool:
    """``sync`` and drop the kernel's page cache, dentries and inodes. False without root."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (all their threads); vanished pids count 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / _TICK


def cluster_pids(cluster_file: str | None) -> list[int]:
    """The metadata and storage server pids of a local cluster (none when unreadable)."""
    if cluster_file is None or not os.path.exists(cluster_file):
        return []
    import json

    try:
        with open(cluster_file) as f:
            return [int(p) for p in json.load(f).get("pids", [])]
    except (OSError, ValueError):
        return []


def _burst_ratios(recs: list[dict[str, Any]]) -> None:
    """The dataloader's latency during the burst over its latency alone."""
    by = {r["workload"]: r for r in recs}
    alone, during = by.get("burst_alone"), by.get("burst_interference")
    if alone and during and alone.get("latency_p99_ms") and alone.get("latency_p50_ms"):
        during["p99_ratio"] = during["latency_p99_ms"] / alone["latency_p99_ms"]
        during["p50_ratio"] = during["latency_p50_ms"] / alone["latency_p50_ms"]
        if "burst_write" in by:
            during["burst_gbps"] = by["burst_write"]["gbps"]
            if by.get("burst_write_alone", {}).get("gbps"):  # the burst beside readers / alone
                during["burst_ratio"] = by["burst_write"]["gbps"] / by["burst_write_alone"]["gbps"]


class _NullDisplay:
    """What run_bench reports to; ``bench._report.LiveDisplay`` draws it with rich."""

    def begin(self, label: str, total: int | None) -> None: ...
    def advance(self, done: int) -> None: ...
    def end(self, rec: list[dict[str, Any]] | None = None, note: str = "") -> None: ...
    def log(self, text: str) -> None: ...


def _start_routes(names: list[str], env: RunEnv, skipped: list[dict[str, Any]],
                  display: Any) -> list[tuple[Route, dict[str, Any]]]:
    started = []
    for name in names:
        route = make_route(name)
        display.log(f"starting route {name}")
        try:
            started.append((route, route.start(env)))
        except RouteSkipped as exc:
            route.stop()  # whatever it had started (a mount daemon) goes with it
            skipped.append({"path": name, "servers": env.servers, "reason": str(exc)})
            display.log(f"[yellow]skipped {name}: {exc}")
        except BaseException:
            for r in [route, *(r for r, _ in reversed(started))]:  # no daemon outlives a failed start
                try:
                    r.stop()
                except Exception as stop_exc:  # noqa: BLE001 - the start's error is the one to report
                    display.log(f"[red]stopping {r.name} failed: {stop_exc}")
            raise
    return started


def _run_route(route: Route, spec: dict[str, Any], clients: int, servers: int,
               cfg: BenchConfig, out: dict[str, Any], display: Any, seq: list[int],
               server_pids: list[int]) -> None:
    servers = route.servers or servers
    try:
        pool = ClientPool(spec, clients, cfg.block, cfg.timeout)
    except WorkloadError as exc:
        out["skipped"].append({"path": route.name, "clients": clients, "servers": servers,
                               "reason": f"clients could not open the route: "
                                         f"{str(exc).strip().splitlines()[-1]}"})
        return
    try:
        clients_pids = [p.pid for p in pool.procs]
        serving = (server_pids if route.on_cluster else []) + route.pids()
        for w in cfg.workloads:
            seq[0] += 1
            task = {"workload": w, "size": cfg.size, "block": cfg.block,
                    "duration": cfg.duration, "files": cfg.files, "shards": cfg.shards,
                    "dl_files": cfg.dl_files, "sw_files": cfg.sw_files, "burst_writers": cfg.burst_writers,
                    "rand_size": cfg.rand_size or max(cfg.size, RAND_MIN),
                    "tag": f"{w}-{clients}c-{seq[0]}", "route": route.name,
                    **{k: v for k, v in cfg.__dict__.items() if k.startswith("kv_")}}
            display.begin(f"{route.name:<10} {w:<13} c={clients} s={servers}",
                          _expected_bytes(w, clients, cfg))
            try:
                if w in PREPARE:
                    evict = out["header"]["cold_reads"] != "drop_caches"
                    pool.run({**task, "prepare": True, "evict": evict})
                    if not evict:
                        drop_caches()
                cpu0 = (cpu_seconds(clients_pids), cpu_seconds(serving))
                per_client = pool.run(task, display.advance)
                cpu_c = cpu_seconds(clients_pids) - cpu0[0]
                cpu_s = cpu_seconds(serving) - cpu0[1]
                if w in CLEANUP:  # untimed, and not counted in the task's CPU
                    pool.run({**task, "cleanup": True})
            except WorkloadSkipped as exc:
                out["skipped"].append({"path": route.name, "workload": w, "clients": clients,
                                       "servers": servers, "reason": str(exc)})
                display.end(note=f"skipped: {exc}")
                continue
            except WorkloadError as exc:
                out["errors"].append({"path": route.name, "workload": w, "clients": clients,
                                      "servers": servers, "error": str(exc)})
                display.end(note="FAILED: " + str(exc).strip().splitlines()[-1])
                continue
            recs = [r for name in record_names(w)
                    if (r := aggregate(name, route.name, servers, per_client)) is not None]
            for r in recs:
                r.update(pool_clients=clients, block=cfg.block)
            if len(recs) == 1:  # the task's CPU belongs to its one record
                r = recs[0]
                r.update(cpu_s=round(cpu_c + cpu_s, 3), cpu_servers_s=round(cpu_s, 3))
                if r["ops"]:
                    r["cpu_ms_per_op"] = round((cpu_c + cpu_s) / r["ops"] * 1e3, 4)
                    r["cpu_servers_ms_per_op"] = round(cpu_s / r["ops"] * 1e3, 4)
            _burst_ratios(recs)
            if w in FINISH:
                FINISH[w](recs)
            out["results"].extend(recs)
            display.end(recs)
    finally:
        pool.close()


def _measure_floor(cfg: BenchConfig, clients: int, servers: int, workdir: str,
                   rec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure ``floor_socket`` ``FLOOR_SAMPLES`` times; keep the best in ``rec`` (new or given).

    The floor is what no route can beat, so the best sample is the floor: on a machine that
    other work loads, one sample taken during a spike would make honest records look like
    caches. The runner samples before and after the routes of every client count.
    """
    # A floor is a steady state: a few MiB measure connection set-up, not the socket, and a
    # record of a tiny run would be judged against a floor far below the real one.
    total = max(clients * cfg.size, FLOOR_MIN_BYTES)
    if rec is None:
        rec = {"workload": "transfer", "path": "floor_socket", "clients": clients,
               "servers": servers, "bytes": 0, "seconds": 0.0, "gbps": 0.0,
               "streams": max(servers, clients), "verified_bytes": 0, "samples_gbps": []}
    for _ in range(FLOOR_SAMPLES):
        r = floors.floor_socket(total, streams=max(servers, clients), processes=clients,
                                directory=workdir, timeout=cfg.timeout)
        rec["samples_gbps"].append(round(r["gbps"], 3))
        rec["verified_bytes"] += r.get("crc_checked_bytes", 0)
        if r["gbps"] > rec["gbps"]:
            rec.update(bytes=r["bytes"], seconds=r["seconds"], gbps=r["gbps"])
    return rec


def run_bench(cfg: BenchConfig, display: Any = None) -> dict[str, Any]:
    """Run the plan; returns ``{"header", "results", "skipped", "errors"}`` (no I/O of its own).

    Raises:
        StripefsError: the local cluster could not start.
    """
    from stripefs.fsclient import testing

    display = display or _NullDisplay()
    out: dict[str, Any] = {"header": {"machine": floors.machine_facts(), "config": {
        k: v for k, v in cfg.__dict__.items() if k != "workdir"}}, "results": [], "skipped": [],
        "errors": [], "invalid": []}
    out["header"]["cold_reads"] = ("drop_caches" if cfg.drop_caches and drop_caches() else
                                   "posix_fadvise (the clients' page cache only)")
    run_id = secrets.token_hex(3)
    # Clients of the native library (native, fsspec, zerocopy routes) read the variable
    # when they start; the FUSE daemon is started without it.
    saved_attr = os.environ.get("STRIPEFS_ATTR_TIMEOUT")
    if cfg.attr_timeout is not None:
        os.environ["STRIPEFS_ATTR_TIMEOUT"] = repr(cfg.attr_timeout)
    out["header"]["attr_timeout"] = float(os.environ.get("STRIPEFS_ATTR_TIMEOUT") or 0)
    workdir = tempfile.mkdtemp(prefix="stripefs-bench-", dir=cfg.workdir)
    t_start, seq = time.monotonic(), [0]
    try:
        if cfg.floors:
            display.begin("floor_memcpy", None)
            r = floors.floor_memcpy(max(cfg.size, 64 << 20))
            rec = {"workload": "transfer", "path": "floor_memcpy", "clients": 1, "servers": 0,
                   "bytes": r["bytes"], "seconds": r["seconds"], "gbps": r["gbps"]}
            out["results"].append(rec)
            display.end([rec])
        ours = [n for n in cfg.routes if n not in PEERS and n != "local_disk"]
        others = [n for n in cfg.routes if n in PEERS or n == "local_disk"]
        server_counts = cfg.servers
        out["header"]["metadata_sync"] = cfg.metadata_sync or "full"
        out["header"]["data_sync"] = cfg.data_sync or "full"
        lease_ttl = 0.0  # what the service grants (the local cluster's: read once it is up)
        if cfg.cluster:
            from stripefs.fsclient import Client

            with Client(cfg.cluster) as c:
                server_counts = [len(c.routing().servers)]
                meta = c.status().metadata
                out["header"]["metadata_sync"] = meta.get("sync", "full")
                out["header"]["data_sync"] = "the cluster's own (--cluster)"
                lease_ttl = float(meta.get("lease_ttl", 0.0))  # a service from before leases grants none
        # Native-library clients answer repeated stats from their cache under leases when the
        # service grants them: stat figures are then mostly local (see docs/benchmarks.md).
        asks = os.environ.get("STRIPEFS_LEASES", "1").strip().lower() not in ("0", "false", "no", "off")

        def leases_in_effect(ttl: float) -> None:
            out["header"]["leases"] = asks and ttl > 0
            out["header"]["lease_ttl"] = ttl if asks else 0.0

        leases_in_effect(lease_ttl)
        for k, servers in enumerate(server_counts):
            root = None
            cluster_file = cfg.cluster
            if cfg.cluster is None and ours:
                root = os.path.join(workdir, f"cluster-{servers}")
                display.log(f"starting a local cluster: {servers} storage servers")
                testing.up(root, servers=servers, chunk_size=cfg.chunk_size, metadata_sync=cfg.metadata_sync,
                           data_sync=cfg.data_sync)
                cluster_file = os.path.join(root, "cluster.json")
                from stripefs.fsclient import Client

                with Client(cluster_file) as c:
                    leases_in_effect(float(c.status().metadata.get("lease_ttl", 0.0)))
            env = RunEnv(cluster_file, workdir, run_id, servers)
            started = _start_routes(ours + (others if k == 0 else []), env, out["skipped"], display)
            try:
                for clients in cfg.clients:
                    floor = None
                    if cfg.floors:
                        display.begin(f"floor_socket c={clients} s={servers}", None)
                        floor = _measure_floor(cfg, clients, servers, workdir)
                        out["results"].append(floor)
                        display.end([floor])
                    for route, spec in started:
                        ours_pids = cluster_pids(cluster_file) if route.servers is None else []
                        _run_route(route, spec, clients, servers, cfg, out, display, seq,
                                   ours_pids)
                    if floor is not None:  # the load may have changed while the routes ran
                        display.begin(f"floor_socket again c={clients} s={servers}", None)
                        _measure_floor(cfg, clients, servers, workdir, floor)
                        display.end([floor])
            finally:
                for route, _ in started:
                    route.stop()
                if root is not None:
                    testing.down(root)
                elif cluster_file is not None and ours:
                    _remove_tree(cluster_file, f"/bench-{run_id}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if saved_attr is None:
            os.environ.pop("STRIPEFS_ATTR_TIMEOUT", None)
        else:
            os.environ["STRIPEFS_ATTR_TIMEOUT"] = saved_attr
    _add_ratios(out["results"])
    try:
        out["invalid"] = check_validity(out["results"])
        out["header"]["validity"] = "checked against floor_socket"
    except LookupError as exc:
        out["header"]["validity"] = f"unchecked: {exc}"
    add_peer_ratios(out["results"])  # after validity: an invalid peer is never the best
    out["header"]["duration_s"] = round(time.monotonic() - t_start, 1)
    return out


def _remove_tree(cluster_file: str, path: str) -> None:
    """Delete what the run wrote inside an existing cluster."""
    from stripefs.fsclient import Client

    with Client(cluster_file) as c:
        def rm(p: str) -> None:
            for e in list(c.scandir(p)):
                child = f"{p}/{e.name}"
                if e.attr is not None and e.attr.is_dir:
                    rm(child)
                else:
                    c.remove(child)
            c.rmdir(p)

        if c.exists(path):
            rm(path)


def _add_ratios(results: list[dict[str, Any]]) -> None:
    """``vs_floor_socket``: each throughput over the socket floor with the same clients."""
    floor: dict[tuple[int, int], float] = {}
    by_clients: dict[int, list[float]] = {}
    for r in results:
        if r["path"] == "floor_socket":
            floor[(r["clients"], r["servers"])] = r["gbps"]
            by_clients.setdefault(r["clients"], []).append(r["gbps"])
    for r in results:
        if r["path"].startswith("floor_") or not r["bytes"]:
            continue
        n = r.get("pool_clients", r["clients"])
        f = floor.get((n, r["servers"])) or (statistics.median(by_clients[n])
                                              if n in by_clients else None)
        if f:
            r["vs_floor_socket"] = r["gbps"] / f
