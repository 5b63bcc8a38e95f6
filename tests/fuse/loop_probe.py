"""A ``stripefs mount`` daemon that counts what its write requests cost: run as
``python -m tests.fuse.loop_probe MOUNTPOINT CLUSTER_FILE OUT.json [-o opt]...``.

The daemon is the real one (``fsclient.fuse._daemon.serve``); the probe only counts,
around it, the worker-thread hops (``trio.to_thread.run_sync``) made while a write
request is being served, and the most write-behind bytes in flight the mount ever
had. At exit (after ``stripefs umount``) it writes the counts to OUT.json.
"""

from __future__ import annotations

import atexit
import json
import sys
from typing import Any

import trio

from stripefs.fsclient.fuse import _daemon, _operations

counts = {"write_requests": 0, "write_hops": 0, "hops": 0, "max_sending": 0}

_run_sync = trio.to_thread.run_sync


async def _counted_run_sync(*args: Any, **kwargs: Any) -> Any:
    counts["hops"] += 1
    return await _run_sync(*args, **kwargs)


_write = _operations.StripeOperations.write


async def _counted_write(self: Any, fh: int, off: int, buf: bytes) -> int:
    counts["write_requests"] += 1
    before = counts["hops"]
    try:
        return await _write(self, fh, off, buf)
    finally:
        counts["write_hops"] += counts["hops"] - before
        counts["max_sending"] = max(counts["max_sending"], self.writes.sending_bytes)


def main(argv: list[str]) -> int:
    mountpoint, cluster, out = argv[:3]
    opts = [argv[i + 1] for i in range(3, len(argv) - 1) if argv[i] == "-o"]
    trio.to_thread.run_sync = _counted_run_sync  # type: ignore[assignment]
    _operations.StripeOperations.write = _counted_write  # type: ignore[method-assign]

    def dump() -> None:
        with open(out, "w") as f:
            json.dump(counts, f)

    atexit.register(dump)
    return _daemon.serve(mountpoint, cluster, opts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
