"""DCP tensors read straight into their targets.

torch's ``FileSystemReader`` ``torch.load``s every stored tensor into fresh memory and then
copies it into the tensor the load plan names: two passes over the state and a page fault per
fresh page. A tensor that ``StagedStorageWriter`` wrote is one ``torch.save`` of one
contiguous tensor (DCP clones any tensor whose storage is larger than itself): a small zip whose
``data.pkl`` says the dtype, shape and strides and whose ``data/0`` record holds the raw bytes,
stored uncompressed. :func:`stored_tensor` reads that description (a pickle read by an
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
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

__all__ = ["StoredTensor", "stored_tensor", "is_contiguous"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (skipped), file name length, extra length


@dataclass(frozen=True)
class StoredTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_offset: int  # of the raw bytes, from the start of the torch.save record
    nbytes: int


class _Slice(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of a seekable binary file."""

    def __init__(self, f: Any, offset: int, length: int):
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        dest = memoryview(b).cast("B")[: max(0, self.length - self.pos)]
        self.f.seek(self.offset + self.pos)
        n = self.f.readinto(dest)
        self.pos += n
        return n


@lru_cache(maxsize=None)
def _storage_dtypes() -> dict[str, torch.dtype]:
    """``FloatStorage`` -> ``torch.float32``, ...: the storage class names torch.save pickles."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; its names are what is stored
        for name in dir(torch):
            cls = getattr(torch, name)
            if name.endswith("Storage") and isinstance(cls, type) and issubclass(cls, torch.storage._LegacyStorage):
                out[name] = cls.dtype
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


def stored_tensor(f: Any, offset: int, length: int) -> StoredTensor | None:
    """Where the raw bytes of the tensor ``torch.save``d at ``[offset, offset + length)`` of
    ``f`` lie, or ``None`` when the record is anything but one contiguous tensor stored
    uncompressed, in this machine's byte order, whose storage is exactly the tensor."""
    try:
        z = zipfile.ZipFile(_Slice(f, offset, length))
        names = {info.filename.split("/", 1)[-1]: info for info in z.infolist()}
        if "data.pkl" not in names or names.keys() & {"byteorder"} and z.read(names["byteorder"]).decode() != sys.byteorder:
            return None
        desc = _Description(io.BytesIO(z.read(names["data.pkl"]))).load()
        records = [info for key, info in names.items() if key.startswith("data/")]
        if not (isinstance(desc, tuple) and len(desc) == 5 and desc[0] == "tensor") or len(records) != 1:
            return None
        _, pid, storage_offset, shape, stride = desc
        kind, dtype_of, key, _location, numel = pid
        record = records[0]
        if (kind != "storage" or not isinstance(dtype_of, tuple) or record.filename.split("/")[-1] != str(key)
                or record.compress_type != zipfile.ZIP_STORED or storage_offset != 0):
            return None
        dtype = dtype_of[1]
        count = 1
        for n in shape:
            count *= n
        nbytes = count * dtype.itemsize
        if count != numel or not is_contiguous(shape, stride) or record.file_size != nbytes:
            return None
        raw = _Slice(f, offset, length)
        raw.seek(record.header_offset)
        head = raw.read(_LOCAL_HEADER.size)
        sig, name_len, extra_len = _LOCAL_HEADER.unpack(head)
        if sig != b"PK\x03\x04":
            return None
        data_offset = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if data_offset + nbytes > length:
            return None
        return StoredTensor(dtype, tuple(shape), data_offset, nbytes)
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, TypeError, KeyError, struct.error, EOFError):
        return None
