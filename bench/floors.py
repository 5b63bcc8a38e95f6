"""This machine's floors, measured in the same run as the system under test.

Every stripefs benchmark reports its figures as a ratio to these floors, because the machines
this runs on swing 2x between runs (so every figure is reported against floors of its own run). Each ``floor_*`` function
returns a dict ``{"path", "bytes", "seconds", "gbps", ...details}`` with
``gbps == bytes / seconds / 1e9``.

Caveats:
    * All hot-path buffers are page-aligned (``mmap.mmap(-1, n)``) and pre-faulted: a buffer
      16 bytes off a page makes the kernel copy ~6x slower on this CPU, and first touch of
      fresh memory ~3x slower.
    * Disk floors write into fresh files (what a storage server does for a new chunk); they
      are buffered I/O, not O_DIRECT. A cold read only drops this file's clean pages with
      ``posix_fadvise(DONTNEED)``; it is best effort, not ``drop_caches``.
    * ``floor_socket`` starts its children with "spawn": a script calling it needs an
      ``if __name__ == "__main__":`` guard, as with any multiprocessing program.
    * Threads blocked in a disk syscall cannot be killed: a stuck disk raises TimeoutError but
      leaves a daemon thread behind.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import mmap
import multiprocessing as mp
import os
import platform
import queue
import re
import socket
import statistics
import struct
import tempfile
import threading
import time
import zlib
from typing import Any

import numpy as np

__all__ = [
    "floor_socket", "floor_memcpy", "floor_disk_write", "floor_disk_read",
    "machine_facts", "parse_size",
]

_SOCKBUF = 4 << 20        # SO_SNDBUF/SO_RCVBUF; net.core.[rw]mem_max caps it (4 MiB here)
_SAMPLE = 64 << 10        # bytes checksummed at the head and tail of every stream
_HEADER = struct.Struct("!QQ")  # stream id, stream length: sent before the start barrier
_PAGE = mmap.PAGESIZE


def _clock() -> float:
    # CLOCK_MONOTONIC is system-wide, so stamps from different processes compare.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _timeval(seconds: float) -> bytes:
    """struct timeval for SO_SNDTIMEO/SO_RCVTIMEO (zero would mean "never time out")."""
    seconds = max(seconds, 0.001)
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def _result(path: str, nbytes: int, seconds: float, **details: Any) -> dict[str, Any]:
    return {"path": path, "bytes": nbytes, "seconds": seconds,
            "gbps": nbytes / seconds / 1e9, **details}


def _aligned(n: int, fill: int | None = None) -> mmap.mmap:
    """Page-aligned anonymous buffer of ``n`` bytes, pre-faulted (random bytes if fill None)."""
    buf = mmap.mmap(-1, max(n, 1))
    arr = np.frombuffer(buf, dtype=np.uint8)
    if fill is None:
        arr[:] = np.random.default_rng(n).integers(0, 256, len(arr), dtype=np.uint8)
    else:
        arr.fill(fill)
    del arr  # an exported numpy view would stop mmap.close()
    return buf


def parse_size(text: str) -> int:
    """Parse ``"1G"``, ``"16M"``, ``"512k"``, ``"1.5GiB"``, ``"4096"`` into bytes (binary units).

    Raises:
        ValueError: not a non-negative size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    scale = 1 << (10 * " kmgt".index(m.group(2).lower() or " "))
    return int(float(m.group(1)) * scale)


# --- socket floor -------------------------------------------------------------------------

def _sender(sid: int, path: str, offset: int, length: int, port: int,
            barrier: Any, q: Any, timeout: float) -> None:
    """Child: connect, announce the stream, wait for the start, sendfile the share, close."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, open(path, "rb") as f:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKBUF)
            # Kernel send timeout keeps the socket blocking (no poll per call) yet bounded.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))
            s.settimeout(timeout)
            s.connect(("127.0.0.1", port))
            s.settimeout(None)
            s.sendall(_HEADER.pack(sid, length))
            barrier.wait(timeout)
            sent = 0
            while sent < length:
                n = os.sendfile(s.fileno(), f.fileno(), offset + sent, length - sent)
                if n == 0:
                    raise EOFError("sendfile returned 0 before the end of the file")
                sent += n
            s.shutdown(socket.SHUT_WR)
        q.put(("sent", sid, sent))
    except BaseException as exc:  # report, then die: the parent decides
        q.put(("error", f"sender {sid}", repr(exc)))


def _drain(sock: socket.socket, view: memoryview, length: int, out: dict[str, Any]) -> None:
    """Thread: recv_into ``view`` (reused ring of one block) until ``length`` bytes and EOF."""
    try:
        blk, got, pos = len(view), 0, 0
        first: float | None = None
        head: int | None = None
        sample = min(_SAMPLE, blk, length)
        while got < length:
            n = sock.recv_into(view[pos:], min(blk - pos, length - got))
            if n == 0:
                break
            if first is None:
                first = _clock()
            got += n
            pos = 0 if pos + n == blk else pos + n
            if head is None and got >= sample:
                head = zlib.crc32(view[:sample])
        last = _clock()
        tail = pos if pos else min(blk, got)
        out.update(received=got, first=first, last=last, head_crc=head, tail=tail,
                   tail_crc=zlib.crc32(view[:tail]), eof=sock.recv(1) == b"")
    except BaseException as exc:
        out["error"] = repr(exc)


def _receiver(rid: int, nstreams: int, block: int, barrier: Any, q: Any, timeout: float) -> None:
    """Child: accept ``nstreams`` connections, one draining thread each, report per stream."""
    try:
        slot = -(-block // _PAGE) * _PAGE  # keep each thread's slice page-aligned
        buf = _aligned(slot * nstreams, fill=0)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as ls:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKBUF)  # inherited by accept
            ls.bind(("127.0.0.1", 0))
            ls.listen(nstreams)
            ls.settimeout(timeout)
            q.put(("port", rid, ls.getsockname()[1]))
            conns = [ls.accept()[0] for _ in range(nstreams)]
        threads, outs = [], []
        for i, c in enumerate(conns):
            c.setblocking(True)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
            sid, length = _HEADER.unpack(c.recv(_HEADER.size, socket.MSG_WAITALL))
            outs.append({"stream": sid, "length": length,
                         "rcvbuf": c.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)})
            view = memoryview(buf)[i * slot:i * slot + block]
            threads.append(threading.Thread(target=_drain, args=(c, view, length, outs[-1]),
                                            daemon=True))
        for t in threads:
            t.start()
        barrier.wait(timeout)
        for t in threads:
            t.join(timeout)
        for c in conns:
            c.close()
        q.put(("recv", rid, outs))
    except BaseException as exc:
        q.put(("error", f"receiver {rid}", repr(exc)))


def _collect(q: Any, need: dict[str, int], procs: list[Any],
             deadline: float) -> dict[str, list[Any]]:
    """Gather ``need[kind]`` messages of each kind from children; raise on error/death/timeout."""
    got: dict[str, list[Any]] = {kind: [] for kind in need}
    while any(len(got[k]) < n for k, n in need.items()):
        try:
            msg = q.get(timeout=0.2)
        except queue.Empty:
            if _clock() > deadline:
                raise TimeoutError(f"waiting for {need} from children") from None
            dead = [p.name for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"children died: {dead}") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"{msg[1]} failed: {msg[2]}")
        got[msg[0]].append(msg[1:])
    return {k: sorted(v) for k, v in got.items()}


def _start(procs: list[Any], proc: Any) -> None:
    proc.start()
    procs.append(proc)  # only started ones: the cleanup joins them


def _write_stamped(fd: int, total: int) -> None:
    """Random bytes with the file offset stamped every 4 KiB, so misplaced data shows in a crc."""
    buf = _aligned(-(-min(total, 8 << 20) // _PAGE) * _PAGE)
    arr = np.frombuffer(buf, dtype=np.uint64)
    for off in range(0, total, len(buf)):
        n = min(len(buf), total - off)
        arr[::_PAGE // 8] = np.arange(off, off + len(buf), _PAGE, dtype=np.uint64)
        os.pwrite(fd, memoryview(buf)[:n], off)
    del arr
    buf.close()


def floor_socket(total_bytes: int, streams: int = 4, block: int = 1 << 20, processes: int = 1,
                 *, directory: str | None = None, timeout: float = 120.0) -> dict[str, Any]:
    """Loopback TCP: ``streams`` sendfile senders to ``processes`` recv_into receivers.

    Stream ``i`` carries share ``i`` of a warm temporary file and is owned by receiver
    ``i % processes``, which runs one thread per owned stream into a reused, page-aligned,
    pre-faulted ring of ``block`` bytes. Timing runs from the first byte any receiver sees to
    the last byte any receiver sees (all start behind one barrier).

    Returns:
        The result dict; details: streams, processes, block, rcvbuf, per_stream_gbps.

    Raises:
        RuntimeError: a child failed or died, or bytes/checksums do not match the file.
        TimeoutError: the children did not finish within ``timeout`` seconds.
    """
    if total_bytes < 1 or streams < 1 or not 1 <= processes <= streams:
        raise ValueError("need total_bytes >= 1, streams >= 1, 1 <= processes <= streams")
    ctx = mp.get_context("spawn")  # no inherited threads or fds from the caller
    fd, path = tempfile.mkstemp(prefix="floor-socket-", dir=directory)
    procs: list[Any] = []
    q = ctx.Queue()
    ok = False
    try:
        _write_stamped(fd, total_bytes)
        os.fdatasync(fd)  # no writeback during the timed window
        _read_all(fd, total_bytes, block)  # warm it in the page cache
        base, extra = divmod(total_bytes, streams)
        lengths = [base + (i < extra) for i in range(streams)]
        offsets = [sum(lengths[:i]) for i in range(streams)]
        deadline = _clock() + timeout
        barrier = ctx.Barrier(streams + processes)
        for r in range(processes):
            owned = len(range(r, streams, processes))
            _start(procs, ctx.Process(target=_receiver, name=f"recv{r}", daemon=True,
                                      args=(r, owned, block, barrier, q, timeout)))
        ports = dict(_collect(q, {"port": processes}, procs, deadline)["port"])
        for i in range(streams):
            _start(procs, ctx.Process(target=_sender, name=f"send{i}", daemon=True, args=(
                i, path, offsets[i], lengths[i], ports[i % processes], barrier, q, timeout)))
        msgs = _collect(q, {"sent": streams, "recv": processes}, procs, deadline)
        sent = dict(msgs["sent"])
        outs = [o for _, rs in msgs["recv"] for o in rs]
        checked = sum(_check_stream(fd, o, offsets[o["stream"]], lengths[o["stream"]],
                                    sent[o["stream"]]) for o in outs)
        firsts = [o["first"] for o in outs if o["first"] is not None]
        seconds = max(o["last"] for o in outs) - min(firsts)
        result = _result("floor_socket", sum(o["received"] for o in outs), seconds,
                       streams=streams, processes=processes, block=block,
                       rcvbuf=min(o["rcvbuf"] for o in outs), crc_checked_bytes=checked,
                       per_stream_gbps=sorted(
                           round(o["received"] / max(o["last"] - o["first"], 1e-9) / 1e9, 3)
                           for o in outs if o["first"] is not None))
        ok = True
        return result
    finally:
        for p in procs:  # on failure kill at once: a child may be stuck at the barrier
            p.join(timeout=2 if ok else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        q.close()
        os.close(fd)
        os.unlink(path)


def _check_stream(fd: int, o: dict[str, Any], offset: int, length: int, sent: int) -> int:
    """Exact byte count, clean EOF, head/tail crc32 against the file; returns bytes crc-checked."""
    if "error" in o or "received" not in o:
        raise RuntimeError(f"stream {o['stream']}: {o.get('error', 'receiver did not finish')}")
    if not (o["received"] == length == o["length"] == sent and o["eof"]):
        raise RuntimeError(f"stream {o['stream']}: sent {sent}, received {o['received']} of "
                           f"{length}, clean EOF {o['eof']}")
    sample = min(_SAMPLE, length)
    head = os.pread(fd, sample, offset)
    tail = os.pread(fd, o["tail"], offset + length - o["tail"])
    if sample and (zlib.crc32(head) != o["head_crc"] or zlib.crc32(tail) != o["tail_crc"]):
        raise RuntimeError(f"stream {o['stream']}: received bytes differ from the file")
    return sample + o["tail"]


# --- memory and disk floors ----------------------------------------------------------------

def floor_memcpy(total_bytes: int, block: int = 64 << 20, runs: int = 3) -> dict[str, Any]:
    """numpy ``copyto`` of ``total_bytes`` between two warm, page-aligned ``block`` buffers.

    Caveats: a block that fits in the last-level cache (32 MiB here) measures the cache.
    Returns the median of ``runs``; details: best_gbps, runs_gbps.
    """
    n = min(block, total_bytes)
    src_buf, dst_buf = _aligned(n), _aligned(n, fill=0)
    src, dst = np.frombuffer(src_buf, np.uint8), np.frombuffer(dst_buf, np.uint8)
    np.copyto(dst, src)  # warm-up
    times: list[float] = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for off in range(0, total_bytes, n):
            k = min(n, total_bytes - off)
            np.copyto(dst[:k], src[:k])
        times.append(time.perf_counter() - t0)
    if not np.array_equal(dst[:64], src[:64]):
        raise RuntimeError("copy did not copy")
    best = min(times)
    return _result("floor_memcpy", total_bytes, statistics.median(times), block=n,
                   best_gbps=total_bytes / best / 1e9,
                   runs_gbps=[round(total_bytes / t / 1e9, 3) for t in times])


def _write_file(fd: int, src: memoryview, total: int, fsync: str) -> None:
    for off in range(0, total, len(src)):
        view, done = src[:min(len(src), total - off)], 0
        while done < len(view):  # pwrite may be short
            done += os.pwrite(fd, view[done:], off + done)
        if fsync == "per_chunk":
            os.fdatasync(fd)
    if fsync == "end":
        os.fsync(fd)


def floor_disk_write(total_bytes: int, directory: str, chunk: int = 4 << 20,
                     fsync: str = "per_chunk", files: int = 1,
                     timeout: float = 600.0) -> dict[str, Any]:
    """``os.pwrite`` ``total_bytes`` in ``chunk`` pieces into ``files`` fresh files, one thread each.

    ``fsync``: "per_chunk" (fdatasync after every chunk, the storage servers' policy), "end"
    (one fsync per file at the end) or "none". Files are deleted afterwards.
    """
    if fsync not in ("per_chunk", "end", "none"):
        raise ValueError(f"fsync must be per_chunk, end or none, not {fsync!r}")
    src = memoryview(_aligned(min(chunk, max(total_bytes, 1))))
    shares = [total_bytes // files + (i < total_bytes % files) for i in range(files)]
    fds: list[int] = []
    paths: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(files + 1, timeout=timeout)

    def work(fd: int, share: int) -> None:
        try:
            start.wait()
            _write_file(fd, src, share, fsync)
        except BaseException as exc:
            errors.append(exc)

    try:
        for _ in range(files):
            fd, path = tempfile.mkstemp(prefix="floor-disk-", dir=directory)
            fds.append(fd)
            paths.append(path)
        threads = [threading.Thread(target=work, args=a, daemon=True) for a in zip(fds, shares)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join(max(0.0, t0 + timeout - time.perf_counter()))
        seconds = time.perf_counter() - t0
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"disk write not done after {timeout} s")
        if errors:
            raise RuntimeError("disk write failed") from errors[0]
        written = sum(os.fstat(fd).st_size for fd in fds)
        if written != total_bytes:
            raise RuntimeError(f"wrote {written} bytes of {total_bytes}")
        return _result("local_disk", written, seconds, op="write", fsync=fsync, chunk=chunk,
                       files=files, directory=directory)
    finally:
        for fd, path in zip(fds, paths):
            os.close(fd)
            os.unlink(path)


def _read_all(fd: int, total: int, chunk: int, buf: mmap.mmap | None = None) -> int:
    """``os.preadv`` the first ``total`` bytes of ``fd`` into a page-aligned buffer."""
    buf = buf if buf is not None else _aligned(chunk, fill=0)
    done = 0
    while done < total:
        n = os.preadv(fd, [memoryview(buf)[:min(chunk, total - done)]], done)
        if n == 0:
            break
        done += n
    return done


def floor_disk_read(total_bytes: int, directory: str, chunk: int = 4 << 20,
                    warm: bool = True) -> dict[str, Any]:
    """Write a ``total_bytes`` file in ``directory``, then time reading it back with ``os.preadv``.

    ``warm``: read once untimed first (page cache); else drop the file's pages with
    ``posix_fadvise(DONTNEED)`` after fsync (best effort, see Caveats). The file is deleted.
    """
    fd, path = tempfile.mkstemp(prefix="floor-disk-", dir=directory)
    try:
        _write_file(fd, memoryview(_aligned(min(chunk, max(total_bytes, 1)))), total_bytes, "end")
        buf = _aligned(chunk, fill=0)
        if warm:
            _read_all(fd, total_bytes, chunk, buf)
        else:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        got = _read_all(fd, total_bytes, chunk, buf)
        seconds = time.perf_counter() - t0
        if got != total_bytes:
            raise RuntimeError(f"read {got} bytes of {total_bytes}")
        return _result("local_disk", got, seconds, op="read", warm=warm, chunk=chunk,
                       directory=directory)
    finally:
        os.close(fd)
        os.unlink(path)


# --- facts and CLI -------------------------------------------------------------------------

def machine_facts() -> dict[str, Any]:
    """CPU, cores, memory, kernel, Python, key package versions (None if absent), host, date."""
    def grep(path: str, key: str) -> str | None:
        try:
            with open(path) as f:
                return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(key)), None)
        except OSError:
            return None

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    mem = grep("/proc/meminfo", "MemTotal")
    return {
        "cpu": grep("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": int(mem.split()[0]) * 1024 if mem else None,
        "kernel": platform.release(), "python": platform.python_version(),
        "packages": {p: version(p) for p in ("numpy", "trio", "msgpack", "fsspec", "torch")},
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m stripefs.bench.floors --size 1G --streams 4``: measure and print the floors."""
    ap = argparse.ArgumentParser(prog="python -m stripefs.bench.floors", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--block", type=parse_size, default=parse_size("1M"))
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory for the disk floors")
    args = ap.parse_args(argv)
    facts = machine_facts()
    print(f"{facts['cpu']}, {facts['cores']} cores, {facts['kernel']}, "
          f"Python {facts['python']}, {facts['hostname']}, {facts['date']}")
    runs = [
        ("memcpy", lambda: floor_memcpy(args.size)),
        (f"socket {args.streams} streams", lambda: floor_socket(
            args.size, args.streams, args.block, args.processes)),
        ("disk write, fdatasync/chunk", lambda: floor_disk_write(args.size, args.dir)),
        ("disk write, fsync at end", lambda: floor_disk_write(args.size, args.dir, fsync="end")),
        ("disk read, warm", lambda: floor_disk_read(args.size, args.dir)),
        ("disk read, cold (fadvise)", lambda: floor_disk_read(args.size, args.dir, warm=False)),
    ]
    print(f"{'floor':<30} {'path':<14} {'bytes':>12} {'seconds':>9} {'GB/s':>7}")
    for name, run in runs:
        r = run()
        print(f"{name:<30} {r['path']:<14} {r['bytes']:>12} {r['seconds']:>9.3f} {r['gbps']:>7.2f}")


if __name__ == "__main__":
    # bench/__init__ imports this module, so `-m bench.floors` holds two copies of it: run the
    # package's, and drop __spec__ so spawned children re-run this file by path, not by the
    # module name (which would print runpy's "found in sys.modules" warning in every child).
    import sys

    from stripefs.bench import floors as _package_copy

    sys.modules["__main__"].__spec__ = None
    _package_copy.main()
