"""``python -m stripefs.storage``: run one storage server (``stripefs up`` starts them for you).

``stripefs serve storage`` (``stripefs/_cli_serve.py``) runs the same server from a join
token: it shares :func:`add_service_options` and :func:`run`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys

import trio

from stripefs.rpc import BUSY_AFTER, MAX_CLIENT_CONNECTIONS, PAYLOAD_BUDGET, cannot_start
from stripefs.rpc._metrics import METRICS_ENV, METRICS_FILE, serve_metrics
from stripefs.rpc._settings import quiet_collector

from ._metalink import parse_addresses
from ._server import serve_storage


async def _main(args: argparse.Namespace, secret: str, cluster_id: str) -> None:
    if args.metrics:  # before serving: every connection is counted
        os.makedirs(args.root, exist_ok=True)
        where = serve_metrics(args.metrics, role="storage", address_file=os.path.join(args.root, METRICS_FILE))
        logging.info("metrics on http://%s:%d/metrics", *where)
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(functools.partial(
            serve_storage, args.root, secret=secret, metadata=parse_addresses(args.metadata), host=args.host, port=args.port,
            cluster_id=cluster_id, payload_budget=args.payload_budget, busy_after=args.busy_after,
            max_client_connections=args.max_client_connections, data_sync=args.data_sync == "full",
            small_chunks=args.small_chunks == "container", advertise=getattr(args, "advertise", None),
        ))
        if args.ready:
            tmp = args.ready + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{addr[0]}:{addr[1]}")
            os.replace(tmp, args.ready)
        logging.info("storage server for %s listening on %s:%d", args.root, *addr)


# Environment defaults for the load bounds (the flags win): servers that ``stripefs up`` or a
# test cluster starts inherit them.
BUDGET_ENV = "STRIPEFS_STORAGE_PAYLOAD_BUDGET"
BUSY_AFTER_ENV = "STRIPEFS_STORAGE_BUSY_AFTER"
CLIENT_CONNECTIONS_ENV = "STRIPEFS_STORAGE_MAX_CLIENT_CONNECTIONS"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def add_service_options(p: argparse.ArgumentParser) -> None:
    """The server's own options (load bounds, durability, metrics), shared with ``stripefs serve storage``."""
    p.add_argument("--ready", help="file to write host:port into once serving")
    env = os.environ  # a string default goes through ``type`` too: a bad value is a usage error
    p.add_argument("--payload-budget", type=_positive_int, default=env.get(BUDGET_ENV) or PAYLOAD_BUDGET,
                   help=f"write payload bytes held at once, all connections together (${BUDGET_ENV}, else 512 MiB)")
    p.add_argument("--busy-after", type=_seconds, default=env.get(BUSY_AFTER_ENV) or BUSY_AFTER,
                   help=f"seconds a write waits for the payload budget before it is answered BUSY "
                        f"(${BUSY_AFTER_ENV}, else {BUSY_AFTER:g})")
    p.add_argument("--max-client-connections", type=_positive_int,
                   default=env.get(CLIENT_CONNECTIONS_ENV) or MAX_CLIENT_CONNECTIONS,
                   help=f"open connections per client; one more is refused with BUSY "
                        f"(${CLIENT_CONNECTIONS_ENV}, else {MAX_CLIENT_CONNECTIONS})")
    p.add_argument("--metrics", default=env.get(METRICS_ENV) or None, metavar="HOST:PORT",
                   help=f"serve Prometheus metrics there (PORT 0: any free port; PORT+: the first free from PORT); "
                        f"the bound address goes to ROOT/{METRICS_FILE} (${METRICS_ENV}, else off)")
    p.add_argument("--data-sync", choices=["full", "none"], default="full",
                   help="full: a chunk write is acknowledged once synced to disk (survives power loss); "
                        "none: once in the page cache (survives a kill -9, not a power loss)")
    p.add_argument("--small-chunks", choices=["container", "files"],
                   default=env.get("STRIPEFS_SMALL_CHUNKS") or "container",
                   help="where new small chunks (up to 256 KiB written whole, 128 KiB grown by appends) go: container (records appended to shared logs "
                        "under ROOT/small, one shared fdatasync for the writes that arrive together) or files "
                        "(a chunk file each); a root's chunks of either kind are always served "
                        "($STRIPEFS_SMALL_CHUNKS, else container)")


def run(args: argparse.Namespace, secret: str, cluster_id: str) -> int:
    """Serve until stopped; a server that cannot start as configured (a port in use, a root of
    another cluster) logs one line saying why and returns 2, as the metadata service does.

    ``args`` holds :func:`add_service_options`' options and ``root``, ``metadata``
    (``host:port[,...]``), ``host``, ``port`` and optionally ``advertise`` (host, port).
    ``secret`` is the cluster secret or role keys (``wire._auth.role_keys``).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s storage %(levelname)s %(message)s")
    quiet_collector()
    try:
        trio.run(_main, args, secret, cluster_id)
    except (OSError, BaseExceptionGroup) as exc:  # a port in use, a root of another cluster: one clear line
        why = cannot_start(exc, args.host, args.port)
        if why is None:
            raise
        logging.error("storage server cannot start: %s", why)
        return 2
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m stripefs.storage")
    p.add_argument("--root", required=True, help="target directory holding the chunks")
    p.add_argument("--metadata", required=True, help="host:port of the metadata service (several: comma-separated)")
    p.add_argument("--cluster", required=True, help="cluster.json or secret file holding the secret")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    add_service_options(p)
    args = p.parse_args(argv)
    with open(args.cluster) as f:
        raw = json.load(f)
    status = run(args, raw["secret"], raw.get("cluster_id", ""))
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
