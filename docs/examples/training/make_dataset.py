"""Write a dataset of small files to a local folder: OUT/<class>/<n>.bin, one sample each.

usage: python make_dataset.py OUT [--files 3000] [--size 3072] [--seed 0]

A sample is ``--size`` bytes of pixels: its class's pattern plus noise, so a small
model can learn something. Prints the dataset's digest (common.digest), which
read_dataset.py prints too for what it read back.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from common import CLASSES, digest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--size", type=int, default=3 * 32 * 32, help="bytes per sample")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    patterns = rng.integers(96, 160, size=(CLASSES, a.size))  # faint: learnt over ~200 steps
    written = []
    for i in range(a.files):
        label = i % CLASSES
        noise = rng.normal(0, 48, size=a.size)
        data = np.clip(patterns[label] + noise, 0, 255).astype(np.uint8).tobytes()
        rel = f"{label}/{i:06d}.bin"
        os.makedirs(os.path.join(a.out, str(label)), exist_ok=True)
        with open(os.path.join(a.out, rel), "wb") as f:
            f.write(data)
        written.append((rel, data))
    written.sort()
    print(f"wrote {a.files} files, {a.files * a.size / 2**20:.1f} MiB to {a.out}; sha256 {digest(written)}")


if __name__ == "__main__":
    main()
