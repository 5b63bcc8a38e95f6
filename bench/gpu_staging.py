"""``python -m stripefs.bench.gpu_staging``: CUDA tensors through checkpoint staging, on a GPU machine.

Starts a 4-server loopback cluster, saves a state dict of CUDA tensors (fp32, bf16, a tied
view, a non-contiguous tensor, int8, a host tensor and a plain value) three times, and
reports: how long ``save()`` blocked against a device-to-host copy of the same bytes into
pinned memory (the floor), the time to globally durable, load times to CUDA and to the
CPU (from the local staged copy and from the store) with a bit-exact comparison, and a
``dcp.async_save`` / ``dcp.load`` round trip of CUDA tensors. Prints JSON; exits non-zero
when a round trip is not exact. Needs ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

from stripefs import staging
from stripefs.fsclient.testing import LocalCluster


def _state(mib: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(1)
    big = torch.randn(mib << 18, device="cuda", generator=g)  # mib MiB of fp32
    return {"w": big, "bf": torch.randn(1024, 1024, device="cuda", generator=g).to(torch.bfloat16),
            "view": big[10:1000], "nc": torch.randn(512, 256, device="cuda", generator=g).t(),
            "i8": torch.randint(-128, 127, (4097,), dtype=torch.int8, device="cuda", generator=g),
            "cpu": torch.arange(10), "step": 7}


def _exact(back: dict[str, Any], sd: dict[str, Any], device: str) -> bool:
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            if back[k] != v:
                return False
            continue
        b = back[k]
        if b.device.type != device or b.dtype != v.dtype or b.shape != v.shape:
            return False
        if not torch.equal(b.cpu().contiguous().view(torch.uint8), v.cpu().contiguous().view(torch.uint8)):
            return False
    return back["view"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()  # still tied


def run(mib: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "mib": mib}
    cl = LocalCluster.start(os.path.join(root, "cluster"), servers=4)
    try:
        with cl.client() as c:
            c.makedirs("/ck")
        sd = _state(mib)
        sdir = os.path.join(root, "staging")
        saves = []
        for step in (1, 2, 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            h = staging.save(sd, f"stripefs://ck/step-{step}", staging_dir=sdir, cluster=cl.file)
            blocked = time.perf_counter() - t
            ok = h.wait(600)
            saves.append({"step": step, "blocked_s": round(blocked, 4),
                          "durable_s": round(time.perf_counter() - t, 3), "ok": bool(ok)})
        out["saves"] = saves
        pinned = torch.empty(sd["w"].numel() * 4, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        pinned.copy_(sd["w"].view(torch.uint8))
        torch.cuda.synchronize()
        out["floor_d2h_pinned_s"] = round(time.perf_counter() - t, 4)
        for device in ("cuda", "cpu"):
            for prefer_local in (True, False):
                t = time.perf_counter()
                back = staging.load("stripefs://ck/step-3", map_location=device, staging_dir=sdir,
                                    cluster=cl.file, prefer_local=prefer_local)
                out[f"load_{device}_{'local' if prefer_local else 'store'}"] = {
                    "s": round(time.perf_counter() - t, 3), "exact": _exact(back, sd, device)}
        import torch.distributed.checkpoint as dcp

        small = {"a": torch.randn(1024, 1024, device="cuda"), "b": torch.ones(5, device="cuda")}
        w = staging.StagedStorageWriter(staging_dir=os.path.join(root, "dcp"), cluster=cl.file)
        dcp.async_save(small, checkpoint_id="stripefs://ck/dcp-1", storage_writer=w).result(300)
        dst = {k: torch.zeros_like(v) for k, v in small.items()}
        dcp.load(dst, storage_reader=staging.StagedStorageReader("stripefs://ck/dcp-1", staging_dir=os.path.join(root, "dcp2"),
                                                                 cluster=cl.file))
        out["dcp_async_cuda_exact"] = all(torch.equal(dst[k], small[k]) for k in small)
    finally:
        cl.down()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.gpu_staging", description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="size of the largest CUDA tensor (MiB of fp32)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_staging needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as root:
        out = run(a.mib, root)
    print(json.dumps(out, indent=1))
    exact = all(v["exact"] for k, v in out.items() if k.startswith("load_")) and out["dcp_async_cuda_exact"]
    return 0 if exact and all(s["ok"] for s in out["saves"]) else 1


if __name__ == "__main__":
    sys.exit(main())
