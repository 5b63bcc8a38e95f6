"""``stripefs bench``: the multi-client throughput benchmark.

    stripefs bench [--quick] [--json FILE] [--plot FILE.png] [--tables FILE.md] [--sweep] [--peers]
                   [--cluster C] [--clients N...] [--servers M...] [--routes R...]
                   [--workloads W...] [--size SIZE] [--block SIZE] [--duration S]
                   [--dataset-files N] [--small-files N] [--no-drop-caches]
                   [--kv-page SIZE] [--kv-batch N] [--kv-keys N] [--kv-capacity SIZE]
                   [--kv-rounds N] [--kv-warmup N]

Starts a local cluster (or uses ``--cluster``), runs every workload on every route with N
client processes, measures the machine's floors in the same run, prints a summary table and
optionally writes JSON and a plot. Exit status: 0 on success, 1 when any workload failed
(including a data verification mismatch), 2 for bad arguments, 3 when a networked route
reported more than the loopback socket floor of the same run (a cache, not the data path:
``bench._validity``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from typing import Any

from ._kvcache_workload import KvcacheConfig
from ._orchestrate import BenchConfig, run_bench
from ._routes import PEERS, ROUTES
from ._tasks import WORKLOADS
from .floors import parse_size

__all__ = ["main", "build_config", "exit_status"]

QUICK = dict(size=32 << 20, block=8 << 20, duration=0.7, files=100, shards=2, dl_files=400,
             sw_files=60)
SWEEP_CLIENTS, SWEEP_SERVERS = [1, 2, 4, 8], [1, 2, 4]
SWEEP_WORKLOADS = ["seq_write", "seq_read", "rand_read_1m", "dataloader", "small_writes"]
SWEEP_DATASET_FILES, SWEEP_SMALL_FILES = 2000, 200


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="stripefs bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small sizes and short durations (smoke test; about three minutes on 2 cores)")
    ap.add_argument("--json", metavar="FILE", help="write results as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="write a throughput/latency/ratio plot")
    ap.add_argument("--tables", metavar="FILE.md",
                    help="write markdown tables: one per workload, side by side, as ratios to "
                         "the best peer and to the floors (and, with several client counts, "
                         "the seed workloads across them)")
    ap.add_argument("--sweep", action="store_true",
                    help=f"clients {SWEEP_CLIENTS} x servers {SWEEP_SERVERS}, workloads "
                         f"{' '.join(SWEEP_WORKLOADS)}")
    ap.add_argument("--peers", action="store_true", help=f"also run {', '.join(PEERS)}")
    ap.add_argument("--cluster", help="use this cluster (cluster.json or host:port) instead "
                                      "of starting one")
    ap.add_argument("--clients", type=int, nargs="+", metavar="N", help="client processes")
    ap.add_argument("--servers", type=int, nargs="+", metavar="M", help="storage servers")
    ap.add_argument("--routes", nargs="+", choices=ROUTES + PEERS, metavar="ROUTE",
                    help=f"routes ({', '.join(ROUTES + PEERS)})")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), metavar="W",
                    help=f"workloads ({', '.join(WORKLOADS)})")
    ap.add_argument("--size", type=_size, help="bytes per client (default 256M, quick 32M)")
    ap.add_argument("--block", type=_size, help="I/O size of sequential workloads (16M)")
    ap.add_argument("--duration", type=float, help="seconds per random-read workload")
    ap.add_argument("--files", type=int, help="files per client in the metadata workload")
    ap.add_argument("--dataset-files", type=int, dest="dl_files",
                    help="files in the dataloader dataset (default 20000, quick 400, "
                         "sweep 2000)")
    ap.add_argument("--small-files", type=int, dest="sw_files",
                    help="files per client in small_writes (default 1000, quick 60, sweep 200)")
    ap.add_argument("--burst-writers", type=int, metavar="N",
                    help="burst_interference: clients that write the burst, the others read "
                         "(default: half of them, rounded down)")
    ap.add_argument("--kv-page", type=_size, help="kvcache: page size, 256K..2M (default 1M)")
    ap.add_argument("--kv-batch", type=int, metavar="N", help="kvcache: keys per batch, 32..256 (default 64)")
    ap.add_argument("--kv-keys", type=int, metavar="N", help="kvcache: the key space (default 1000)")
    ap.add_argument("--kv-capacity", type=_size,
                    help="kvcache: the store's capacity, less than the key space (default: a quarter of it, "
                         "at least a batch per client)")
    ap.add_argument("--kv-rounds", type=int, metavar="N",
                    help="kvcache: measured batches per client (default: as many as --duration allows)")
    ap.add_argument("--kv-warmup", type=int, metavar="N",
                    help="kvcache: untimed batches per client before them (default: --duration's worth)")
    ap.add_argument("--no-drop-caches", action="store_true",
                    help="do not drop the kernel page cache before reads (clients evict "
                         "their own files instead)")
    ap.add_argument("--chunk-size", type=_size, default=4 << 20, help="cluster chunk size")
    ap.add_argument("--metadata-sync", choices=["full", "normal"],
                    help="the local cluster's metadata store durability (stripefs up --metadata-sync; "
                         "default full); a --cluster keeps its own, recorded in the header")
    ap.add_argument("--data-sync", choices=["full", "none"],
                    help="the local cluster's storage durability (stripefs up --data-sync; default full: chunk "
                         "writes synced before they are acknowledged; none: from the page cache, as MooseFS)")
    ap.add_argument("--attr-timeout", type=float, metavar="S",
                    help="attribute cache of the native, fsspec and zerocopy clients "
                         "(Client(attr_timeout=S); default: $STRIPEFS_ATTR_TIMEOUT, else 0 = none); "
                         "recorded in the header")
    ap.add_argument("--no-floors", action="store_true", help="skip the floor measurements")
    ap.add_argument("--workdir", help="scratch directory (default: the system temp dir)")
    ap.add_argument("--no-progress", action="store_true", help="no live progress bars")
    return ap


def build_config(a: argparse.Namespace) -> BenchConfig:
    """Turn parsed arguments into a plan. Raises ValueError for impossible combinations."""
    cfg = BenchConfig(**(QUICK if a.quick else {}))  # type: ignore[arg-type]
    if a.sweep:
        cfg.clients, cfg.servers = list(SWEEP_CLIENTS), list(SWEEP_SERVERS)
        cfg.workloads = list(SWEEP_WORKLOADS)
        if not a.quick:  # 12 shapes x every route: a smaller dataset keeps it to an hour or so
            cfg.dl_files, cfg.sw_files = SWEEP_DATASET_FILES, SWEEP_SMALL_FILES
    cfg.clients = a.clients or cfg.clients
    cfg.servers = a.servers or cfg.servers
    cfg.workloads = a.workloads or cfg.workloads or list(WORKLOADS)
    cfg.routes = a.routes or (cfg.routes + (PEERS if a.peers else []))
    for name in ("size", "block", "duration", "files", "dl_files", "sw_files", "burst_writers", "kv_page",
                 "kv_batch", "kv_keys", "kv_capacity", "kv_rounds", "kv_warmup"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    cfg.chunk_size, cfg.cluster, cfg.workdir = a.chunk_size, a.cluster, a.workdir
    if a.metadata_sync and a.cluster:
        raise ValueError("--metadata-sync sets up the local cluster bench starts; a --cluster keeps its own")
    cfg.metadata_sync = a.metadata_sync
    if a.data_sync and a.cluster:
        raise ValueError("--data-sync sets up the local cluster bench starts; a --cluster keeps its own")
    cfg.data_sync = a.data_sync
    if a.attr_timeout is not None and not a.attr_timeout >= 0:
        raise ValueError("--attr-timeout must be >= 0 seconds")
    cfg.attr_timeout = a.attr_timeout
    cfg.floors = not a.no_floors
    cfg.drop_caches = not a.no_drop_caches
    if min(cfg.clients) < 1 or min(cfg.servers) < 1:
        raise ValueError("--clients and --servers must be >= 1")
    if cfg.block < 4096 or cfg.block % 4096 or cfg.size < 4096 or cfg.size % 4096:
        raise ValueError("--size and --block must be positive multiples of 4 KiB")
    cfg.block = min(cfg.block, cfg.size)
    if cfg.burst_writers is not None and not 1 <= cfg.burst_writers < min(cfg.clients):
        raise ValueError("--burst-writers must leave at least one reader: 1 <= N < --clients")
    if cfg.duration <= 0 or cfg.files < 1 or cfg.dl_files < 1 or cfg.sw_files < 1:
        raise ValueError("--duration must be > 0, --files, --dataset-files and --small-files >= 1")
    if "kvcache" in cfg.workloads:
        KvcacheConfig.of(cfg.__dict__).check(max(cfg.clients))
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Entry point; ``argv[0]`` is the subcommand name ``bench`` (as the stripefs command passes it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        argv = argv[1:]
    ap = _parser()
    a = ap.parse_args(argv)
    try:
        cfg = build_config(a)
    except ValueError as exc:
        ap.error(str(exc))
    from ._report import LiveDisplay, plot, print_summary, write_json

    with LiveDisplay(enabled=not a.no_progress) as display:
        report: dict[str, Any] = run_bench(cfg, display)
    report["header"]["command"] = ["stripefs", "bench", *argv]
    try:
        report["header"]["stripefs"] = importlib.metadata.version("stripefs")
    except importlib.metadata.PackageNotFoundError:
        report["header"]["stripefs"] = None
    print_summary(report)
    if a.json:
        write_json(report, a.json)
    if a.plot:
        plot(report, a.plot)
    if a.tables:
        from .tables import markdown_tables, sweep_table

        text = markdown_tables(report)
        if len(cfg.clients) > 1 or len(cfg.servers) > 1:
            text += "\n" + sweep_table(report)
        with open(a.tables, "w") as f:
            f.write(text)
    return exit_status(report)


def exit_status(report: dict[str, Any]) -> int:
    """1 when a workload failed, 3 when a record is invalid (faster than its floor), else 0."""
    if report["errors"]:
        return 1
    return 3 if report.get("invalid") else 0


if __name__ == "__main__":
    sys.exit(main())
