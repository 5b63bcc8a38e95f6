"""One rank of a multi-rank DCP save (gloo on loopback), for the multi-rank tests.

usage: _dcp_rank.py RANK WORLD PORT URL STAGING CLUSTER OUT [dcp|save]
Saves ``{"w<rank>": ..., "b<rank>": ...}`` (each rank its own keys) to URL through a
``StagedStorageWriter`` (``dcp``, the default) or ``staging.save(..., rank, world_size)``
without a ``save_id`` (``save``: the ranks agree on one by a broadcast from rank 0); writes
``{"ok": true}`` or ``{"error": "..."}`` to OUT.
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
    mode = sys.argv[8] if len(sys.argv) > 8 else "dcp"
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world),
                            timeout=datetime.timedelta(seconds=30))
    try:
        if mode == "save":
            staging.save(state(int(rank)), url, rank=int(rank), world_size=int(world), staging_dir=sdir,
                         cluster=cluster).wait()
        else:
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
