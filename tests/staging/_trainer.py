"""Subprocess trainer for the kill -9 tests: saves steps of a small state dict in a loop.

usage: _trainer.py CLUSTER STAGING PREFIX FIRST_STEP COUNT MB [--no-upload]
Prints "saved N" after each globally (or, with --no-upload, locally) durable step.
"""

import sys

import torch

from stripefs import staging


def main() -> None:
    cluster, sdir, prefix, first, count, mb = sys.argv[1:7]
    upload = "--no-upload" not in sys.argv
    n = int(float(mb) * (1 << 20)) // 4
    for step in range(int(first), int(first) + int(count)):
        g = torch.Generator().manual_seed(step)
        state = {"w": torch.randn(n, generator=g), "step": step, "small": torch.full((7,), float(step))}
        h = staging.save(state, f"{prefix}/step-{step:06d}", staging_dir=sdir, cluster=cluster, upload=upload,
                         background_mover=False, keep_local=None)
        h.wait(durable="global" if upload else "local")
        print("saved", step, flush=True)


if __name__ == "__main__":
    main()
