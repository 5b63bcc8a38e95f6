"""``stripefs mover --staging DIR [--cluster C]``: the mover as its own process.

Resumes whatever the journal of DIR says is staged (after a trainer or mover
was killed, from the last durable offset), prints progress, and with
``--once`` exits after one pass (exit status 1 when a checkpoint is left
failed or still staged).
"""

from __future__ import annotations

import argparse
import os
import logging
import sys
import threading
import time

from ._journal import CkptRow
from ._mover import MoverOptions
from ._service import Mover

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stripefs mover", description="upload staged checkpoints to the shared store")
    p.add_argument("--staging", required=True, help="staging directory (the one staging.save wrote to)")
    p.add_argument("--cluster", help="cluster.json or host:port (default: the one recorded at save time)")
    p.add_argument("--once", action="store_true", help="one pass, then exit")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between passes")
    p.add_argument("--concurrency", type=int, default=2, help="files uploaded at once")
    p.add_argument("--bandwidth", type=float, default=None, help="cap in MB/s")
    p.add_argument("--retries", type=int, default=5)
    p.add_argument("--piece", type=int, default=32 << 20, help="upload unit in bytes (progress is durable per piece)")
    p.add_argument("--no-verify", action="store_true",
                   help="before a commit check only the uploaded files' sizes, not every CRC32C (no read-back)")
    p.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics (bytes uploaded, checkpoints by outcome, backlog, lag; "
                        "docs/observability.md)")
    p.add_argument("--qos", choices=("interactive", "bulk", "background"), default="background",
                   help="traffic class of the uploads at the storage servers (default background)")
    p.add_argument("--nice", type=int, default=10,
                   help="steps of CPU priority below the shell's (default 10; 0: none): on busy cores "
                        "a dataloader's reads beside the upload go first")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def main(argv: list[str]) -> int:
    """Entry point; ``argv[0]`` is the subcommand name (``mover``)."""
    args = _parser().parse_args(argv[1:])
    if args.nice > 0:
        os.nice(min(args.nice, 19))  # the whole process: its readers, copies, CRCs and sends
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(message)s")
    opts = MoverOptions(concurrency=args.concurrency, retries=args.retries, cluster=args.cluster, piece=args.piece,
                        verify=not args.no_verify, qos=args.qos,
                        bandwidth=args.bandwidth * 1e6 if args.bandwidth else None)
    sent: dict[str, int] = {}
    t0 = time.monotonic()

    def progress(row: CkptRow, n: int) -> None:
        sent[row.id] = sent.get(row.id, 0) + n
        if not args.quiet:
            total = sum(f.size for f in mover.journal.files(row.id))
            done = sum(f.done for f in mover.journal.files(row.id))
            rate = sum(sent.values()) / max(time.monotonic() - t0, 1e-9) / 1e9
            print(f"\r{row.url}: {done / max(total, 1):6.1%} of {total / 1e6:.1f} MB  {rate:.2f} GB/s", end="",
                  file=sys.stderr, flush=True)

    mover = Mover(args.staging, opts, on_progress=progress)
    if args.metrics:
        from stripefs.rpc._metrics import serve_metrics

        try:
            host, port = serve_metrics(args.metrics, role="mover")
        except (OSError, ValueError) as exc:
            print(f"stripefs mover: --metrics {args.metrics}: {exc}", file=sys.stderr)
            return 2
        if not args.quiet:
            print(f"metrics at http://{host}:{port}/metrics", file=sys.stderr)
    if args.once:
        states = mover.run_once()
        for cid, state in states.items():
            row = mover.journal.get(cid)
            print(f"{row.url if row else cid}: {state}" + (f" ({row.error})" if row and row.error and state != "committed" else ""))
        print(f"uploaded {mover.uploaded} bytes")
        # The exit status is this pass's: a checkpoint that failed on an earlier pass ("cleaned") is not a failure again.
        return 0 if all(s in ("committed", "abandoned", "cleaned") for s in states.values()) else 1
    stop = threading.Event()
    try:
        mover.run_forever(stop, args.interval)
    except KeyboardInterrupt:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main(["mover", *sys.argv[1:]]))
