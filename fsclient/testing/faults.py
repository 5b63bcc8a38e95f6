"""Fault schedules against a local cluster, with writers and readers recording a history.

:func:`run_schedule` starts a :class:`~fsclient.testing.LocalCluster` (R = 2 or
3), writes the initial content of a few files, starts writer and reader
*processes* (each with its own client) that log every operation
(:mod:`.history`), and plays a seeded :class:`Schedule` of faults:

* ``kill``: SIGKILL a storage server, ``restart`` it later (``up`` starts only
  dead processes; it returns ``syncing``);
* ``pause``: SIGSTOP a storage server for longer than the failure timeout (to
  the others it is partitioned away: declared offline), then SIGCONT;
* ``add``: :func:`add_server` (chains move to the newcomer while traffic runs);
* ``slow``: a slow disk -- every fsync of one storage server, or of the metadata
  service's log, sleeps 50-300 ms first, until ``fast`` (the processes run with
  ``STRIPEFS_SLOW_FSYNC_FILE``; the fault is that file in the victim's directory).

The writers overwrite slots; writer 0 also truncates a file at a region boundary
and extends it back (the regions past the cut become zeros: issue #27 item 1's
class, a cut's bytes coming back, shows as a stale read), and renames files (each
file's name is a register too, read by the readers' listings).

Faults come one at a time (a server is back before the next fault), but the next
may strike while a returned server is still syncing: a chain of two then has no
serving target until the struck server returns, which clients ride out. So no
operation may fail. Afterwards every server runs again, the cluster heals, and
the checker verifies the history, the final bytes, and that every replica of
every chunk has the same version and digest (asked of the storage servers).

``STRIPEFS_FAULTS_INJECT=cut-lost`` is the checker's self-test: writer 0's truncates
leave the bytes in place (issue #27 item 1's outcome) and the run must fail with stale reads.

Run one schedule: ``python -m stripefs.fsclient.testing.faults --seed 3 [--replicas 2]``;
many: ``python -m stripefs.bench.fault_soak --seeds 50``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import crc32c

from stripefs.wire import ErrorCode, StripefsError
from stripefs.wire import messages as m

from ..core import Client
from ._cluster import SERVER_FILE, LocalCluster
from .history import Op, Verdict, check, load

__all__ = ["Event", "Outcome", "Schedule", "replica_mismatches", "run_schedule", "write_initial", "wait_workers",
           "final_content"]

CHUNK = 256 * 1024
SLOT = 96 * 1024  # slots straddle chunk boundaries (256 KiB chunks): a slot write is two pieces
SLOTS = 16  # per file: 1.5 MiB, 6 chunks over as many chains
FILES = 3
OFFLINE_AFTER = 5.0  # the metadata service's failure timeout


@dataclass(frozen=True)
class Event:
    at: float  # seconds after the traffic started
    action: str  # kill, restart, pause, resume, add, slow, fast
    server: int = 0  # index into the live servers (kill, pause); the victim is remembered for the pair


@dataclass
class Schedule:
    """A seeded list of faults, one at a time: each struck server is back before the next fault."""

    seed: int
    replicas: int
    events: list[Event] = field(default_factory=list)

    @classmethod
    def generate(cls, seed: int, replicas: int = 2, duration: float = 20.0, *, add: bool = True,
                 slow: bool = True) -> Schedule:
        rng = random.Random(seed)
        events: list[Event] = []
        t = rng.uniform(0.5, 2.0)
        added = not add
        while t < duration:
            kind = rng.choice(["kill", "pause"] + ([] if added else ["add"]) + (["slow"] if slow else []))
            if kind == "slow":  # victim % 3 == 0: the metadata service's log, else a storage server
                victim = rng.randrange(1 << 16)
                down = rng.uniform(1.0, 4.0)
                events.append(Event(t, "slow", victim))
                events.append(Event(t + down, "fast", victim))
                t += down + rng.uniform(0.2, 2.0)
                continue
            if kind == "add":
                events.append(Event(t, "add"))
                added = True
                t += rng.uniform(1.0, 4.0)
                continue
            victim = rng.randrange(1 << 16)
            # Down for less than detection (back before anyone noticed), or for longer.
            down = rng.choice([rng.uniform(0.5, 3.0), rng.uniform(OFFLINE_AFTER + 1.0, OFFLINE_AFTER + 4.0)])
            events.append(Event(t, kind, victim))
            events.append(Event(t + down, "restart" if kind == "kill" else "resume", victim))
            t += down + rng.uniform(0.2, 3.0)  # the next fault may catch a returned server syncing
        return cls(seed, replicas, events)

    def describe(self) -> str:
        return ", ".join(f"{e.at:.1f}s {e.action}" + (f"#{e.server % 100}" if e.action not in ("add",) else "")
                         for e in self.events)


SLOW_FILE = "fault-slow-fsync"  # STRIPEFS_SLOW_FSYNC_FILE for the cluster's processes
REPORT = "report.txt"  # ROOT/report.txt: the whole report of a run (the printed one shows ten violations)
NAME = -1  # the region index of a file's name register


@dataclass
class Outcome:
    seed: int
    schedule: str
    verdict: Verdict
    replicas_differ: list[str]
    root: str
    crashed: list[str] = field(default_factory=list)  # workers that died (their logs end early)

    @property
    def ok(self) -> bool:
        return self.verdict.ok and not self.replicas_differ and not self.crashed

    def report(self, limit: int | None = 10) -> str:
        """The verdict, the first ``limit`` violations and replica differences (None: all)."""
        lines = [f"seed {self.seed}: {'ok' if self.ok else 'FAILED'}: {self.verdict.summary()}",
                 f"  schedule: {self.schedule}"]
        lines += [f"  violation: {x}" for x in self.verdict.violations[:limit]]
        lines += [f"  replicas differ: {x}" for x in self.replicas_differ[:limit]]
        lines += [f"  worker crashed: {x}" for x in self.crashed]
        return "\n".join(lines)


# -- the workload ---------------------------------------------------------------------------
# The checker's registers: byte ranges cut at slot and at chunk boundaries. A chunk write is
# atomic on each replica, a write of several chunks is not: a read racing it may return
# some pieces old and some new, so each piece is judged on its own.
_CUTS = sorted(set(range(0, SLOTS * SLOT + 1, SLOT)) | set(range(0, SLOTS * SLOT + 1, CHUNK)))
UNITS = list(zip(_CUTS, _CUTS[1:]))


def _units_in(lo: int, hi: int) -> list[int]:
    return [u for u, (a, b) in enumerate(UNITS) if lo <= a and b <= hi]


def _bytes(seed: str, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _name_crc(name: str) -> int:
    return crc32c.crc32c(name.encode())


def _file_of(name: str) -> int | None:
    """The file index a name in ``/h`` belongs to (``f3``, ``f3.w0.17``)."""
    head = name.split(".", 1)[0]
    return int(head[1:]) if head.startswith("f") and head[1:].isdigit() else None


def _truncate_extend(c: Client, names: list[str], f: int, cut: int, full: int,
                     log: Any, who: str) -> None:
    """Truncate file ``f`` to ``cut`` and extend it back to ``full``: the regions past the cut
    become zeros, a write of zeros (``"t"``) acknowledged once the extend is, if the cut was
    committed (the truncate succeeded, or failed after committing: its bytes must never come
    back). The extend is retried while a failed cut is still queued (EIO)."""
    path = f"/h/{names[f]}"
    t0 = time.monotonic()
    err: str | None = None
    try:
        if os.environ.get("STRIPEFS_FAULTS_INJECT") == "cut-lost":
            # The checker's self-test: the cut never reaches the bytes (issue #27 item 1's
            # outcome), the size moves all the same. Its reads must be judged stale.
            c.truncate(path, full)
        else:
            c.truncate(path, cut)
        committed = True
    except OSError as exc:
        err = f"truncate: {type(exc).__name__}: {exc}"
        try:
            committed = c.stat(path).size == cut
        except OSError:
            committed = False
    deadline = time.monotonic() + 90
    while True:
        try:
            c.truncate(path, full)
            extended = True
            break
        except OSError as exc:
            err = (err + "; " if err else "") + f"extend: {type(exc).__name__}: {exc}"
            extended = False
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    t1 = time.monotonic()
    for u in _units_in(cut, full):
        a, b = UNITS[u]
        log.write(Op("t", who, (f, u), crc32c.crc32c(bytes(b - a)), t0, t1, committed and extended, err).to_json() + "\n")


def _rename(c: Client, names: list[str], f: int, seq: int, log: Any, who: str) -> None:
    """Rename file ``f`` to a fresh name: a write of its name register."""
    new = f"f{f}.{who}.{seq}"
    t0 = time.monotonic()
    err: str | None = None
    try:
        c.rename(f"/h/{names[f]}", f"/h/{new}")
    except OSError as exc:
        err = f"{type(exc).__name__}: {exc}"
    t1 = time.monotonic()
    log.write(Op("n", who, (f, NAME), _name_crc(new), t0, t1, err is None, err).to_json() + "\n")
    if err is None:
        names[f] = new
    else:  # it may have happened all the same: learn the name
        try:
            names[f] = next(n for n in c.listdir("/h") if _file_of(n) == f)
        except (OSError, StopIteration):
            pass


def _read_names(c: Client, files: int, log: Any, who: str) -> None:
    """A listing of ``/h``: a read of every file's name register (a missing file reads as '')."""
    t0 = time.monotonic()
    try:
        listing = c.listdir("/h")
    except OSError as exc:
        for f in range(files):
            log.write(Op("r", who, (f, NAME), None, t0, time.monotonic(), False, f"{type(exc).__name__}: {exc}").to_json()
                      + "\n")
        return
    t1 = time.monotonic()
    found = {_file_of(n): n for n in listing}
    for f in range(files):
        log.write(Op("r", who, (f, NAME), _name_crc(found.get(f, "")), t0, t1, True).to_json() + "\n")


@contextlib.contextmanager
def _flocked(f: Any) -> Iterator[None]:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


def _worker(spec: dict[str, Any]) -> None:
    """A writer or a reader process: random slots until the stop file appears."""
    rng = random.Random(spec["seed"])
    who, stop, deadline = spec["who"], spec["stop"], time.monotonic() + spec["max_seconds"]
    with Client(spec["cluster"]) as c, open(spec["log"], "a", buffering=1) as log:
        # By inode: writer 0 may have renamed a file before a later worker starts.
        attrs = [c.stat_inode(ino) for ino in spec["inos"]]
        # A file's writes and its truncate + extend take turns (flock on a local file per
        # file): the writers write in place without committing a length (write_from), so
        # a write landing past the end while another writer has the file cut short is not
        # file data, and the extend rightly reads it as zeros; the model cannot tell.
        locks = [open(os.path.join(os.path.dirname(stop), f"lock-{f}"), "a+") for f in range(len(attrs))]
        names = [p.rsplit("/", 1)[1] for p in spec["paths"]]  # writer 0 alone renames (it knows the names)
        namespace = spec["role"] == "writer" and spec.get("namespace", False)
        seq = 0
        while not os.path.exists(stop) and time.monotonic() < deadline:
            f = rng.randrange(len(attrs))
            roll = rng.random()
            if namespace and roll < 0.06:
                seq += 1
                _rename(c, names, f, seq, log, who)
                continue
            if namespace and roll < 0.12:
                cut = rng.choice([a for a, _b in UNITS])
                with _flocked(locks[f]):
                    _truncate_extend(c, names, f, cut, SLOTS * SLOT, log, who)
                continue
            if spec["role"] == "reader" and roll < 0.1:
                _read_names(c, len(attrs), log, who)
                time.sleep(rng.uniform(0.0, 0.02))
                continue
            s = rng.randrange(SLOTS)
            n = min(rng.choice([1, 1, 2]), SLOTS - s)
            attr = attrs[f]
            assert attr.layout is not None  # regular files have one
            t0 = time.monotonic()
            err: str | None = None
            lo, hi = s * SLOT, (s + n) * SLOT
            if spec["role"] == "writer":
                seq += 1
                data = _bytes(f"{who}-{seq}", hi - lo)
                with _flocked(locks[f]):
                    t0 = time.monotonic()
                    try:
                        c.write_from(attr.ino, attr.layout, lo, memoryview(data))
                    except OSError as exc:
                        err = f"{type(exc).__name__}: {exc}"
                    t1 = time.monotonic()
                for u in _units_in(lo, hi):
                    a, b = UNITS[u]
                    log.write(Op("w", who, (f, u), crc32c.crc32c(data[a - lo:b - lo]), t0, t1, err is None, err).to_json()
                              + "\n")
            else:
                buf = bytearray(hi - lo)
                try:
                    # The file's full length, not ``attr.size``: that was read once at start,
                    # maybe while writer 0 had the file cut short (between its truncate and the
                    # extend), and every later read past it would return zeros without asking a
                    # server -- stale reads that are the workload's, not the cluster's. The
                    # files are never longer; while cut short, the chunks past the cut are
                    # holes, which read as zeros all the same.
                    c.read_into(attr.ino, attr.layout, SLOTS * SLOT, lo, memoryview(buf))
                except OSError as exc:
                    err = f"{type(exc).__name__}: {exc}"
                t1 = time.monotonic()
                for u in _units_in(lo, hi):
                    a, b = UNITS[u]
                    crc = None if err else crc32c.crc32c(memoryview(buf)[a - lo:b - lo])
                    log.write(Op("r", who, (f, u), crc, t0, t1, err is None, err).to_json() + "\n")
            time.sleep(rng.uniform(0.0, 0.02))


def _spawn_worker(spec: dict[str, Any], prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start a worker process; ``prefix`` goes before its command (``nsenter --net=...``: on another host)."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "stripefs.fsclient.testing.faults", "--worker",
                             json.dumps(spec)], stdin=subprocess.DEVNULL, start_new_session=True)


def write_initial(c: Client, seed: int, files: int = FILES) -> tuple[list[str], list[int], list[Op]]:
    """Make ``/h`` and its files with their initial content: (paths, inodes, the ``"i"`` ops)."""
    paths = [f"/h/f{i}" for i in range(files)]
    init: list[Op] = []
    inos: list[int] = []
    c.mkdir("/h")
    for f, p in enumerate(paths):
        data = _bytes(f"init-{seed}-{f}", SLOTS * SLOT)
        t0 = time.monotonic()
        c.write_bytes(p, data)
        inos.append(c.stat(p).ino)
        init += [Op("i", "init", (f, u), crc32c.crc32c(data[a:b]), t0, time.monotonic(), True)
                 for u, (a, b) in enumerate(UNITS)]
        init.append(Op("i", "init", (f, NAME), _name_crc(p.rsplit("/", 1)[1]), t0, time.monotonic(), True))
    return paths, inos, init


def wait_workers(procs: list[subprocess.Popen], logs: list[str], timeout: float = 90) -> list[str]:
    """Wait for the workers (after the stop file); the ones that crashed or did not stop, in words."""
    crashed: list[str] = []
    for proc, log_path in zip(procs, logs):
        try:
            if proc.wait(timeout=timeout) != 0:
                crashed.append(f"{os.path.basename(log_path)}: exit status {proc.returncode}")
        except subprocess.TimeoutExpired:
            proc.kill()
            crashed.append(f"{os.path.basename(log_path)}: did not stop")
    return crashed


def final_content(c: Client, files: int) -> dict[tuple[int, int], int]:
    """Every register's final value: each region's CRC and each file's name (by its listing)."""
    final = {}
    now = {_file_of(n): n for n in c.listdir("/h")}
    for f in range(files):
        final[(f, NAME)] = _name_crc(now.get(f, ""))
        data = c.read_bytes(f"/h/{now[f]}") if f in now else b""
        for u, (a, b) in enumerate(UNITS):
            final[(f, u)] = crc32c.crc32c(data[a:b])
    return final


# -- the cluster side ---------------------------------------------------------------------

def _servers(c: Client) -> list[Any]:
    return sorted(c.status().servers, key=lambda s: s.server_id)


def wait_healthy(c: Client, count: int, timeout: float = 120.0) -> None:
    """Every one of ``count`` servers serving, and no chain move in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = c.status()
        if len(st.servers) == count and all(s.state == "serving" for s in st.servers):
            routing = c.routing(refresh=True)
            if all(len(ms) == routing.replicas and all(state == "serving" for _, state in ms)
                   for ms in routing.members.values()):
                return
        time.sleep(0.3)
    raise StripefsError(ErrorCode.TIMEOUT, f"the cluster did not heal within {timeout:.0f}s: {c.status().servers}")


def replica_mismatches(c: Client) -> list[str]:
    """Chunks whose replicas differ in version or digest, asked of each chain's members.

    ``c`` must hold the servers' credential (``ROOT/server.json``): ``ListChunks`` is server-only.
    """
    routing = c.routing(refresh=True)
    out = []
    for chain, members in sorted(routing.members.items()):
        copies = {}
        for sid, _state in members:
            listing: dict[tuple[int, int], tuple[int, int | None]] = {}
            after = None
            while True:
                reply = c.call_storage(sid, m.ListChunks(chain=chain, after=after, limit=4096))
                for k, e in enumerate(reply.chunks):
                    listing[(int(e[0]), int(e[1]))] = (int(e[2]), None if reply.digests is None else int(reply.digests[k]))
                if not reply.more or not reply.chunks:
                    break
                after = [int(reply.chunks[-1][0]), int(reply.chunks[-1][1])]
            copies[sid] = listing
        keys = set().union(*copies.values()) if copies else set()
        for key in sorted(keys):
            seen = {sid: lst.get(key) for sid, lst in copies.items()}
            if len(set(seen.values())) > 1:
                out.append(f"chain {chain} chunk {key}: {seen}")
    return out


def run_schedule(seed: int, *, replicas: int = 2, servers: int | None = None, duration: float = 20.0,
                 writers: int = 2, readers: int = 2, root: str | None = None, add: bool = True,
                 slow: bool = True, namespace: bool = True) -> Outcome:
    """Play one seeded schedule and judge it (see the module docstring).

    ``namespace``: writer 0 also truncates/extends and renames files (else it only writes).
    """
    schedule = Schedule.generate(seed, replicas, duration, add=add, slow=slow)
    root = root or tempfile.mkdtemp(prefix=f"stripefs-faults-{seed}-")
    servers = servers or replicas + 1
    # Every process of the cluster (restarts and additions too) may be given a slow disk.
    saved_env = os.environ.get("STRIPEFS_SLOW_FSYNC_FILE")
    os.environ["STRIPEFS_SLOW_FSYNC_FILE"] = SLOW_FILE
    try:
        h = LocalCluster.start(os.path.join(root, "cluster"), servers=servers, replicas=replicas, chunk_size=CHUNK,
                               gc_grace=2.0)
    except BaseException:
        _restore_env(saved_env)
        raise
    procs: list[subprocess.Popen] = []
    stopped: set[int] = set()
    try:
        logs: list[str] = []
        with h.client() as c:
            paths, inos, init = write_initial(c, seed)
        stop = os.path.join(root, "stop")
        for k in range(writers + readers):
            role = "writer" if k < writers else "reader"
            log_path = os.path.join(root, f"{role}{k}.jsonl")
            logs.append(log_path)
            procs.append(_spawn_worker({"who": f"{role[0]}{k}", "role": role, "seed": f"{seed}-{k}", "cluster": h.file,
                                        "paths": paths, "inos": inos, "log": log_path, "stop": stop,
                                        "namespace": namespace and k == 0,
                                        "max_seconds": duration + 120}))
        _play(h, schedule, stopped)
        with open(stop, "w"):
            pass
        crashed = wait_workers(procs, logs)
        with h.client() as c:
            wait_healthy(c, len(h.data["servers"]))
            final = final_content(c, len(paths))
        with Client(os.path.join(h.root, SERVER_FILE)) as sc:  # ListChunks is for servers only
            differ = replica_mismatches(sc)
        verdict = check(init + load(logs), final, expect_no_errors=True)
        outcome = Outcome(seed, schedule.describe(), verdict, differ, root, crashed)
        with open(os.path.join(root, REPORT), "w") as f:  # every violation, not the first ten
            f.write(outcome.report(limit=None) + "\n")
        return outcome
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for pid in stopped:
            _signal(pid, signal.SIGCONT)
        _slow_off(h)
        h.down()
        _restore_env(saved_env)


def _restore_env(saved: str | None) -> None:
    if saved is None:
        os.environ.pop("STRIPEFS_SLOW_FSYNC_FILE", None)
    else:
        os.environ["STRIPEFS_SLOW_FSYNC_FILE"] = saved


def _slow_dirs(h: LocalCluster) -> list[str]:
    """Where a slow-disk fault's file goes: the metadata state directory, then each server's root."""
    return [os.path.join(h.root, "meta")] + [s["root"] for s in h.data["servers"]]


def _slow_off(h: LocalCluster) -> None:
    for d in _slow_dirs(h):
        try:
            os.unlink(os.path.join(d, SLOW_FILE))
        except OSError:
            pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _play(h: LocalCluster, schedule: Schedule, stopped: set[int]) -> None:
    start = time.monotonic()
    struck: dict[int, int] = {}  # event victim key -> pid
    with h.client() as c:
        for e in schedule.events:
            time.sleep(max(0.0, start + e.at - time.monotonic()))
            if e.action == "add":
                h.add_server()
            elif e.action in ("kill", "pause"):
                live = [s for s in _servers(c) if s.state != "offline"]
                victim = live[e.server % len(live)]
                struck[e.server] = victim.pid
                if e.action == "kill":
                    _signal(victim.pid, signal.SIGKILL)
                else:
                    _signal(victim.pid, signal.SIGSTOP)
                    stopped.add(victim.pid)
            elif e.action == "resume":
                pid = struck.pop(e.server)
                _signal(pid, signal.SIGCONT)
                stopped.discard(pid)
            elif e.action == "restart":
                struck.pop(e.server, None)
                h.up()
            elif e.action == "slow":  # one in three: the metadata log; else a live storage server
                dirs = _slow_dirs(h)
                where = dirs[0] if e.server % 3 == 0 else dirs[1 + e.server % (len(dirs) - 1)]
                with open(os.path.join(where, SLOW_FILE), "w") as f:
                    f.write(f"{0.05 + (e.server % 251) / 1000:.3f}")  # 50-300 ms per fsync
            elif e.action == "fast":
                _slow_off(h)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.fsclient.testing.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--duration", type=float, default=20.0)
    args = p.parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    outcome = run_schedule(args.seed, replicas=args.replicas, duration=args.duration)
    print(outcome.report())
    print(f"  logs: {outcome.root} (the whole report: {os.path.join(outcome.root, REPORT)})")
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
