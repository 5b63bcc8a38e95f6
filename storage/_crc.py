"""One CRC32C pass over a write's payload.

A write must be checked against the CRC32C the client sent for the whole payload
(end to end), and the chunk keeps the CRC32C of each 64 KiB block. Computing both
directly passes over the payload twice. Instead each block-aligned segment is
hashed once, and the whole payload's CRC is assembled from the segments' CRCs:
for the standard (pre- and post-inverted) CRC, ``crc(A + B)`` is ``crc(A)``
multiplied by ``x^(8 * len(B))`` modulo the polynomial, xor ``crc(B)`` (the
"combine" of zlib's ``crc32.c``). The multiplication by the one constant a full
block needs is table-driven (four lookups); a shorter segment at the payload's
end is chained over once more instead (at most one block).
"""

from __future__ import annotations

import crc32c

from stripefs.wire import CRC_BLOCK

__all__ = ["payload_crcs"]

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial, both in the CRC's reflected bit order."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x_pow_8n(n: int) -> int:
    """``x^(8n)`` modulo the polynomial: what appending ``n`` bytes multiplies a CRC by."""
    result, base, e = 1 << 31, 1 << 30, 8 * n  # x^0, x^1 (reflected)
    while e:
        if e & 1:
            result = _multmodp(base, result)
        base = _multmodp(base, base)
        e >>= 1
    return result


def _shift_tables(n: int) -> tuple[list[int], ...]:
    """Multiplication by ``x^(8n)`` as four byte tables (it is linear in the CRC's bits)."""
    k = _x_pow_8n(n)
    tables = []
    for j in range(4):
        t = [0] * 256
        for bit in range(8):
            t[1 << bit] = _multmodp(k, 1 << (8 * j + bit))
        for b in range(3, 256):
            low = b & -b
            if b != low:
                t[b] = t[b ^ low] ^ t[low]
        tables.append(t)
    return tuple(tables)


_T0, _T1, _T2, _T3 = _shift_tables(CRC_BLOCK)


def payload_crcs(data: memoryview, offset: int) -> tuple[list[int], int]:
    """The CRC32C of each segment of ``data`` written at chunk ``offset`` (cut at the
    64 KiB block boundaries, as :func:`wire.segments`), and of the whole payload.

    One pass over the bytes, plus at most one block (a short last segment).
    """
    crc, t0, t1, t2, t3 = crc32c.crc32c, _T0, _T1, _T2, _T3
    n = len(data)
    if n == 0:
        return [], 0
    pos = min(n, CRC_BLOCK - offset % CRC_BLOCK)
    whole = crc(data[:pos])
    crcs = [whole]
    while pos + CRC_BLOCK <= n:  # whole blocks: combined by table
        c = crc(data[pos : pos + CRC_BLOCK])
        crcs.append(c)
        whole = t0[whole & 255] ^ t1[(whole >> 8) & 255] ^ t2[(whole >> 16) & 255] ^ t3[whole >> 24] ^ c
        pos += CRC_BLOCK
    if pos < n:  # a short last segment: chained on as well
        tail = data[pos:]
        crcs.append(crc(tail))
        whole = crc(tail, whole)
    return crcs, whole
