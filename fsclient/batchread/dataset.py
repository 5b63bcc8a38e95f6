"""torch datasets over stripefs files that read whole batches through one ring into one buffer.

* :class:`RecordDataset`: fixed-size records laid end to end in one or more files
  (sample ``i`` is bytes ``[i*record_size, (i+1)*record_size)`` of the files
  taken in order); items are tensors of a given dtype and shape.
* :class:`IndexDataset`: an index of ``(path, offset, length)`` samples; items
  are ``uint8`` tensors; a batch is a :class:`Batch` (one buffer plus offsets).

Both implement ``__getitems__``: with ``DataLoader(batch_size=B, collate_fn=collate_batch)``
(or :func:`loader`) a worker gets the batch's indices from the batch sampler,
prepares all ``B`` reads on its :class:`~fsclient.batchread.ReadRing`, and the
bytes land straight in one tensor. In a worker that tensor lives in torch shared
memory from the start, so handing it to the main process copies nothing.

    >>> ds = RecordDataset("/data/train.bin", 3 * 224 * 224, shape=(3, 224, 224), cluster="c.json")
    >>> for images in loader(ds, batch_size=64, shuffle=True, num_workers=2):
    ...     ...   # images: uint8 tensor (64, 3, 224, 224)

Files are registered (stat) once, when the dataset is made; workers (fork or
spawn) connect lazily, one client and ring per process.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from stripefs.wire import ErrorCode, StripefsError

from ..core import Client, ClusterConfig, find_cluster
from ._ring import ReadRing, RegisteredFile

__all__ = ["RecordDataset", "IndexDataset", "Batch", "collate_batch", "loader"]


@dataclass
class Batch:
    """Samples of different lengths in one buffer: sample ``j`` is ``data[offsets[j]:][:lengths[j]]``.

    ``lengths`` are bytes actually read (short where a sample runs past EOF).
    """

    data: torch.Tensor  # uint8, one buffer for the whole batch
    offsets: torch.Tensor  # int64
    lengths: torch.Tensor  # int64

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, j: int) -> torch.Tensor:
        start = int(self.offsets[j])
        return self.data[start : start + int(self.lengths[j])]


def collate_batch(batch: Any) -> Any:
    """``collate_fn`` for these datasets: the batch is already one tensor; pass it through."""
    return batch


def loader(dataset: Dataset, batch_size: int, **kw: Any) -> DataLoader:
    """A ``DataLoader`` that reads each batch through one ring (``collate_fn=collate_batch``)."""
    return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_batch, **kw)


def _batch_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor for one batch; torch shared memory inside a DataLoader worker."""
    if get_worker_info() is not None:
        # Like default_collate: allocate in shared memory up front so sending the batch
        # to the main process passes a handle instead of copying it.
        storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
        return torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]
    return torch.empty(nbytes, dtype=torch.uint8)


class _RingDataset(Dataset):
    """Per-process client and ring, made lazily (after fork or spawn)."""

    def __init__(self, cluster: "str | os.PathLike[str] | ClusterConfig | Client | None", ring_entries: int):
        self.config = cluster.config if isinstance(cluster, Client) else find_cluster(cluster)
        self.ring_entries = ring_entries
        self._pid = -1
        self._client: Client | None = None
        self._ring: ReadRing | None = None

    def _register(self, paths: Sequence[str]) -> list[RegisteredFile]:
        with Client(self.config) as client:
            ring = ReadRing(client, entries=1)
            return ring.open_many(paths)  # 200 files per metadata round trip

    def ring(self) -> ReadRing:
        """This process's ring (made on first use in each process)."""
        if self._pid != os.getpid() or self._ring is None:
            self._client = Client(self.config)
            self._ring = ReadRing(self._client, entries=self.ring_entries)
            self._pid = os.getpid()
        return self._ring

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_pid=-1, _client=None, _ring=None)  # connections do not travel
        return state


class RecordDataset(_RingDataset):
    """Fixed-size records in stripefs files.

    Args:
        paths: one path or several (records continue from file to file; a tail
            shorter than a record is ignored).
        record_size: bytes per record.
        dtype: element type of an item; ``shape``: item shape (default: flat).
        cluster: ``cluster.json`` path, ``ClusterConfig`` or a ``Client``.
        ring_entries: reads in flight per process.

    Raises:
        StripefsError: INVALID when ``shape``/``dtype`` do not match ``record_size``;
            errors of ``stat`` for missing files.
    """

    def __init__(self, paths: str | Sequence[str], record_size: int, *, dtype: torch.dtype = torch.uint8,
                 shape: Sequence[int] | None = None, cluster: Any = None, ring_entries: int = 1024):
        super().__init__(cluster, ring_entries)
        if record_size <= 0:
            raise StripefsError(ErrorCode.INVALID, f"record_size must be positive, got {record_size}")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.shape = tuple(shape) if shape is not None else (record_size // itemsize,)
        if int(np.prod(self.shape)) * itemsize != record_size:
            raise StripefsError(ErrorCode.INVALID, f"shape {self.shape} of {dtype} is not {record_size} bytes")
        self.record_size, self.dtype = record_size, dtype
        self.files = self._register([paths] if isinstance(paths, str) else list(paths))
        counts = [f.size // record_size for f in self.files]
        self._starts = np.cumsum([0] + counts).tolist()

    def __len__(self) -> int:
        return self._starts[-1]

    def _locate(self, i: int) -> tuple[RegisteredFile, int]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"record {i} out of range ({n} records)")
        k = bisect.bisect_right(self._starts, i) - 1
        return self.files[k], (i - self._starts[k]) * self.record_size

    def _read(self, indices: Sequence[int]) -> torch.Tensor:
        rs = self.record_size
        out = _batch_buffer(len(indices) * rs)
        view = memoryview(out.numpy())
        reads = [(view[j * rs : (j + 1) * rs], *self._locate(int(i)), rs) for j, i in enumerate(indices)]
        counts = self.ring().read(reads)
        for (_v, f, off, _n), got in zip(reads, counts):
            if got != rs:  # the file shrank since registration
                raise StripefsError(ErrorCode.RANGE, f"short record at {off} ({got} of {rs} bytes)", f.path)
        return out.view(self.dtype)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._read([i]).reshape(self.shape)

    def __getitems__(self, indices: Sequence[int]) -> torch.Tensor:
        """The whole batch through one ring into one tensor of shape ``(len(indices), *shape)``."""
        return self._read(indices).reshape(len(indices), *self.shape)


class IndexDataset(_RingDataset):
    """Samples named by an index of ``(path, offset, length)``.

    Args:
        index: the samples; paths are registered once each.
        cluster: ``cluster.json`` path, ``ClusterConfig`` or a ``Client``.
        ring_entries: reads in flight per process.
    """

    def __init__(self, index: Sequence[tuple[str, int, int]], *, cluster: Any = None, ring_entries: int = 1024):
        super().__init__(cluster, ring_entries)
        names = sorted({p for p, _o, _n in index})
        self.files = self._register(names)
        pos = {p: k for k, p in enumerate(names)}
        # Arrays, not a list of tuples: an index of millions of samples stays compact.
        self._file = np.fromiter((pos[p] for p, _o, _n in index), dtype=np.int32, count=len(index))
        self._off = np.fromiter((o for _p, o, _n in index), dtype=np.int64, count=len(index))
        self._len = np.fromiter((n for _p, _o, n in index), dtype=np.int64, count=len(index))
        if len(index) and (self._off.min() < 0 or self._len.min() < 0):
            raise StripefsError(ErrorCode.INVALID, "negative offset or length in the index")

    def __len__(self) -> int:
        return len(self._file)

    def __getitem__(self, i: int) -> torch.Tensor:
        b = self.__getitems__([i])
        return b.data[: int(b.lengths[0])]

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        """The whole batch through one ring into one buffer."""
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range ({len(self)} samples)")
        lens = self._len[idx]
        offsets = np.concatenate(([0], np.cumsum(lens)[:-1])) if len(idx) else lens
        out = _batch_buffer(int(lens.sum()))
        view = memoryview(out.numpy())
        reads = [(view[int(s) : int(s) + int(n)], self.files[int(self._file[i])], int(self._off[i]), int(n))
                 for s, n, i in zip(offsets, lens, idx)]
        counts = self.ring().read(reads)
        return Batch(out, torch.from_numpy(offsets.astype(np.int64)), torch.tensor(counts, dtype=torch.int64))
