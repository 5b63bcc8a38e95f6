"""Self-checking data: what every benchmark writes, so that every read can be verified.

File content is a fixed pseudo-random block of ``block`` bytes repeated from the start of
the file, with two 64-bit words stamped at the start of every 4 KiB page: the page's file
offset and a 64-bit id of the file's name. A read of any page-aligned range can therefore be
checked cheaply (the stamps: a route that returns another file's bytes, another offset's
bytes, or zeros fails at once) and, for a sample of reads, exactly (every byte compared).

Caveats:
    * Writers must start every ``write`` at a multiple of ``block`` from the file start (the
      workloads do); a range written otherwise fails verification, loudly.
    * Stamping mutates the shared block in place: a route must have copied or sent the bytes
      before ``write`` returns, as POSIX ``write`` semantics require.
"""

from __future__ import annotations

import mmap
import zlib

import numpy as np

__all__ = ["Pattern", "VerifyError", "file_id"]

PAGE = 4096
_WORDS = PAGE // 8


class VerifyError(AssertionError):
    """Bytes read back differ from what was written."""


def file_id(name: str) -> int:
    """64-bit id of a file name (stamped into every page)."""
    data = name.encode()
    return (zlib.crc32(data) << 32) | zlib.adler32(data)


class Pattern:
    """The repeated block, page-aligned and pre-faulted (never a fresh ``bytearray``).

    Args:
        block: size of the repeated block in bytes, a multiple of 4096.
    """

    def __init__(self, block: int):
        if block <= 0 or block % PAGE:
            raise ValueError(f"block must be a positive multiple of {PAGE}, not {block}")
        self.block = block
        self.buf = mmap.mmap(-1, block)
        rng = np.random.default_rng(20250101)
        self._base = np.frombuffer(self.buf, dtype=np.uint8)
        self._base[:] = rng.integers(0, 256, block, dtype=np.uint8)
        self._words = np.frombuffer(self.buf, dtype=np.uint64)
        self._pristine = self._base.copy()  # for exact comparison of sampled reads

    def stamped(self, fid: int, offset: int, n: int) -> memoryview:
        """The block stamped for file ``fid`` at ``offset``; a view of its first ``n`` bytes."""
        if offset % PAGE or n > self.block:
            raise ValueError("stamped ranges start on a page and fit in one block")
        pages = -(-n // PAGE)
        self._words[0:pages * _WORDS:_WORDS] = np.arange(offset, offset + pages * PAGE, PAGE,
                                                         dtype=np.uint64)
        self._words[1:pages * _WORDS:_WORDS] = np.uint64(fid)
        return memoryview(self.buf)[:n]

    def check(self, view: memoryview, fid: int, offset: int, exact: bool = False) -> int:
        """Verify ``view`` holds the file's bytes at ``offset``; returns bytes compared exactly.

        Raises:
            VerifyError: a stamp (or, with ``exact``, any byte) differs.
        """
        n = len(view)
        if offset % PAGE:
            raise ValueError("checked ranges start on a page")
        full = n // PAGE
        if full:
            words = np.frombuffer(view, dtype=np.uint64, count=full * _WORDS)
            want = np.arange(offset, offset + full * PAGE, PAGE, dtype=np.uint64)
            bad = np.flatnonzero((words[0::_WORDS] != want) | (words[1::_WORDS] != np.uint64(fid)))
            if bad.size:
                k = int(bad[0])
                raise VerifyError(f"page at file offset {offset + k * PAGE}: stamp "
                                  f"({int(words[k * _WORDS])}, {int(words[k * _WORDS + 1]):#x}) "
                                  f"!= ({offset + k * PAGE}, {fid:#x})")
        if not exact:
            return 0
        got = np.frombuffer(view, dtype=np.uint8, count=n)
        pos = 0
        while pos < n:  # compare segment by segment against the pristine block
            at = (offset + pos) % self.block
            k = min(n - pos, self.block - at)
            seg, ref = got[pos:pos + k], self._pristine[at:at + k]
            diff = seg != ref
            # the two stamp words of every page differ from the pristine block by design
            whole = k - k % PAGE  # ``at`` and ``pos`` are page-aligned: pages start at 0
            diff[:whole].reshape(-1, PAGE)[:, :16] = False
            diff[whole:whole + 16] = False
            if diff.any():
                i = int(np.flatnonzero(diff)[0])
                raise VerifyError(f"byte at file offset {offset + pos + i} differs")
            pos += k
        return n

    def close(self) -> None:
        del self._base, self._words
        self.buf.close()
