"""Workloads shaped like a training cluster, run inside each client process.

Every workload is a function ``(session, task, ctx) -> {part: PartResult}``; most have one
part named like the workload, ``metadata`` has four (``meta_create``, ``meta_stat``,
``meta_readdir``, ``meta_unlink``; three ``meta_*_batch`` more where the route batches) and
``mixed`` two (``mixed_read``, ``mixed_write``). All clients wait at the same barrier before
the timed section and stamp its start and end with the system-wide monotonic clock, so the
benchmark process can compute the span from the first start to the last end.

Workloads (``size`` is per client, ``block`` the I/O size of sequential workloads):

=================  =====================================================================
seq_write          each client writes its own file ``seq/cI`` of ``size``, fsync, close
seq_read           each client reads its own file back (written first if missing)
shared_write       all clients write disjoint ``size`` regions of one file ``shared/data``
shared_read        all clients read their region of the shared file
rand_read_4k/64k/  random aligned reads of 4 KiB / 64 KiB / 1 MiB from the client's own
1m                 file ``rand/cI`` of ``rand_size`` bytes (at least twice the largest
                   client readahead window) for ``duration`` seconds (dataloader sampling)
checkpoint         all clients at once write ``shards`` files each (total ``size``), fsync,
                   rename into place (the atomic-commit pattern)
metadata           mdtest-style: create, stat, readdir, unlink ``files`` empty files, one
                   call per file; then, on routes with batched calls (native, zerocopy), the
                   same files created, stat'ed and unlinked 200 per call (``*_batch`` parts)
mixed              half the clients run random 1 MiB reads while the rest write a
                   checkpoint burst ("training with background traffic")
seq_read_cached    ``seq_read`` / ``rand_read_4k`` right after an untimed read of the same
(rand_read_4k_     bytes: a warm cache is the point (page cache, server cache); never
cached)            judged against the socket floor
=================  =====================================================================

The seed workloads (``dataloader``, ``small_writes``, ``burst_interference``) live in
``bench._seed``; the table of all of them in ``bench._tasks``.

Cold reads. Read workloads run in two calls: ``prepare(...)`` writes what the timed read
needs (untimed), then the benchmark process drops the kernel page cache (or, without root,
every client evicts its files with ``posix_fadvise``), then the timed read runs. Random reads
open files with ``direct=True`` (``O_DIRECT`` on POSIX routes, no client cache on fsspec), and
never start at offset 0 or where the previous read ended, so a client's sequential readahead
never serves a random read: every random read is a round trip to the file system.

Every read is checked against the pattern (page stamps always, every byte for a sample), and
every write workload reads a sample back after the timed section, so a fast-but-wrong route
fails instead of posting a figure.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ._pattern import PAGE, Pattern, VerifyError, file_id
from ._sessions import BatchedSession, Reader, Session, Writer

__all__ = ["CLASSIC", "CLASSIC_PREPARE", "ClientContext", "PartResult", "clock", "aligned",
           "write_range", "read_back", "check_size", "checkpoint_files", "evict"]

EXACT_EVERY = 8  # exact byte comparison for every 8th sequential block (stamps: all blocks)
RAND_EXACT_EVERY = 64
META_BATCH = 200  # files per call in the batched metadata parts (one request each on native)


def clock() -> float:
    # CLOCK_MONOTONIC is system-wide: stamps from different client processes compare.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


@dataclass
class PartResult:
    """One client's share of one record: bytes moved, timed span, operation latencies."""

    nbytes: int = 0
    t0: float = 0.0
    t1: float = 0.0
    ops: int = 0
    lat: list[float] = field(default_factory=list)
    verified: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # more counters, summed into the record


@dataclass
class ClientContext:
    """What a client process knows besides its session: its index, peers and shared state."""

    index: int
    clients: int
    barrier: Any          # multiprocessing.Barrier(clients)
    progress: Any         # multiprocessing.Array('q', clients, lock=False): bytes per client
    writers_done: Any     # multiprocessing.Value('i'): finished writers of ``mixed``
    pattern: Pattern
    timeout: float = 300.0

    def wait(self) -> None:
        self.barrier.wait(self.timeout)

    def add(self, n: int) -> None:
        self.progress[self.index] += n


def aligned(n: int) -> memoryview:
    buf = mmap.mmap(-1, max(n, PAGE))
    buf[:] = bytes(len(buf))  # pre-fault: first touch would be timed otherwise
    return memoryview(buf)[:n]


def write_range(w: Writer, ctx: ClientContext, fid: int, size: int, block: int,
                part: PartResult, base: int = 0, positional: bool = False) -> None:
    """Write ``size`` pattern bytes at file offset ``base`` in ``block`` pieces."""
    for off in range(0, size, block):
        view = ctx.pattern.stamped(fid, base + off, min(block, size - off))
        t = clock()
        if positional:
            w.pwrite(view, base + off)
        else:
            w.write(view)
        part.lat.append(clock() - t)
        part.nbytes += len(view)
        part.ops += 1
        ctx.add(len(view))


def _read(r: Reader, ctx: ClientContext, fid: int, size: int, block: int, part: PartResult,
          buf: memoryview, base: int = 0, close: bool = False) -> None:
    """Read ``size`` bytes at ``base`` in ``block`` pieces, verifying every piece."""
    try:
        _read_pieces(r, ctx, fid, size, block, part, buf, base)
    finally:
        if close:
            r.close()


def _read_pieces(r: Reader, ctx: ClientContext, fid: int, size: int, block: int,
                 part: PartResult, buf: memoryview, base: int) -> None:
    for k, off in enumerate(range(0, size, block)):
        want = min(block, size - off)
        t = clock()
        n = r.pread_into(buf[:want], base + off)
        part.lat.append(clock() - t)
        if n != want:
            raise VerifyError(f"short read: {n} of {want} bytes at {base + off}")
        exact = k % EXACT_EVERY == 0 or off + want == size
        part.verified += ctx.pattern.check(buf[:n], fid, base + off, exact=exact)
        part.nbytes += n
        part.ops += 1
        ctx.add(n)


def read_back(s: Session, ctx: ClientContext, path: str, fid: int, size: int, block: int,
               base: int = 0) -> int:
    """Untimed check of the first and last block written: returns bytes compared exactly."""
    buf = aligned(min(block, size))
    r = s.open_read(path)
    try:
        checked = 0
        for off in sorted({0, max(0, (size - 1) // block * block)}):
            want = min(block, size - off)
            n = r.pread_into(buf[:want], base + off)
            if n != want:
                raise VerifyError(f"{path}: read back {n} of {want} bytes at {base + off}")
            checked += ctx.pattern.check(buf[:n], fid, base + off, exact=True)
        return checked
    finally:
        r.close()


def check_size(s: Session, path: str, want: int) -> None:
    got = s.size(path)
    if got != want:
        raise VerifyError(f"{path}: size {got} after writing {want} bytes")


def _write_own(s: Session, ctx: ClientContext, path: str, size: int, block: int,
               part: PartResult) -> None:
    w = s.create(path)
    try:
        write_range(w, ctx, file_id(path), size, block, part)
        w.fsync()
    finally:
        w.close()


def _ensure_seq(s: Session, ctx: ClientContext, task: dict[str, Any], kind: str = "seq") -> str:
    """The client's own file (``seq``: ``size`` bytes; ``rand``: ``rand_size`` bytes), written
    untimed if an earlier task did not leave it."""
    path, size = f"{kind}/c{ctx.index}", task["rand_size" if kind == "rand" else "size"]
    s.makedirs(kind)
    try:
        if s.size(path) == size:
            return path
    except FileNotFoundError:
        pass
    _write_own(s, ctx, path, size, task["block"], PartResult())
    return path


def seq_write(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    path, part = f"seq/c{ctx.index}", PartResult()
    s.makedirs("seq")
    ctx.wait()
    part.t0 = clock()
    _write_own(s, ctx, path, task["size"], task["block"], part)
    part.t1 = clock()
    check_size(s, path, task["size"])
    part.verified = read_back(s, ctx, path, file_id(path), task["size"], task["block"])
    return {"seq_write": part}


def _seq_read(name: str, warm: bool) -> Callable[..., dict[str, PartResult]]:
    def run(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
        path, part = _ensure_seq(s, ctx, task), PartResult()
        buf = aligned(task["block"])
        if warm:  # the point of *_cached: the same bytes were just read
            _read(s.open_read(path), ctx, file_id(path), task["size"], task["block"],
                  PartResult(), buf, close=True)
        r = s.open_read(path)
        try:
            ctx.wait()
            part.t0 = clock()
            _read(r, ctx, file_id(path), task["size"], task["block"], part, buf)
            part.t1 = clock()
        finally:
            r.close()
        return {name: part}

    run.__name__ = name
    return run


seq_read = _seq_read("seq_read", warm=False)
seq_read_cached = _seq_read("seq_read_cached", warm=True)


SHARED = "shared/data"


def shared_write(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    size, part = task["size"], PartResult()
    if ctx.index == 0:
        s.makedirs("shared")
        s.create(SHARED).close()
    ctx.wait()  # the file exists for everyone
    w = s.open_update(SHARED)
    if w is None:
        raise NotImplementedError("this route cannot write at an offset")
    try:
        ctx.wait()
        part.t0 = clock()
        write_range(w, ctx, file_id(SHARED), size, task["block"], part, base=ctx.index * size,
                    positional=True)
        w.fsync()
    finally:
        w.close()
    part.t1 = clock()
    ctx.wait()  # every region is committed before anyone checks the length
    check_size(s, SHARED, size * ctx.clients)
    part.verified = read_back(s, ctx, SHARED, file_id(SHARED), size, task["block"],
                              base=ctx.index * size)
    return {"shared_write": part}


def shared_read(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    size, part = task["size"], PartResult()
    if ctx.index == 0:
        _ensure_shared(s, task, ctx)
    ctx.wait()
    buf = aligned(task["block"])
    r = s.open_read(SHARED)
    try:
        ctx.wait()
        part.t0 = clock()
        _read(r, ctx, file_id(SHARED), size, task["block"], part, buf, base=ctx.index * size)
        part.t1 = clock()
    finally:
        r.close()
    return {"shared_read": part}


def _random_reads(r: Reader, ctx: ClientContext, fid: int, size: int, req: int,
                  until: Callable[[PartResult], bool], part: PartResult) -> None:
    """Aligned random reads of ``req`` bytes until ``until(part)`` says stop.

    A read never starts where the previous one ended, nor at offset 0 (unless the file has
    fewer than four slots): such reads look like the start or the continuation of a
    sequential scan to a client (the native client, our FUSE daemon) and turn on its
    readahead, after which "random" reads are served from the window -- what ``seq_read``
    measures, not this.
    """
    buf = aligned(req)
    rng = np.random.default_rng(1000 + ctx.index)
    slots = max(1, size // req)
    first = 1 if slots > 3 else 0
    after = -1  # the slot that would continue the previous read
    while not until(part):
        slot = int(rng.integers(first, slots))
        while slot == after and slots > 2:
            slot = int(rng.integers(first, slots))
        after = slot + 1
        off = slot * req
        want = min(req, size - off)
        t = clock()
        n = r.pread_into(buf[:want], off)
        part.lat.append(clock() - t)
        if n != want:
            raise VerifyError(f"short read: {n} of {want} bytes at {off}")
        part.verified += ctx.pattern.check(buf[:n], fid, off,
                                           exact=part.ops % RAND_EXACT_EVERY == 0)
        part.nbytes += n
        part.ops += 1
        ctx.add(n)


def _rand_read(name: str, req: int, warm: bool = False) -> Callable[..., dict[str, PartResult]]:
    def run(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
        path, part = _ensure_seq(s, ctx, task, "rand"), PartResult()
        size = task["rand_size"]
        if warm:  # the point of *_cached: the file was just read (its first ``size`` bytes)
            _read(s.open_read(path), ctx, file_id(path), task["size"], task["block"],
                  PartResult(), aligned(task["block"]), close=True)
            size = task["size"]
        r = s.open_read(path, direct=not warm)
        try:
            ctx.wait()
            part.t0 = clock()
            end, cap = part.t0 + task["duration"], task.get("max_ops", 1 << 40)
            _random_reads(r, ctx, file_id(path), size, req,
                          lambda p: p.ops >= cap or clock() >= end, part)
            part.t1 = clock()
        finally:
            r.close()
        return {name: part}

    run.__name__ = name
    return run


def checkpoint_files(s: Session, ctx: ClientContext, task: dict[str, Any], tag: str,
                      part: PartResult) -> list[tuple[str, int]]:
    """Write this client's shards as .tmp, fsync each, rename into place; returns (path, size)."""
    shards = max(1, task["shards"])
    per = -(-task["size"] // shards // task["block"]) * task["block"]
    done, out = 0, []
    for j in range(shards):
        n = min(per, task["size"] - done)
        if n <= 0:
            break
        final = f"ckpt/{tag}/c{ctx.index}-s{j}"
        w = s.create(final + ".tmp")
        try:
            write_range(w, ctx, file_id(final + ".tmp"), n, task["block"], part)
            w.fsync()
        finally:
            w.close()
        s.rename(final + ".tmp", final)
        out.append((final, n))
        done += n
    return out


def checkpoint(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    tag, part = task["tag"], PartResult()
    s.makedirs(f"ckpt/{tag}")
    ctx.wait()
    part.t0 = clock()
    files = checkpoint_files(s, ctx, task, tag, part)
    part.t1 = clock()
    for path, n in files:
        check_size(s, path, n)
    # the bytes were stamped with the .tmp name: a rename must not change content
    part.verified = sum(read_back(s, ctx, p, file_id(p + ".tmp"), n, task["block"])
                        for p, n in files[:2])
    for path, _ in files:  # untimed: keep the disk footprint of repeated runs bounded
        s.unlink(path)
    return {"checkpoint": part}


def metadata(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    d = f"meta/{task['tag']}/c{ctx.index}"
    s.makedirs(d)
    names = [f"f{k:06d}" for k in range(task["files"])]
    parts = {k: PartResult() for k in ("meta_create", "meta_stat", "meta_readdir", "meta_unlink")}

    def phase(name: str, op: Callable[[str], None], items: list[str]) -> None:
        part = parts[name]
        ctx.wait()
        part.t0 = clock()
        for item in items:
            t = clock()
            op(item)
            part.lat.append(clock() - t)
            part.ops += 1
        part.t1 = clock()

    def stat(name: str) -> None:
        if s.size(f"{d}/{name}") != 0:
            raise VerifyError(f"{d}/{name}: an empty file has a size")

    def readdir(_: str) -> None:
        got = s.listdir(d)
        if sorted(got) != names:
            raise VerifyError(f"{d}: listed {len(got)} entries, created {len(names)}")

    phase("meta_create", lambda n: s.touch(f"{d}/{n}"), names)
    phase("meta_stat", stat, names)
    phase("meta_readdir", readdir, ["."] * task.get("listings", 3))
    phase("meta_unlink", lambda n: s.unlink(f"{d}/{n}"), names)
    if s.listdir(d):
        raise VerifyError(f"{d}: entries left after unlink")
    if isinstance(s, BatchedSession):
        parts.update(_metadata_batched(s, d, names, ctx))
    return parts


def _metadata_batched(s: BatchedSession, d: str, names: list[str], ctx: ClientContext) -> dict[str, PartResult]:
    """The same files created, stat'ed and unlinked ``META_BATCH`` per call: ``ops`` counts files."""
    paths = [f"{d}/{n}" for n in names]
    batches = [paths[k:k + META_BATCH] for k in range(0, len(paths), META_BATCH)]
    parts = {k: PartResult() for k in ("meta_create_batch", "meta_stat_batch", "meta_unlink_batch")}

    def stat(batch: list[str]) -> None:
        if any(s.sizes(batch)):
            raise VerifyError(f"{d}: an empty file has a size")

    for name, op in (("meta_create_batch", s.create_many), ("meta_stat_batch", stat),
                     ("meta_unlink_batch", s.unlink_many)):
        part = parts[name]
        ctx.wait()
        part.t0 = clock()
        for batch in batches:
            op(batch)
            part.ops += len(batch)
        part.t1 = clock()
        if name == "meta_create_batch" and sorted(s.listdir(d)) != names:  # untimed
            raise VerifyError(f"{d}: the batched creates did not make {len(names)} files")
    if s.listdir(d):
        raise VerifyError(f"{d}: entries left after the batched unlink")
    return parts


def mixed(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    """Readers (the first half, rounded up) sample 1 MiB reads until every writer is done."""
    if ctx.clients < 2:
        raise NotImplementedError("mixed needs at least 2 clients")
    writers = ctx.clients // 2
    reader = ctx.index < ctx.clients - writers
    part = PartResult()
    if reader:
        path = _ensure_seq(s, ctx, task, "rand")
        r = s.open_read(path, direct=True)
        try:
            ctx.wait()
            part.t0 = clock()
            end = part.t0 + ctx.timeout
            _random_reads(r, ctx, file_id(path), task["rand_size"], 1 << 20,
                          # at least one read: a reader scheduled late on a loaded machine
                          # may first look after the writers are done
                          lambda p: p.ops > 0 and (ctx.writers_done.value >= writers or clock() >= end), part)
            part.t1 = clock()
        finally:
            r.close()
        return {"mixed_read": part}
    s.makedirs(f"ckpt/{task['tag']}")
    ctx.wait()
    write_burst(s, ctx, task, task["tag"], part)
    return {"mixed_write": part}


def write_burst(s: Session, ctx: ClientContext, task: dict[str, Any], tag: str, part: PartResult,
                *, alone: bool = False) -> None:
    """A writer's timed checkpoint burst beside readers, who are told when it ends (also
    when it failed), or ``alone`` (nobody reads meanwhile: the burst's own throughput);
    the files are checked and removed afterwards, untimed."""
    part.t0 = clock()
    try:
        files = checkpoint_files(s, ctx, task, tag, part)
    finally:
        if not alone:
            with ctx.writers_done.get_lock():  # readers stop even if this writer failed
                ctx.writers_done.value += 1
    part.t1 = clock()
    for path, n in files:
        check_size(s, path, n)
        s.unlink(path)


Workload = Callable[[Session, dict[str, Any], ClientContext], dict[str, PartResult]]

CLASSIC: dict[str, Workload] = {
    "seq_write": seq_write,
    "seq_read": seq_read,
    "seq_read_cached": seq_read_cached,
    "shared_write": shared_write,
    "shared_read": shared_read,
    "rand_read_4k": _rand_read("rand_read_4k", 4 << 10),
    "rand_read_64k": _rand_read("rand_read_64k", 64 << 10),
    "rand_read_1m": _rand_read("rand_read_1m", 1 << 20),
    "rand_read_4k_cached": _rand_read("rand_read_4k_cached", 4 << 10, warm=True),
    "checkpoint": checkpoint,
    "metadata": metadata,
    "mixed": mixed,
}


def evict(s: Session, paths: list[str], task: dict[str, Any]) -> None:
    """Drop the client-side kernel cache of ``paths`` when the run cannot drop all caches."""
    if task.get("evict"):
        for p in paths:
            s.evict(p)


def _prepare_seq(s: Session, task: dict[str, Any], ctx: ClientContext) -> None:
    evict(s, [_ensure_seq(s, ctx, task)], task)


def _prepare_rand(s: Session, task: dict[str, Any], ctx: ClientContext) -> None:
    evict(s, [_ensure_seq(s, ctx, task, "rand")], task)


def _prepare_mixed(s: Session, task: dict[str, Any], ctx: ClientContext) -> None:
    if ctx.index < ctx.clients - ctx.clients // 2:  # the readers
        _prepare_rand(s, task, ctx)


def _ensure_shared(s: Session, task: dict[str, Any], ctx: ClientContext) -> None:
    """Client 0: the shared file, written in one stream unless it is there already."""
    size = task["size"] * ctx.clients
    s.makedirs("shared")
    try:
        ready = s.size(SHARED) == size
    except FileNotFoundError:
        ready = False
    if not ready:  # routes without offset writes get the file written in one stream
        _write_own(s, ctx, SHARED, size, task["block"], PartResult())


def _prepare_shared(s: Session, task: dict[str, Any], ctx: ClientContext) -> None:
    if ctx.index == 0:
        _ensure_shared(s, task, ctx)
        evict(s, [SHARED], task)


# what each cold read workload needs written before the caches are dropped
CLASSIC_PREPARE: dict[str, Callable[[Session, dict[str, Any], ClientContext], None]] = {
    "seq_read": _prepare_seq, "shared_read": _prepare_shared, "rand_read_4k": _prepare_rand,
    "rand_read_64k": _prepare_rand, "rand_read_1m": _prepare_rand, "mixed": _prepare_mixed,
}
