"""Workloads shaped like a training cluster, run inside each client process.

Every workload is a function ``(session, task, ctx) -> {part: PartResult}``; most have one
part named like the workload, ``metadata`` has four (``meta_create``, ``meta_stat``,
``meta_readdir``, ``meta_unlink``) and ``mixed`` two (``mixed_read``, ``mixed_write``). All
clients wait at the same barrier before the timed section and stamp its start and end with
the system-wide monotonic clock, so the benchmark process can compute the span from the
first start to the last end.

Workloads (``size`` is per client, ``block`` the I/O size of sequential workloads):

=================  =====================================================================
seq_write          each client writes its own file ``seq/cI`` of ``size``, fsync, close
seq_read           each client reads its own file back (written first if missing)
shared_write       all clients write disjoint ``size`` regions of one file ``shared/data``
shared_read        all clients read their region of the shared file
rand_read_4k/64k/  random aligned reads of 4 KiB / 64 KiB / 1 MiB from the client's own
1m                 file for ``duration`` seconds (dataloader sampling)
checkpoint         all clients at once write ``shards`` files each (total ``size``), fsync,
                   rename into place (the atomic-commit pattern)
metadata           mdtest-style: create, stat, readdir, unlink ``files`` empty files
mixed              half the clients run random 1 MiB reads while the rest write a
                   checkpoint burst ("training with background traffic")
=================  =====================================================================

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
from ._sessions import Reader, Session, Writer

__all__ = ["WORKLOADS", "ClientContext", "PartResult", "run_workload", "record_names"]

EXACT_EVERY = 8  # exact byte comparison for every 8th sequential block (stamps: all blocks)
RAND_EXACT_EVERY = 64


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


def _aligned(n: int) -> memoryview:
    buf = mmap.mmap(-1, max(n, PAGE))
    buf[:] = bytes(len(buf))  # pre-fault: first touch would be timed otherwise
    return memoryview(buf)[:n]


def _write(w: Writer, ctx: ClientContext, fid: int, size: int, block: int, part: PartResult,
           base: int = 0, positional: bool = False) -> None:
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
          buf: memoryview, base: int = 0) -> None:
    """Read ``size`` bytes at ``base`` in ``block`` pieces, verifying every piece."""
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


def _read_back(s: Session, ctx: ClientContext, path: str, fid: int, size: int, block: int,
               base: int = 0) -> int:
    """Untimed check of the first and last block written: returns bytes compared exactly."""
    buf = _aligned(min(block, size))
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


def _check_size(s: Session, path: str, want: int) -> None:
    got = s.size(path)
    if got != want:
        raise VerifyError(f"{path}: size {got} after writing {want} bytes")


def _write_own(s: Session, ctx: ClientContext, path: str, size: int, block: int,
               part: PartResult) -> None:
    w = s.create(path)
    try:
        _write(w, ctx, file_id(path), size, block, part)
        w.fsync()
    finally:
        w.close()


def _ensure_seq(s: Session, ctx: ClientContext, task: dict[str, Any]) -> str:
    """The client's own sequential file, written untimed if an earlier run did not leave it."""
    path = f"seq/c{ctx.index}"
    s.makedirs("seq")
    try:
        if s.size(path) == task["size"]:
            return path
    except FileNotFoundError:
        pass
    _write_own(s, ctx, path, task["size"], task["block"], PartResult())
    return path


def seq_write(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    path, part = f"seq/c{ctx.index}", PartResult()
    s.makedirs("seq")
    ctx.wait()
    part.t0 = clock()
    _write_own(s, ctx, path, task["size"], task["block"], part)
    part.t1 = clock()
    _check_size(s, path, task["size"])
    part.verified = _read_back(s, ctx, path, file_id(path), task["size"], task["block"])
    return {"seq_write": part}


def seq_read(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    path, part = _ensure_seq(s, ctx, task), PartResult()
    buf = _aligned(task["block"])
    r = s.open_read(path)
    try:
        ctx.wait()
        part.t0 = clock()
        _read(r, ctx, file_id(path), task["size"], task["block"], part, buf)
        part.t1 = clock()
    finally:
        r.close()
    return {"seq_read": part}


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
        _write(w, ctx, file_id(SHARED), size, task["block"], part, base=ctx.index * size,
               positional=True)
        w.fsync()
    finally:
        w.close()
    part.t1 = clock()
    ctx.wait()  # every region is committed before anyone checks the length
    _check_size(s, SHARED, size * ctx.clients)
    part.verified = _read_back(s, ctx, SHARED, file_id(SHARED), size, task["block"],
                               base=ctx.index * size)
    return {"shared_write": part}


def shared_read(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    size, part = task["size"], PartResult()
    if ctx.index == 0:
        s.makedirs("shared")
        try:
            ready = s.size(SHARED) == size * ctx.clients
        except FileNotFoundError:
            ready = False
        if not ready:  # routes without offset writes get the file written in one stream
            _write_own(s, ctx, SHARED, size * ctx.clients, task["block"], PartResult())
    ctx.wait()
    buf = _aligned(task["block"])
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
    """Aligned random reads of ``req`` bytes until ``until(part)`` says stop."""
    buf = _aligned(req)
    rng = np.random.default_rng(1000 + ctx.index)
    slots = max(1, size // req)
    while not until(part):
        off = int(rng.integers(0, slots)) * req
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


def _rand_read(name: str, req: int) -> Callable[..., dict[str, PartResult]]:
    def run(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
        path, part = _ensure_seq(s, ctx, task), PartResult()
        r = s.open_read(path)
        try:
            ctx.wait()
            part.t0 = clock()
            end, cap = part.t0 + task["duration"], task.get("max_ops", 1 << 40)
            _random_reads(r, ctx, file_id(path), task["size"], req,
                          lambda p: p.ops >= cap or clock() >= end, part)
            part.t1 = clock()
        finally:
            r.close()
        return {name: part}

    run.__name__ = name
    return run


def _checkpoint_files(s: Session, ctx: ClientContext, task: dict[str, Any], tag: str,
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
            _write(w, ctx, file_id(final + ".tmp"), n, task["block"], part)
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
    files = _checkpoint_files(s, ctx, task, tag, part)
    part.t1 = clock()
    for path, n in files:
        _check_size(s, path, n)
    # the bytes were stamped with the .tmp name: a rename must not change content
    part.verified = sum(_read_back(s, ctx, p, file_id(p + ".tmp"), n, task["block"])
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
    return parts


def mixed(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    """Readers (the first half, rounded up) sample 1 MiB reads until every writer is done."""
    if ctx.clients < 2:
        raise NotImplementedError("mixed needs at least 2 clients")
    writers = ctx.clients // 2
    reader = ctx.index < ctx.clients - writers
    part = PartResult()
    if reader:
        path = _ensure_seq(s, ctx, task)
        r = s.open_read(path)
        try:
            ctx.wait()
            part.t0 = clock()
            end = part.t0 + ctx.timeout
            _random_reads(r, ctx, file_id(path), task["size"], 1 << 20,
                          lambda p: ctx.writers_done.value >= writers or clock() >= end, part)
            part.t1 = clock()
        finally:
            r.close()
        return {"mixed_read": part}
    s.makedirs(f"ckpt/{task['tag']}")
    ctx.wait()
    part.t0 = clock()
    try:
        files = _checkpoint_files(s, ctx, task, task["tag"], part)
    finally:
        with ctx.writers_done.get_lock():  # readers stop even if this writer failed
            ctx.writers_done.value += 1
    part.t1 = clock()
    for path, n in files:
        _check_size(s, path, n)
        s.unlink(path)
    return {"mixed_write": part}


WORKLOADS: dict[str, Callable[[Session, dict[str, Any], ClientContext], dict[str, PartResult]]] = {
    "seq_write": seq_write,
    "seq_read": seq_read,
    "shared_write": shared_write,
    "shared_read": shared_read,
    "rand_read_4k": _rand_read("rand_read_4k", 4 << 10),
    "rand_read_64k": _rand_read("rand_read_64k", 64 << 10),
    "rand_read_1m": _rand_read("rand_read_1m", 1 << 20),
    "checkpoint": checkpoint,
    "metadata": metadata,
    "mixed": mixed,
}


def record_names(workload: str) -> list[str]:
    """The record names a workload produces."""
    return {"metadata": ["meta_create", "meta_stat", "meta_readdir", "meta_unlink"],
            "mixed": ["mixed_read", "mixed_write"]}.get(workload, [workload])


def run_workload(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    """Run ``task['workload']`` in this client. Raises KeyError for an unknown workload."""
    return WORKLOADS[task["workload"]](s, task, ctx)
