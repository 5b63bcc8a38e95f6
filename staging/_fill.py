"""Filling fresh tensors from a checkpoint's raw data files: the jobs of a load and their checks.

A restore is bound by what each byte costs on its way into memory the process has never
touched, so every byte is moved once and checked while it is still in cache:

* A tensor of at least ``DIRECT`` bytes and one piece is read straight into its own memory in
  *pieces* cut at the file's chunk boundaries (``src.piece`` bytes: one storage chunk, which one
  request fetches and the reading thread receives itself), spread over all reader threads. (A
  smaller one would cost a request of its own all the same: it goes in a run, below.) Each piece's CRC32C
  is computed as soon as it lands; the tensor's is combined from them (:func:`crc_combine`):
  no second pass over the tensor. The thread that lands a tensor's last piece checks it.
* A run of small tensors is one read. From a local file it is a single ``preadv`` scattered
  straight into the tensors (gaps go to a pad buffer); from the store it lands in the reading
  thread's scratch buffer (reused, so faulted once) and is copied out with ``memmove``, which
  releases the GIL.
* Fresh memory of at least ``HUGE_MIN`` bytes is asked for in 2 MiB pages
  (``madvise(MADV_HUGEPAGE)``): its first touch then costs 1/512 of the page faults, which on
  the 2-core machines this was measured on cost about as much as the receive itself. Not in a
  virtual machine whose balloon reports free pages to its host (virtio feature
  ``VIRTIO_BALLOON_F_REPORTING``): there a freed 2 MiB block is handed back to the host within
  seconds, and a huge page is then zeroed on memory the host must first provide: 1 GiB of
  fresh tensors took 0.8-1.6 s to touch in huge pages against 0.26-0.31 s in 4 KiB pages
  (which come from memory the guest keeps), and a restore from the store ran at half the speed.
  ``STRIPEFS_LOAD_HUGEPAGES=1`` or ``0`` decides it either way.

Caveats:
    * Huge pages are advice: a kernel without transparent huge pages, or set to ``never``,
      ignores it and the load runs on 4 KiB pages. With ``defrag`` set to ``madvise`` the kernel
      may compact memory on a first touch: on a badly fragmented machine a load can stall there.
    * A tensor's last piece is read twice by the CRC (combining a piece of any length would
      cost as much): at most ``src.piece`` bytes per tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
import threading
from typing import Any, Callable, Protocol

import crc32c
import torch

from ._format import ChecksumError, crc_combine, dtype_from_name

__all__ = ["DIRECT", "RUN_BYTES", "Reader", "raw_jobs", "fresh", "dest_of", "bytes_of", "fill_exact", "read_exact"]

DIRECT = 1 << 20  # tensors this large are read into their own memory; smaller ones in runs
RUN_BYTES = 8 << 20  # the most one run of small tensors reads at once (the thread's scratch)
HUGE_MIN = 4 << 20  # fresh memory this large is advised into huge pages
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_IOV_MAX = 1024


class Reader(Protocol):
    """Where the bytes come from (``_load._Source``)."""

    root: str
    local: bool

    def piece(self, name: str) -> int: ...
    def pread_into(self, name: str, dest: memoryview, offset: int) -> int: ...
    def preadv(self, name: str, dests: list[memoryview], offset: int) -> int: ...


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):  # no C library to ask: 4 KiB pages it is
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None  # MADV_HUGEPAGE is Linux's
_BALLOON_FEATURES = "/sys/bus/virtio/drivers/virtio_balloon/virtio*/features"
_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING: the guest reports free pages to its host


def host_takes_free_pages(pattern: str = _BALLOON_FEATURES) -> bool:
    """Whether a virtio balloon of this machine reports free memory to its host.

    Each ``features`` file holds the device's feature bits as ``0``/``1`` characters, bit 0
    first (the kernel's ``virtio_dev_features_show``).
    """
    for path in glob.glob(pattern):
        try:
            with open(path) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > _F_REPORTING and bits[_F_REPORTING] == "1":
            return True
    return False


@functools.cache
def advise_huge() -> bool:
    """Whether :func:`fresh` advises large tensors into huge pages (decided once per process)."""
    choice = os.environ.get("STRIPEFS_LOAD_HUGEPAGES", "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"STRIPEFS_LOAD_HUGEPAGES is 1 or 0, not {choice!r}")
    if choice:
        return choice == "1" and _LIBC is not None
    return _LIBC is not None and not host_takes_free_pages()


def fresh(e: dict[str, Any]) -> torch.Tensor:
    """An uninitialised tensor for index entry ``e``, advised into huge pages when large
    (where :func:`advise_huge`)."""
    t = torch.empty(e["shape"], dtype=dtype_from_name(e["dtype"]))
    if advise_huge() and e["nbytes"] >= HUGE_MIN:
        p = t.data_ptr()
        lo, hi = -(-p // _HUGE) * _HUGE, (p + e["nbytes"]) // _HUGE * _HUGE
        if hi > lo:
            _LIBC.madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice: an error only means small pages
    return t


def dest_of(out: list[Any], i: int, e: dict[str, Any]) -> torch.Tensor:
    """Where tensor ``i`` lands: ``out[i]`` when the caller gave memory of its own for it
    (``load(into=...)``: contiguous, host, the stored dtype and shape), else :func:`fresh`."""
    t = out[i]
    return fresh(e) if t is None else t


def bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def read_exact(src: Reader, name: str, dest: memoryview, offset: int) -> None:
    """Fill ``dest`` from byte ``offset`` of ``src``'s file ``name``."""
    fill_exact(functools.partial(src.pread_into, name), dest, offset, name)


def fill_exact(pread_into: Callable[[memoryview, int], int], dest: memoryview, offset: int, name: str) -> None:
    """Fill ``dest`` with ``pread_into(view, offset)`` calls until full; a read that
    returns nothing means file ``name`` is shorter than its manifest says."""
    done = 0
    while done < len(dest):
        n = pread_into(dest[done:], offset + done)
        if n <= 0:
            raise ChecksumError(f"{name} is shorter than its manifest says", name)
        done += n


def _bad(src: Reader, i: int) -> ChecksumError:
    return ChecksumError(f"tensor {i} of {src.root} fails its CRC32C check", src.root)


class _Big:
    """One large tensor being filled piece by piece: the pieces' CRCs, and who finishes it."""

    def __init__(self, src: Reader, name: str, e: dict[str, Any], i: int, verify: bool, tensor: torch.Tensor):
        self.src, self.name, self.i, self.verify = src, name, i, verify
        self.want, self.offset = e["crc32c"], e["offset"]
        self.tensor = tensor
        self.view = bytes_of(self.tensor)
        step = src.piece(name)
        cuts = list(range(self.offset // step * step + step, self.offset + len(self.view), step))
        bounds = [self.offset, *cuts, self.offset + len(self.view)]
        self.spans = [(a - self.offset, b - self.offset) for a, b in zip(bounds, bounds[1:])]
        self.crcs: list[int] = [0] * len(self.spans)
        self.left = len(self.spans)
        self.lock = threading.Lock()

    def fill(self, k: int) -> None:
        """Read piece ``k`` and take its CRC; whoever lands the tensor's last piece checks it."""
        a, b = self.spans[k]
        read_exact(self.src, self.name, self.view[a:b], self.offset + a)
        if self.verify and k < len(self.spans) - 1:
            self.crcs[k] = crc32c.crc32c(self.view[a:b])
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last and self.verify:
            self._check()

    def _check(self) -> None:
        # Pieces in the middle are whole chunks (one cached shift); the first needs none; the
        # last, of any length, is taken on top of the others' combined CRC.
        total = self.crcs[0] if len(self.spans) > 1 else 0
        for (a, b), crc in zip(self.spans[1:-1], self.crcs[1:-1]):
            total = crc_combine(total, crc, b - a)
        a, b = self.spans[-1]
        if crc32c.crc32c(self.view[a:b], total) != self.want:
            raise _bad(self.src, self.i)


def raw_jobs(src: Reader, rec: dict[str, Any], index: list[dict[str, Any]], mine: list[int], out: list[Any],
             verify: bool, scratch: threading.local) -> list[Callable[[], None]]:
    """The jobs that fill ``out[i]`` for each ``i`` of ``mine`` (sorted by offset) from raw file ``rec``:
    into the tensor ``out[i]`` holds already, or a fresh one."""
    name = rec["name"]
    jobs: list[Callable[[], None]] = []
    run: list[int] = []
    # A tensor smaller than a piece would still cost a request of its own: such tensors go in
    # runs too, whose reads are piece-sized (a 1,000-layer model of ~1 MiB tensors on 4 MiB
    # chunks: 1.4x faster from the store here), capped so that a run stays within its budget.
    direct = min(max(DIRECT, src.piece(name)), RUN_BYTES // 2) if mine else DIRECT

    def flush() -> None:
        if run:
            jobs.append(lambda run=list(run): _load_run(src, name, index, run, out, verify, scratch))
            run.clear()

    for i in mine:
        e = index[i]
        if e["nbytes"] >= direct:
            flush()
            big = _Big(src, name, e, i, verify, dest_of(out, i, e))
            out[i] = big.tensor  # filled by the jobs; load() returns nothing unless all of them finish
            jobs.extend(functools.partial(big.fill, k) for k in range(len(big.spans)))
            continue
        # A run's scratch holds its span of the file: cut it before it passes RUN_BYTES.
        # A local run is one preadv of at most IOV_MAX pieces: a tensor and the gap before it each.
        if run and (e["offset"] + e["nbytes"] - index[run[0]]["offset"] > RUN_BYTES or 2 * len(run) + 2 > _IOV_MAX):
            flush()
        run.append(i)
    flush()
    return jobs


def _load_run(src: Reader, name: str, index: list[dict[str, Any]], run: list[int], out: list[Any], verify: bool,
              scratch: threading.local) -> None:
    start = index[run[0]]["offset"]
    end = max(index[i]["offset"] + index[i]["nbytes"] for i in run)
    tensors = [dest_of(out, i, index[i]) for i in run]
    ends = [index[i]["offset"] + index[i]["nbytes"] for i in run]
    if src.local and all(index[i]["offset"] >= e for i, e in zip(run[1:], ends)):  # disjoint, in order
        _scatter(src, name, index, run, tensors, start, end)
    else:
        buf = getattr(scratch, "buf", None)
        if buf is None or buf.numel() < end - start:  # one per thread, kept for the whole load
            buf = scratch.buf = torch.empty(max(end - start, min(RUN_BYTES, 1 << 20)), dtype=torch.uint8)
        read_exact(src, name, bytes_of(buf)[: end - start], start)
        base = buf.data_ptr() - start
        for i, t in zip(run, tensors):
            if index[i]["nbytes"]:
                ctypes.memmove(t.data_ptr(), base + index[i]["offset"], index[i]["nbytes"])
    for i, t in zip(run, tensors):
        if verify and crc32c.crc32c(bytes_of(t)) != index[i]["crc32c"]:
            raise _bad(src, i)
        out[i] = t


def _scatter(src: Reader, name: str, index: list[dict[str, Any]], run: list[int], tensors: list[torch.Tensor],
             start: int, end: int) -> None:
    """One ``preadv`` of ``[start, end)`` straight into the run's tensors; gaps land in a pad."""
    ends = [start] + [index[i]["offset"] + index[i]["nbytes"] for i in run[:-1]]
    pad = memoryview(bytearray(max(max(index[i]["offset"] - e, 0) for i, e in zip(run, ends))))  # under a page
    dests: list[memoryview] = []
    pos = start
    for i, t in zip(run, tensors):
        if index[i]["offset"] > pos:
            dests.append(pad[: index[i]["offset"] - pos])
        if index[i]["nbytes"]:
            dests.append(bytes_of(t))
        pos = index[i]["offset"] + index[i]["nbytes"]
    got = src.preadv(name, dests, start) if dests else 0
    if got < end - start:  # a short read: finish it piece by piece (rare: a signal, a short file)
        done = 0
        for d in dests:
            if done + len(d) > got:
                skip = max(0, got - done)
                read_exact(src, name, d[skip:], start + done + skip)
            done += len(d)
