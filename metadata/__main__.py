"""``python -m stripefs.metadata``: run the metadata service (``stripefs up`` starts it for you).

``stripefs serve metadata`` (``stripefs/_cli_serve.py``) runs the same service on a host of
its own: it shares :func:`add_service_options` and :func:`run`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys

import trio

from stripefs.rpc import cannot_start
from stripefs.rpc._settings import quiet_collector
from stripefs.rpc._metrics import METRICS_ENV, serve_metrics, write_address_file

from ._leasetable import LEASE_TTL
from ._service import serve_metadata


async def _main(args: argparse.Namespace, secret: str, cluster_id: str, raw: dict) -> None:
    metrics = serve_metrics(args.metrics, role="metadata") if args.metrics else None  # before serving: all counted
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(functools.partial(
            serve_metadata, args.state, secret=secret, host=args.host, port=args.port, cluster_id=cluster_id,
            chunk_size=args.chunk_size, max_stripe=args.stripe, gc_grace=args.gc_grace, replicas=args.replicas,
            store_url=args.store or raw.get("metadata_store_url"), admit_after=args.admit_after, sync=args.sync,
            lease_ttl=args.lease_ttl,
        ))
        if metrics is not None:
            # Named by the RPC port: several services may share the state directory.
            write_address_file(os.path.join(args.state, f"metrics-{port}.json"), *metrics, "metadata",
                               service=f"{host}:{port}")
            logging.info("metrics on http://%s:%d/metrics", *metrics)
        if args.ready:
            tmp = args.ready + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{host}:{port}")
            os.replace(tmp, args.ready)
        logging.info("metadata service listening on %s:%d", host, port)


def add_service_options(p: argparse.ArgumentParser) -> None:
    """The service's own options (layout, replication, durability, leases, metrics), shared
    with ``stripefs serve metadata``."""
    p.add_argument("--chunk-size", type=int, default=4 << 20)
    p.add_argument("--stripe", type=int, default=16)
    p.add_argument("--gc-grace", type=float, default=30.0, help="seconds before chunks of removed files are reclaimed")
    p.add_argument("--replicas", type=int, default=1, help="targets per chain (new clusters)")
    p.add_argument("--admit-after", type=float, default=3.0,
                   help="with one replica, seconds a new storage server must heartbeat before it takes chain slots")
    p.add_argument("--ready", help="file to write host:port into once serving")
    p.add_argument("--sync", choices=["full", "normal"], default="full",
                   help="SQLite durability: full = each acknowledged operation survives power loss (an fsync per "
                        "commit); normal = it survives a kill -9 of any process, the last ones may be lost on power loss")
    p.add_argument("--lease-ttl", type=float, default=LEASE_TTL,
                   help="seconds an attribute lease lives: a client answers stat from its cache meanwhile, and a "
                        "client that cannot be told of a change delays it this long at most; 0 grants none")
    p.add_argument("--metrics", default=os.environ.get(METRICS_ENV) or None, metavar="HOST:PORT",
                   help=f"serve Prometheus metrics there (PORT 0: any free port; PORT+: the first free from PORT); "
                        f"the bound address goes to STATE/metrics-RPCPORT.json (${METRICS_ENV}, else off)")


def run(args: argparse.Namespace, secret: str, cluster_id: str, raw: dict) -> int:
    """Serve until stopped; a service that cannot start (a store it cannot use, a listen
    address it cannot bind) logs one line saying why and returns 2.

    ``args`` holds :func:`add_service_options`' options and ``state``, ``store``, ``host``, ``port``.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s metadata %(levelname)s %(message)s")
    quiet_collector()
    try:
        trio.run(_main, args, secret, cluster_id, raw)
    except (OSError, BaseExceptionGroup) as exc:
        why = cannot_start(exc, args.host, args.port)
        if why is None:
            raise
        logging.error("metadata service cannot start: %s", why)
        return 2
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m stripefs.metadata")
    p.add_argument("--state", required=True, help="directory for the namespace database")
    p.add_argument("--cluster", required=True, help="cluster.json or secret file holding the secret")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--store", help="postgresql://... to keep the namespace in PostgreSQL (default: the cluster file's metadata_store_url, else SQLite in --state); prefer the cluster file: a URL here shows in ps")
    add_service_options(p)
    args = p.parse_args(argv)
    with open(args.cluster) as f:
        raw = json.load(f)
    status = run(args, raw["secret"], raw.get("cluster_id", ""), raw)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
