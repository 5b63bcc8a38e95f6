"""``_dcp_direct.stored_tensor``: where a ``torch.save``d tensor's raw bytes lie in its record,
or ``None`` for anything the DCP reader must leave to ``torch.load``."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from stripefs.staging._dcp_direct import stored_tensor


def _record(obj) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


@pytest.mark.parametrize("t", [torch.arange(10, dtype=torch.int16), torch.randn(3, 1, 5).to(torch.bfloat16),
                               torch.tensor(2.5, dtype=torch.float64), torch.ones(4, 1).t()])
def test_the_bytes_of_a_contiguous_tensor_are_found(t):
    pad = b"x" * 100  # a record inside a larger file
    data = pad + _record(t) + pad
    got = stored_tensor(io.BytesIO(data), len(pad), len(data) - 2 * len(pad))
    assert got is not None and got.dtype == t.dtype and got.shape == tuple(t.shape)
    start = len(pad) + got.data_offset
    raw = data[start : start + got.nbytes]
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=t.dtype).reshape(t.shape), t)


@pytest.mark.parametrize("obj", [torch.randn(4, 6).t(),  # saved with its strides
                                 torch.arange(10)[2:5],  # a view: the storage is larger
                                 {"a": torch.ones(2)}, [torch.ones(2), torch.ones(2)], 7])
def test_anything_else_is_left_to_torch(obj):
    data = _record(obj)
    assert stored_tensor(io.BytesIO(data), 0, len(data)) is None


def test_a_damaged_or_foreign_record_is_left_to_torch():
    data = bytearray(_record(torch.ones(8)))
    assert stored_tensor(io.BytesIO(bytes(data[:-30])), 0, len(data) - 30) is None  # cut short
    data[-22:-18] = b"XXXX"  # the end record's signature
    assert stored_tensor(io.BytesIO(bytes(data)), 0, len(data)) is None
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", zipfile.ZIP_DEFLATED) as z:  # compressed members
        src = zipfile.ZipFile(io.BytesIO(_record(torch.ones(8))))
        for info in src.infolist():
            z.writestr(info.filename, src.read(info))
    assert stored_tensor(io.BytesIO(b.getvalue()), 0, len(b.getvalue())) is None
    assert stored_tensor(io.BytesIO(b"not a record at all, and long enough"), 0, 36) is None
