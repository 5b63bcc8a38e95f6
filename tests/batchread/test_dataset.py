"""torch datasets: whole batches through one ring into one tensor, with DataLoader workers (fork, spawn)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stripefs.fsclient import Client
from stripefs.fsclient.batchread.dataset import Batch, IndexDataset, RecordDataset, collate_batch, loader
from stripefs.wire import StripefsError

REC = 3 * 16 * 16 * 4  # float32 (3, 16, 16)


@pytest.fixture(scope="module")
def records(cluster) -> tuple[list[str], np.ndarray]:
    """Two files of float32 records (the second ends with a partial record)."""
    client = cluster.client()
    rng = np.random.default_rng(7)
    arr = rng.standard_normal((70, 3, 16, 16)).astype(np.float32)
    raw = arr.tobytes()
    client.makedirs("/records")
    client.write_bytes("/records/a.bin", raw[: 40 * REC])
    client.write_bytes("/records/b.bin", raw[40 * REC :] + b"partial")
    client.close()
    return ["/records/a.bin", "/records/b.bin"], arr


def test_record_dataset_items_and_batches(cluster, records) -> None:
    paths, arr = records
    ds = RecordDataset(paths, REC, dtype=torch.float32, shape=(3, 16, 16), cluster=cluster.file)
    assert len(ds) == 70
    assert torch.equal(ds[0], torch.from_numpy(arr[0])) and torch.equal(ds[-1], torch.from_numpy(arr[69]))
    idx = [69, 3, 40, 39, 3]
    batch = ds.__getitems__(idx)
    assert batch.shape == (5, 3, 16, 16) and batch.dtype == torch.float32
    assert torch.equal(batch, torch.from_numpy(arr[idx]))
    with pytest.raises(IndexError):
        ds[70]
    with pytest.raises(StripefsError, match="not 1000 bytes"):
        RecordDataset(paths, 1000, dtype=torch.float32, shape=(3, 16, 16), cluster=cluster.file)


@pytest.mark.parametrize("method,workers", [(None, 0), ("fork", 2), ("spawn", 1)])
def test_record_dataset_with_dataloader(cluster, records, method, workers) -> None:
    paths, arr = records
    ds = RecordDataset(paths, REC, dtype=torch.float32, shape=(3, 16, 16), cluster=cluster.file)
    kw = {"num_workers": workers, "multiprocessing_context": method} if workers else {}
    seen = []
    g = torch.Generator().manual_seed(0)
    for batch in loader(ds, batch_size=16, shuffle=True, generator=g, **kw):
        assert batch.ndim == 4 and batch.shape[1:] == (3, 16, 16)
        seen.append(batch)
    got = torch.cat(seen)
    assert got.shape[0] == 70
    # every record exactly once, each equal to the reference
    ref = torch.from_numpy(arr).reshape(70, -1)
    matched = sorted(int(torch.nonzero((ref == row).all(1))[0]) for row in got.reshape(70, -1))
    assert matched == list(range(70))


def test_index_dataset_ragged_batches(cluster, records) -> None:
    paths, arr = records
    raw = arr.tobytes()
    client = Client(cluster.file)
    size_b = client.stat(paths[1]).size
    client.close()
    index = [(paths[0], 0, 10), (paths[1], 5, 1000), (paths[0], 100, 0), (paths[1], size_b - 3, 50)]
    ds = IndexDataset(index, cluster=cluster.file)
    assert len(ds) == 4
    b = ds.__getitems__([0, 1, 2, 3])
    assert isinstance(b, Batch) and len(b) == 4
    assert b.lengths.tolist() == [10, 1000, 0, 3]  # the last one is short: past EOF
    assert bytes(b[0].numpy()) == raw[:10]
    assert bytes(b[1].numpy()) == raw[40 * REC + 5 : 40 * REC + 1005]
    assert bytes(b[3].numpy()) == b"ial"
    assert bytes(ds[1].numpy()) == raw[40 * REC + 5 : 40 * REC + 1005]
    batches = list(loader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork"))
    assert [bb.lengths.tolist() for bb in batches] == [[10, 1000], [0, 3]]
    assert collate_batch(b) is b


def test_files_register_in_batches_and_a_bad_one_is_named(cluster, records, monkeypatch) -> None:
    """A dataset of many files registers them 200 per metadata round trip (StatMany),
    not one stat each; a missing path or a directory fails naming that path."""
    from stripefs.fsclient.batchread import ReadRing

    paths, _ = records
    client = Client(cluster.file)
    sent: list[str] = []
    call = client._core.call

    def recording(msg, *args, **kwargs):
        sent.append(type(msg).__name__)
        return call(msg, *args, **kwargs)

    monkeypatch.setattr(client._core, "call", recording)
    ring = ReadRing(client, entries=1)
    try:
        many = paths * 250  # 500 registrations
        files = ring.open_many(many)
        assert [f.path for f in files] == many
        assert [f.size for f in files[:2]] == [client.stat(p).size for p in paths]
        assert sent.count("StatMany") == 3 and "Resolve" not in sent[:3]
        with pytest.raises(FileNotFoundError) as err:
            ring.open_many([paths[0], "/records/none.bin"])
        assert err.value.filename == "/records/none.bin"
        with pytest.raises(IsADirectoryError):
            ring.open_many(["/records"])
    finally:
        ring.close()
        client.close()
