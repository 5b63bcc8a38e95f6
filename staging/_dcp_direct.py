"""DCP tensors read straight into their targets.

torch's ``FileSystemReader`` ``torch.load``s every stored tensor into fresh memory and then
copies it into the tensor the load plan names: two passes over the state and a page fault per
fresh page. A tensor that ``StagedStorageWriter`` wrote is one ``torch.save`` of one
contiguous tensor (DCP clones any tensor whose storage is larger than itself): a small zip whose
``data.pkl`` says the dtype, shape and strides and whose ``data/0`` record holds the raw bytes,
stored uncompressed. :func:`stored_tensor` reads the zip's directory and that description (a pickle read by an
unpickler that knows only what a tensor's description holds), and the reader reads the record
straight into the target when the target is the whole stored tensor, contiguous, on the CPU
and of the same dtype. Anything else (a resharded load, a dtype the planner converts, a
transform) goes through torch's own path.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

__all__ = ["StoredTensor", "stored_tensor", "is_contiguous"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (skipped), file name length, extra length
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_END = struct.Struct("<4sHHHHIIH")


@dataclass(frozen=True)
class StoredTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_offset: int  # of the raw bytes, from the start of the torch.save record
    nbytes: int


@lru_cache(maxsize=None)
def _storage_dtypes() -> dict[str, torch.dtype]:
    """``FloatStorage`` -> ``torch.float32``, ...: the storage class names torch.save pickles."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; its names are what is stored
        for name in dir(torch):
            dtype = getattr(getattr(torch, name), "dtype", None) if name.endswith("Storage") else None
            if isinstance(dtype, torch.dtype):  # torch.FloatStorage.dtype; no private class named
                out[name] = dtype
    return out


def _rebuild(storage: Any, storage_offset: int, size: tuple, stride: tuple, *_rest: Any) -> tuple:
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride))


class _Description(pickle.Unpickler):
    """Unpickles a tensor's ``data.pkl`` into plain tuples; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _storage_dtypes():
            return ("dtype", _storage_dtypes()[name])
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a saved tensor")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major with no gaps (the stride of a dimension of size 1 says nothing)."""
    step = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != step:
            return False
        step *= n
    return len(shape) == len(stride)


def _read(f: Any, offset: int, n: int) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:
        raise ValueError("a torch.save record ends early")
    return data


def _directory(f: Any, offset: int, length: int) -> dict[str, tuple[int, int, int]]:
    """``{name after the archive's folder: (compression, size, local header offset)}`` of the
    zip at ``[offset, offset + length)``, from its central directory (no zip64: a record of
    4 GiB or more is left to torch)."""
    if length < _END.size:
        raise ValueError("too short for a zip")
    sig, disk, _cd_disk, count, total, cd_size, cd_offset, _comment = _END.unpack(
        _read(f, offset + length - _END.size, _END.size))
    if sig != b"PK\x05\x06" or disk != 0 or count != total or 0xFFFFFFFF in (cd_size, cd_offset) or \
            cd_offset + cd_size > length - _END.size:
        raise ValueError("no plain zip end record")
    cd, at, out = _read(f, offset + cd_offset, cd_size), 0, {}
    for _ in range(count):
        (sig, _made, _need, _flags, method, _t, _d, _crc, _csize, size, name_len, extra_len, comment_len,
         _disk, _iattr, _eattr, local) = _CENTRAL.unpack_from(cd, at)
        if sig != b"PK\x01\x02":
            raise ValueError("bad central directory entry")
        name = cd[at + _CENTRAL.size : at + _CENTRAL.size + name_len].decode()
        out[name.split("/", 1)[-1]] = (method, size, local)
        at += _CENTRAL.size + name_len + extra_len + comment_len
    return out


def _member(f: Any, offset: int, entry: tuple[int, int, int]) -> int:
    """The offset of a stored member's bytes from the start of the record."""
    method, _size, local = entry
    sig, name_len, extra_len = _LOCAL_HEADER.unpack(_read(f, offset + local, _LOCAL_HEADER.size))
    if sig != b"PK\x03\x04" or method != 0:  # 0: stored, not compressed
        raise ValueError("not a stored zip member")
    return local + _LOCAL_HEADER.size + name_len + extra_len


def stored_tensor(f: Any, offset: int, length: int) -> StoredTensor | None:
    """Where the raw bytes of the tensor ``torch.save``d at ``[offset, offset + length)`` of
    ``f`` lie, or ``None`` when the record is anything but one contiguous tensor stored
    uncompressed, in this machine's byte order, whose storage is exactly the tensor."""
    try:
        names = _directory(f, offset, length)
        if "byteorder" in names:
            at = _member(f, offset, names["byteorder"])
            if _read(f, offset + at, names["byteorder"][1]).decode() != sys.byteorder:
                return None
        at = _member(f, offset, names["data.pkl"])
        desc = _Description(io.BytesIO(_read(f, offset + at, names["data.pkl"][1]))).load()
        records = [key for key in names if key.startswith("data/")]
        if not (isinstance(desc, tuple) and len(desc) == 5 and desc[0] == "tensor") or len(records) != 1:
            return None
        _, pid, storage_offset, shape, stride = desc
        kind, dtype_of, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype_of, tuple) or records[0] != f"data/{key}" or storage_offset != 0:
            return None
        dtype = dtype_of[1]
        count = 1
        for n in shape:
            count *= n
        nbytes = count * dtype.itemsize
        if count != numel or not is_contiguous(shape, stride) or names[records[0]][1] != nbytes:
            return None
        data_offset = _member(f, offset, names[records[0]])
        if data_offset + nbytes > length:
            return None
        return StoredTensor(dtype, tuple(shape), data_offset, nbytes)
    except (pickle.UnpicklingError, ValueError, TypeError, KeyError, struct.error, EOFError, UnicodeDecodeError):
        return None
