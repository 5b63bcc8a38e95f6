"""What the walkthrough's scripts share: the sample format, the index, the data order.

The dataset is a tree of small files, one sample each, in a folder per class
(``ds/3/000042.bin``), CIFAR-sized by default: 3 x 32 x 32 bytes of pixels.
See docs/training.md.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Iterator

import numpy as np

CLASSES = 10


def remote_index(client, root: str) -> list[tuple[str, int, int]]:
    """Every sample under ``root`` in the file system, in name order: ``(path, size, label)``.

    One listing per class folder (attributes come with the names: no ``stat`` per file).
    """
    out = []
    for folder in sorted(e.name for e in client.scandir(root, attrs=False)):
        base = f"{root.rstrip('/')}/{folder}"
        for e in sorted(client.scandir(base), key=lambda e: e.name):
            out.append((f"{base}/{e.name}", e.attr.size, int(folder)))
    return out


def local_index(root: str) -> list[tuple[str, int, int]]:
    """The same for a local folder (the dataset before upload, or seen through a FUSE mount)."""
    out = []
    for folder in sorted(os.listdir(root)):
        base = os.path.join(root, folder)
        for name in sorted(os.listdir(base)):
            out.append((os.path.join(base, name), os.path.getsize(os.path.join(base, name)), int(folder)))
    return out


def digest(samples: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 over (path relative to the dataset root, bytes) in order: equal digests, equal datasets."""
    h = hashlib.sha256()
    for rel, data in samples:
        h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


class StepBatches:
    """The batch order as a function of the step alone: step ``s`` is batch ``s % per_epoch``
    of the permutation seeded by ``(seed, s // per_epoch)``.

    A run resumed at step ``s`` therefore reads exactly the batches the uninterrupted run
    read from ``s`` on: the checkpoint needs no sampler or RNG state, only the step.
    Use it as a DataLoader's ``batch_sampler``.
    """

    def __init__(self, n: int, batch: int, seed: int, start: int, stop: int):
        self.n, self.batch, self.seed, self.start, self.stop = n, batch, seed, start, stop
        self.per_epoch = n // batch

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.stop):
            epoch, k = divmod(step, self.per_epoch)
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            yield perm[k * self.batch : (k + 1) * self.batch].tolist()
