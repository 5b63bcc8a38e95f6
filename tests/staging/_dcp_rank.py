"""One rank of a multi-rank DCP save (gloo on loopback), for the multi-rank tests.

usage: _dcp_rank.py RANK WORLD PORT URL STAGING CLUSTER OUT
Saves ``{"w<rank>": ..., "shared": ...}`` (each rank its own keys) to URL through a
``StagedStorageWriter``; writes ``{"ok": true}`` or ``{"error": "..."}`` to OUT.
"""

import datetime
import json
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from stripefs import staging


def state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {f"w{rank}": torch.randn(64, 1024, generator=g), f"b{rank}": torch.arange(5) + rank}


def main() -> None:
    rank, world, port, url, sdir, cluster, out = sys.argv[1:8]
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world),
                            timeout=datetime.timedelta(seconds=30))
    try:
        writer = staging.StagedStorageWriter(url, staging_dir=sdir, cluster=cluster)
        dcp.save(state(int(rank)), storage_writer=writer)
        result = {"ok": True}
    except BaseException as exc:  # noqa: BLE001 -- torch's CheckpointException is a BaseException
        result = {"error": f"{type(exc).__name__}: {exc}"}
    with open(out, "w") as f:
        json.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- a peer that died leaves the group broken
        pass


if __name__ == "__main__":
    main()
