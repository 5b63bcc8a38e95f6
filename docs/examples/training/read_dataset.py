"""Read every sample of the dataset once and say how fast; print its digest.

usage: python read_dataset.py [--cluster C] --data /data/ds [--batch 64] [--workers 2]
       python read_dataset.py --mount /mnt/sfs/data/ds [--batch 64] [--workers 2]

The first form is the recommended loader: IndexDataset under a torch DataLoader, each
batch read through one ring into one buffer. The second reads the same files through a
FUSE mount with plain ``open``/``read`` (what any existing dataset class does).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

import stripefs
from stripefs.fsclient.batchread.dataset import IndexDataset, loader

from common import digest, local_index, remote_index


class MountedFiles(Dataset):
    """One sample per file under a mount: plain open/read."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.paths[i], "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cluster")
    p.add_argument("--data", help="the dataset's folder in stripefs")
    p.add_argument("--mount", help="the dataset's folder under a FUSE mount (instead of --data)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    t0 = time.monotonic()
    if a.mount:
        index = local_index(a.mount)
        root = a.mount
        batches = DataLoader(MountedFiles([path for path, _n, _l in index]), batch_size=a.batch,
                             num_workers=a.workers, collate_fn=list)
    else:
        with stripefs.Client(a.cluster) as client:
            index = remote_index(client, a.data)
        root = a.data
        ds = IndexDataset([(path, 0, size) for path, size, _label in index], cluster=a.cluster)
        batches = loader(ds, batch_size=a.batch, num_workers=a.workers)
    listed = time.monotonic() - t0
    samples, nbytes, i = [], 0, 0
    for batch in batches:
        for j in range(len(batch)):
            data = bytes(batch[j].numpy())
            samples.append((os.path.relpath(index[i][0], root), data))
            nbytes += len(data)
            i += 1
    took = time.monotonic() - t0
    samples.sort()
    print(f"read {i} files, {nbytes / 2**20:.1f} MiB in {took:.2f} s (listing {listed:.2f} s): "
          f"{i / took:,.0f} files/s, {nbytes / 2**20 / took:.1f} MiB/s; sha256 {digest(samples)}")


if __name__ == "__main__":
    main()
