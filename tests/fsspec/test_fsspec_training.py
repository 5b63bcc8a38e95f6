"""``stripefs://`` under training code: DataLoader workers (fork and spawn), pandas/pyarrow
Parquet, and torch.distributed.checkpoint through torch's own FsspecWriter/FsspecReader."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import fsspec
import pytest

from stripefs.fsclient.fsspec import StripeFileSystem

torch = pytest.importorskip("torch")


class RangeDataset(torch.utils.data.Dataset):
    """Each item: one range of a file, fetched in the worker through the pickled filesystem."""

    def __init__(self, fs: StripeFileSystem, path: str, n: int, size: int):
        self.fs, self.path, self.n, self.size = fs, path, n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        # Two calls per item: a single range and a batch, so both code paths run in workers.
        one = self.fs.cat_file(self.path, i * self.size, (i + 1) * self.size)
        batch = self.fs.cat_ranges([self.path] * 2, [i * self.size] * 2, [(i + 1) * self.size] * 2)
        assert batch == [one, one]
        return torch.tensor([os.getpid(), int(hashlib.sha256(one).hexdigest()[:12], 16)], dtype=torch.int64)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers(sfs: StripeFileSystem, root: str, start_method: str) -> None:
    size, n = 100_000, 12
    data = os.urandom(size * n)
    path = f"{root}/shard.bin"
    sfs.pipe(path, data)
    assert sfs.cat_file(path, 0, 10) == data[:10]  # parent has live connections and threads before the fork
    loader = torch.utils.data.DataLoader(
        RangeDataset(sfs, path, n, size), batch_size=3, num_workers=2,
        multiprocessing_context=start_method, timeout=120,  # a hang (peers' fork bug) fails, not blocks
    )
    rows = torch.cat(list(loader)).tolist()
    assert [h for _pid, h in rows] == [int(hashlib.sha256(data[i * size:(i + 1) * size]).hexdigest()[:12], 16) for i in range(n)]
    assert os.getpid() not in {pid for pid, _h in rows} and len({pid for pid, _h in rows}) == 2
    assert sfs.cat_file(path, -5) == data[-5:]  # the parent still works after its children exit


def test_pandas_parquet_roundtrip(cluster_env: str, root: str) -> None:
    pd = pytest.importorskip("pandas")
    pq = pytest.importorskip("pyarrow.parquet")
    df = pd.DataFrame({"step": range(5000), "loss": [1.0 / (i + 1) for i in range(5000)], "tag": ["a", "b"] * 2500})
    url = f"stripefs:/{root}/metrics.parquet"
    df.to_parquet(url, row_group_size=1000)
    back = pd.read_parquet(url)
    pd.testing.assert_frame_equal(back, df)
    # pyarrow on the fsspec filesystem directly: column projection reads ranges of the file.
    fs, path = fsspec.url_to_fs(url)
    table = pq.read_table(path, filesystem=fs, columns=["loss"])
    assert table.num_rows == 5000 and table.column_names == ["loss"]
    assert pq.ParquetFile(path, filesystem=fs).metadata.num_row_groups == 5


def test_torch_dcp_fsspec_writer_reader(cluster_env: str, root: str) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    url = f"stripefs:/{root}/ckpt"
    state = {"w": torch.randn(300, 257), "b": torch.arange(1000, dtype=torch.int32), "step": torch.tensor(7)}
    dcp.save(state, storage_writer=FsspecWriter(url, thread_count=2))
    fs, path = fsspec.url_to_fs(url)
    assert fs.exists(f"{path}/.metadata") and not [p for p in fs.ls(path, detail=False) if p.endswith(".tmp")]
    target = {"w": torch.zeros(300, 257), "b": torch.zeros(1000, dtype=torch.int32), "step": torch.tensor(0)}
    dcp.load(target, storage_reader=FsspecReader(url))
    for k in state:
        assert torch.equal(target[k], state[k]), k
