"""Building ``bytes`` results without a zero-fill and an extra copy.

Readers that must return ``bytes`` (``StripeFile.read``, fsspec's ``cat_file``)
receive straight into a new, uninitialised ``bytes`` object -- exactly how C
extensions build one -- instead of a ``bytearray`` that is zero-filled, sits 16
bytes off a page (6x slower kernel copies here) and is copied once more.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable

__all__ = ["fill_bytes"]


def _raw_bytes_api() -> tuple[Any, Any] | None:
    """CPython's ``PyBytes_FromStringAndSize(NULL, n)`` / ``PyBytes_AsString``, or None elsewhere."""
    if sys.implementation.name != "cpython":
        return None
    new = ctypes.pythonapi.PyBytes_FromStringAndSize
    new.restype, new.argtypes = ctypes.py_object, (ctypes.c_char_p, ctypes.c_ssize_t)
    addr = ctypes.pythonapi.PyBytes_AsString
    addr.restype, addr.argtypes = ctypes.c_void_p, (ctypes.py_object,)
    return new, addr


_RAW_BYTES = _raw_bytes_api()
_ALIGN = 64  # the kernel's copy into a buffer off a 64-byte boundary is ~6x slower (measured here)


def fill_bytes(n: int, fill: Callable[[memoryview, int], int]) -> bytes:
    """A new ``bytes`` of length ``n`` written in place by ``fill(view, pos)``.

    ``fill`` puts the bytes that belong at ``pos`` (relative to the result's start)
    into ``view`` and returns how many it put there (fewer only at end of file).

    Why not ``bytearray`` then ``bytes()``: that zero-fills, receives into memory
    16 bytes off alignment and copies once more. On CPython the result is
    allocated uninitialised, exactly as C extensions build ``bytes``, and the
    socket receives straight into it: from the first 64-byte boundary on in one
    call, the few bytes before it in another. Nobody sees the object before it
    is full. Elsewhere: ``bytearray`` and one copy.
    """
    if n <= 0:
        return b""
    if _RAW_BYTES is None or n < 2:  # CPython shares its 1-byte objects: never write into those
        buf = bytearray(n)
        got = fill(memoryview(buf), 0)
        return bytes(buf[:got])
    new, as_string = _RAW_BYTES
    out = new(None, n)
    addr = as_string(out)
    view = memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
    try:
        head = min((-addr) % _ALIGN, n) if n >= 1 << 20 else 0
        got = fill(view[:head], 0) if head else 0
        if got == head:
            got += fill(view[head:], head)
    finally:
        view.release()
    return out if got == n else out[:got]
