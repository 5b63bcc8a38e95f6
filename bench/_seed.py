"""The seed workloads: what a 3FS-like file system exists for, run inside each client process.

===================  ===================================================================
dataloader           a dataset of ``dl_files`` files of 64-256 KiB (sizes from a fixed
                     seed, multiples of 4 KiB) read whole, in a random order, by all
                     clients at once (each takes every N-th file of one permutation);
                     files/s, GB/s, p50/p99 per file (open + read + close)
dataloader_batched   the same files in the same order, read in batches of ``BATCH`` (64)
                     by the route's best way to read many files at once
                     (``Session.read_batch``: the zero-copy ring's ``open_many`` + one
                     submission, fsspec ``cat``, native ``stat_many`` + reads on threads,
                     POSIX routes and peers 64 threads); files/s, GB/s, p50/p99 per batch
small_writes         every client creates ``sw_files`` files of 4-64 KiB: create, write,
                     fsync, close each; files/s, p50/p99 per file
small_writes_one_dir the same, every client's files in ONE directory (a checkpoint of many
                     small files written by all ranks at once: 8 clients x 1,250 files
                     make the 10,000-file checkpoint of docs/benchmarks.md)
burst_interference   the other clients (half, rounded down, or ``--burst-writers``)
                     first write a checkpoint burst of ``size`` bytes each with nobody
                     reading (``burst_write_alone``); then the first clients read the
                     dataset alone for ``duration`` s (``burst_alone``), then go on
                     reading while the writers write the burst again
                     (``burst_interference``, with the p99 ratio during/alone, and
                     ``burst_write``, the burst's throughput, with its ratio to alone)
restore              every client restores a model state of ``size`` bytes saved by the route's
                     own way (untimed, then the caches dropped): ``staging.save``/``load``
                     from the store on native and zerocopy, ``torch.save``/``torch.load``
                     of one file on POSIX routes, peers and fsspec; once cut into 16
                     tensors (``restore_16``) and once into 1,000 (``restore_1000``);
                     GB/s per load into fresh memory, every tensor compared afterwards
kvcache              an inference server's KV-cache tier: Zipf batches of fixed-size pages
                     got from and put back into a store smaller than the key space (the
                     page store on native, one file per page on POSIX routes); records
                     ``kvcache_get`` (hit ratio) and ``kvcache_put`` (``bench._kvcache_workload``)
===================  ===================================================================

The dataset is written once per route by ``prepare_dataset`` (untimed, all clients in
parallel) and kept for later runs of the same benchmark; it is read through the session's
``datasets`` (on FUSE routes a read-only mount of the same file system, as a training job
mounts its data); the caches are dropped before every
timed read (``bench._workloads`` explains how), and dataset files are opened with
``direct=True`` so that no file is served by a client-side cache even when a reader wraps
around its share.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np

from ._kvcache_workload import PARTS as KVCACHE_PARTS
from ._kvcache_workload import kvcache, kvcache_cleanup, kvcache_finish
from ._pattern import VerifyError, file_id
from ._sessions import Session
from ._workloads import (ClientContext, PartResult, aligned, check_size, clock,
                         evict, read_back, write_burst, write_range)

__all__ = ["SEED", "SEED_PREPARE", "SEED_CLEANUP", "SEED_PARTS", "SEED_FINISH", "dataset_sizes", "dataset_path",
           "prepare_dataset"]

DATASET_SEED, ORDER_SEED, SMALL_SEED = 20260101, 7, 100
MIN_FILE, MAX_FILE = 64 << 10, 256 << 10
EXACT_EVERY = 32  # every 32nd file compared byte for byte (stamps: every file)


def dataset_sizes(n: int) -> np.ndarray:
    """Sizes of the ``n`` dataset files: 64-256 KiB, multiples of 4 KiB, from a fixed seed."""
    rng = np.random.default_rng(DATASET_SEED)
    return rng.integers(MIN_FILE >> 12, (MAX_FILE >> 12) + 1, n) * 4096


def dataset_path(n: int, k: int) -> str:
    """File ``k`` of the ``n``-file dataset (1,000 files per directory)."""
    return f"dataset/{n}/d{k // 1000:03d}/f{k:06d}"


def prepare_dataset(s: Session, task: dict[str, Any], ctx: ClientContext) -> None:
    """Write the dataset unless an earlier task did (a ``READY`` file marks it complete)."""
    n = task["dl_files"]
    sizes = dataset_sizes(n)
    ready = f"dataset/{n}/READY"
    try:
        s.size(ready)
        done = True
    except FileNotFoundError:
        done = False
    ctx.wait()  # everyone has looked before anyone writes the marker
    mine = range(ctx.index, n, ctx.clients)
    if not done:
        if ctx.index == 0:
            for d in range(-(-n // 1000)):
                s.makedirs(f"dataset/{n}/d{d:03d}")
        ctx.wait()
        scratch = PartResult()
        for k in mine:
            path = dataset_path(n, k)
            w = s.create(path)
            try:
                write_range(w, ctx, file_id(path), int(sizes[k]), ctx.pattern.block, scratch)
            finally:
                w.close()
        ctx.wait()  # every file is complete before the marker says so
        if ctx.index == 0:
            s.touch(ready)
    evict(s.datasets, [dataset_path(n, k) for k in mine], task)


def _read_file(s: Session, ctx: ClientContext, n: int, k: int, size: int, buf: memoryview,
               part: PartResult) -> None:
    """Open, read whole, close one dataset file through ``s.datasets`` (timed as one
    operation), then verify it."""
    path = dataset_path(n, k)
    t = clock()
    r = s.datasets.open_read(path, direct=True)
    try:
        got = r.pread_into(buf[:size], 0)
    finally:
        r.close()
    part.lat.append(clock() - t)
    if got != size:
        raise VerifyError(f"{path}: read {got} of {size} bytes")
    part.verified += ctx.pattern.check(buf[:size], file_id(path), 0,
                                       exact=part.ops % EXACT_EVERY == 0)
    part.nbytes += size
    part.ops += 1
    ctx.add(size)


def dataloader(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    n = task["dl_files"]
    sizes = dataset_sizes(n)
    mine = np.random.default_rng(ORDER_SEED).permutation(n)[ctx.index::ctx.clients]
    buf, part = aligned(MAX_FILE), PartResult()
    ctx.wait()
    part.t0 = clock()
    for k in mine:
        _read_file(s, ctx, n, int(k), int(sizes[k]), buf, part)
    part.t1 = clock()
    return {"dataloader": part}


BATCH = 64  # files per batch of dataloader_batched (a DataLoader batch)


def dataloader_batched(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    n = task["dl_files"]
    sizes = dataset_sizes(n)
    mine = [int(k) for k in np.random.default_rng(ORDER_SEED).permutation(n)[ctx.index::ctx.clients]]
    buf, part = aligned(BATCH * MAX_FILE), PartResult()
    ctx.wait()
    part.t0 = clock()
    for start in range(0, len(mine), BATCH):
        batch = mine[start:start + BATCH]
        views, at = [], 0
        for k in batch:
            views.append(buf[at:at + int(sizes[k])])
            at += int(sizes[k])
        t = clock()
        got = s.datasets.read_batch([dataset_path(n, k) for k in batch], views)
        part.lat.append(clock() - t)  # per batch
        for k, view, g in zip(batch, views, got):
            path = dataset_path(n, k)
            if g != len(view):
                raise VerifyError(f"{path}: read {g} of {len(view)} bytes")
            part.verified += ctx.pattern.check(view, file_id(path), 0, exact=part.ops % EXACT_EVERY == 0)
            part.nbytes += len(view)
            part.ops += 1
            ctx.add(len(view))
    part.t1 = clock()
    return {"dataloader_batched": part}


def _small_files(task: dict[str, Any], ctx: ClientContext, one_dir: bool) -> tuple[str, str]:
    """(directory, name prefix) of this client's small files."""
    if one_dir:
        return f"small/{task['tag']}/one", f"c{ctx.index:03d}-f"
    return f"small/{task['tag']}/c{ctx.index}", "f"


def small_writes(s: Session, task: dict[str, Any], ctx: ClientContext, one_dir: bool = False) -> dict[str, PartResult]:
    d, prefix = _small_files(task, ctx, one_dir)
    s.makedirs(d)
    n = task["sw_files"]
    sizes = np.random.default_rng(SMALL_SEED + ctx.index).integers(1, 17, n) * 4096
    part, scratch = PartResult(), PartResult()
    paths = [f"{d}/{prefix}{k:06d}" for k in range(n)]
    ctx.wait()
    part.t0 = clock()
    for path, size in zip(paths, sizes):
        t = clock()
        w = s.create(path)
        try:
            write_range(w, ctx, file_id(path), int(size), ctx.pattern.block, scratch)
            w.fsync()
        finally:
            w.close()
        part.lat.append(clock() - t)
        part.nbytes += int(size)
        part.ops += 1
    part.t1 = clock()
    for k in sorted({0, n - 1}):  # untimed: the first and last file hold what was written
        check_size(s, paths[k], int(sizes[k]))
        part.verified += read_back(s, ctx, paths[k], file_id(paths[k]), int(sizes[k]),
                                   ctx.pattern.block)
    return {"small_writes_one_dir" if one_dir else "small_writes": part}


def small_writes_one_dir(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    return small_writes(s, task, ctx, one_dir=True)


def _small_writes_cleanup(s: Session, task: dict[str, Any], ctx: ClientContext, one_dir: bool = False) -> None:
    """Remove what ``small_writes`` wrote (keeps repeated runs' footprint bounded)."""
    d, prefix = _small_files(task, ctx, one_dir)
    for name in s.listdir(d):
        if name.startswith(prefix):
            s.unlink(f"{d}/{name}")


def burst_interference(s: Session, task: dict[str, Any],
                       ctx: ClientContext) -> dict[str, PartResult]:
    """Readers: dataset reads alone, then during the writers' burst. Writers: the burst."""
    if ctx.clients < 2:
        raise NotImplementedError("burst_interference needs at least 2 clients")
    writers = task.get("burst_writers") or ctx.clients // 2
    readers = ctx.clients - writers
    if ctx.index >= readers:
        return _burst_writer(s, task, ctx, writers)
    n = task["dl_files"]
    sizes = dataset_sizes(n)
    mine = np.random.default_rng(ORDER_SEED + 1).permutation(n)[ctx.index::readers]
    buf, alone, during = aligned(MAX_FILE), PartResult(), PartResult()
    at = 0

    def read_until(part: PartResult, stop: Any) -> None:
        nonlocal at
        part.t0 = clock()
        while True:  # at least one file per phase
            k = int(mine[at % len(mine)])
            _read_file(s, ctx, n, k, int(sizes[k]), buf, part)
            at += 1
            if stop():
                break
        part.t1 = clock()

    ctx.wait()
    ctx.wait()  # the writers' burst alone is over
    end = clock() + task["duration"]
    read_until(alone, lambda: clock() >= end or at >= len(mine) // 2)
    ctx.wait()  # the burst starts now
    deadline = clock() + ctx.timeout
    read_until(during, lambda: ctx.writers_done.value >= writers or clock() >= deadline)
    return {"burst_alone": alone, "burst_interference": during}


RESTORE_TENSORS = (16, 1000)  # a state of few large tensors, and one of a model's many layers


def restore_tensors(total: int, count: int) -> Any:
    """``(name, tensor)`` of a state of ``count`` float32 tensors of equal size, about
    ``total`` bytes in all, one after another (random from a fixed seed: incompressible, and
    made again tensor by tensor to check a load without holding two states at once)."""
    import torch

    g = torch.Generator().manual_seed(count)
    n = max(1, total // count // 4)
    for i in range(count):
        yield f"layer{i:04d}.weight", torch.rand(n, generator=g)


def _restore_path(task: dict[str, Any], ctx: ClientContext, count: int) -> str:
    return f"restore/{task['tag']}/c{ctx.index}-t{count}"


def prepare_restore(s: Session, task: dict[str, Any], ctx: ClientContext) -> None:
    """Save this client's states (each of ``size`` bytes), the route's own way."""
    s.makedirs(f"restore/{task['tag']}")
    paths = [_restore_path(task, ctx, count) for count in RESTORE_TENSORS]
    for path, count in zip(paths, RESTORE_TENSORS):
        s.save_state(path, dict(restore_tensors(task["size"], count)))
    evict(s, paths, task)


def _heap_given_back() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing), so that a load lands in fresh memory as it does after a restart.

    Without it a route whose loader allocates on the main thread reuses the pages the saved
    state (made and freed there) left in the heap: measured, a ``torch.load`` of 1 GiB took
    16,000 page faults instead of 262,000 and came out 1.2-1.4x faster than a load that paid
    for its memory, a cache of the benchmark's own making."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: no heap to give back by hand
        return
    trim(0)


def _memory_provided(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and give it back, just before a timed load.

    A virtual machine whose balloon reports free pages to its host (as the machines these
    figures come from do) hands memory that sat free for a few seconds back to the host,
    which must then provide it again on its next first touch, at several times the cost of
    zeroing a page: whichever route loaded first after a quiet spell paid for it (measured:
    the same loader 0.56-0.77 GB/s when its route ran first, 1.14-1.25 when it ran second).
    Touched and freed here, the memory is the guest's again for the load, as it is on a
    machine without a balloon, whatever the order of the routes."""
    m = mmap.mmap(-1, nbytes)
    try:
        for at in range(0, nbytes, mmap.PAGESIZE):
            m[at] = 1
    finally:
        m.close()


def restore(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    """Load each state whole into fresh memory, all clients at once (timed); then compare
    every tensor with the state that was saved (untimed). Before each load the heap's free
    memory goes back to the system (:func:`_heap_given_back`) and the host has provided the
    memory the load will take (:func:`_memory_provided`)."""
    import torch

    parts = {}
    for count in RESTORE_TENSORS:
        part = parts[f"restore_{count}"] = PartResult()
        path = _restore_path(task, ctx, count)
        _heap_given_back()
        _memory_provided(task["size"])
        ctx.wait()
        part.t0 = clock()
        state = s.load_state(path)
        part.t1 = clock()
        part.lat.append(part.t1 - part.t0)
        part.ops = 1
        for name, want in restore_tensors(task["size"], count):
            got = state.pop(name, None)
            if not isinstance(got, torch.Tensor) or not torch.equal(got, want):
                raise VerifyError(f"{path}: tensor {name} is not the one saved")
            part.nbytes += got.numel() * got.element_size()
        if state:
            raise VerifyError(f"{path}: keys that were not saved: {sorted(state)[:3]}")
        part.verified = part.nbytes
        del state
    return parts


def _restore_cleanup(s: Session, task: dict[str, Any], ctx: ClientContext) -> None:
    for count in RESTORE_TENSORS:
        s.remove_state(_restore_path(task, ctx, count))


def _burst_writer(s: Session, task: dict[str, Any], ctx: ClientContext,
                  writers: int) -> dict[str, PartResult]:
    tag, part, solo = task["tag"], PartResult(), PartResult()
    s.makedirs(f"ckpt/{tag}")
    ctx.wait()
    write_burst(s, ctx, task, tag, solo, alone=True)  # the same burst with nobody reading
    ctx.wait()
    ctx.wait()  # the readers' solo phase is over
    write_burst(s, ctx, task, tag, part)
    return {"burst_write_alone": solo, "burst_write": part}


SEED = {"dataloader": dataloader, "dataloader_batched": dataloader_batched, "small_writes": small_writes,
        "small_writes_one_dir": small_writes_one_dir, "burst_interference": burst_interference,
        "restore": restore, "kvcache": kvcache}
SEED_PREPARE = {"dataloader": prepare_dataset, "dataloader_batched": prepare_dataset,
                "burst_interference": prepare_dataset, "restore": prepare_restore}
SEED_CLEANUP = {"small_writes": _small_writes_cleanup,
                "small_writes_one_dir": lambda s, task, ctx: _small_writes_cleanup(s, task, ctx, one_dir=True),
                "restore": _restore_cleanup, "kvcache": kvcache_cleanup}
# records not named like their workload
SEED_PARTS = {"kvcache": KVCACHE_PARTS, "restore": [f"restore_{n}" for n in RESTORE_TENSORS]}
SEED_FINISH = {"kvcache": kvcache_finish}  # fields computed from a task's aggregated records
