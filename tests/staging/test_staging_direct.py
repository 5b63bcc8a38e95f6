"""The local copy of a save goes to the disk with O_DIRECT (staging._save ``_write_direct``)
and the upload reads it back the same way (staging._mover ``_StagedFile``): its bytes bypass
the page cache, and every byte still loads back equal, from the local copy and the store."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from stripefs import staging
from stripefs.staging import Mover, MoverOptions, _mover, _save
from tests.core.test_direct_writes import _resident_pages

MIB = 1 << 20


def _takes_direct_io(directory: str) -> bool:
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, "probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.rand(MIB // 2, generator=g), "b": torch.rand(MIB // 4 + 3, generator=g),
            "small": torch.arange(100)}


@pytest.mark.parametrize("direct", [True, False])
def test_the_local_copy_leaves_the_page_cache_alone_and_loads_back_equal(cluster, testdir, tmp_path, monkeypatch,
                                                                         direct):
    sdir = str(tmp_path / "staging")
    if direct and not _takes_direct_io(sdir):
        pytest.skip("the temporary directory's file system takes no O_DIRECT")
    monkeypatch.setattr(_save, "DIRECT_LOCAL", direct)
    monkeypatch.setattr(_mover, "DIRECT_LOCAL", direct)
    ref = _state()
    url = f"stripefs:/{testdir}/step-1"
    h = staging.save(ref, url, staging_dir=sdir, cluster=cluster.file, upload=False, background_mover=False)
    assert h.wait(60, durable="local")
    data = os.path.join(sdir, "steps", h.id, "data-00000.bin")
    size = os.path.getsize(data)
    whole = size - size % 4096
    assert size > 2 * MIB
    resident = _resident_pages(data, 0, whole)
    if direct:
        assert resident == 0  # written by DMA, never copied into the cache
    else:
        assert resident == whole // 4096  # the buffered write's pages stay cached

    # The upload reads the staged file (the snapshot was given back at local durability).
    mover = Mover(sdir, MoverOptions(cluster=cluster.file))
    assert mover.run_once() == {h.id: "committed"}
    if direct:
        assert _resident_pages(data, 0, whole) == 0  # read back by DMA too
    for prefer_local in (False, True):
        out = staging.load(url, cluster=cluster.file, staging_dir=sdir, prefer_local=prefer_local)
        assert set(out) == set(ref) and all(torch.equal(out[k], ref[k]) for k in ref)


def test_a_buffer_off_its_page_is_written_through_the_cache(tmp_path, monkeypatch):
    if not _takes_direct_io(str(tmp_path)):
        pytest.skip("the temporary directory's file system takes no O_DIRECT")
    monkeypatch.setattr(_save, "DIRECT_LOCAL", True)
    raw = bytearray(os.urandom(3 * MIB + 1))
    view = memoryview(raw)[1:]  # whatever bytearray's alignment, one of raw/raw[1:] is off a page
    final = str(tmp_path / "step")
    _save.write_local_dir(final, [("data-00000.bin", view), ("other.bin", memoryview(bytes(raw)))], b"{}")
    with open(os.path.join(final, "data-00000.bin"), "rb") as f:
        assert f.read() == bytes(view)
    with open(os.path.join(final, "other.bin"), "rb") as f:
        assert f.read() == bytes(raw)
