"""A randomized coherence history over native clients and FUSE mounts, and its checker.

    python -m stripefs.fsclient.testing.coherence --seed 7 --duration 20 [--ttl 1] [--history FILE]

Actors (two native :class:`~fsclient.Client` s with leases, two mounts of the same
cluster) run seeded operations on one small tree: ``stat``/``lstat`` (through symlinks
too), whole-file reads, listings; and mutations: a rewrite at the same size (``wb`` or
in place) followed, as ``cp -p``/``rsync -a`` do, by a utime back to the old mtime,
truncate, rename of files (over files too) and of directories, symlink create and
remove, create and unlink. Each operation is recorded as (start, end, op, args, result)
on ``time.monotonic()`` (one clock: every process runs on this machine).

**The model.** Mutations are serialised (one lock, held by the actor that mutates), so
they form a total order m1, m2, ... with known intervals ``[a_i, b_i]``; after each one,
still under the lock, an *oracle* (a native client with no cache) snapshots the tree
(names, inodes, sizes, times) and the contents it predicted are read back. State
``S_i`` may be current at any instant of ``[a_i, b_(i+1)]``. Each snapshot is also
checked against the predicted effect of the mutation (a rename that lands elsewhere, a
create in the wrong directory, a rewrite whose bytes differ are violations too).
Contents are block-tagged (each 4 KiB block names its version and index), so a read
decodes to the versions it saw.

**The windows** (docs/architecture.md "Attribute leases", docs/fuse.md "Attribute
leases" and "Caches"), encoded in :func:`check`:

* a native client with leases is linearizable: ``stat``, ``lstat``, ``listdir`` and the
  bytes a read returns come from one state current during the call (its lease cache is
  coherent; ``open`` is close-to-open);
* a mount's names and attributes (``stat``, ``lstat``, the name an ``open`` resolves, a
  listing) may lag by ``window`` = the mount's ``max(attr_timeout, entry_timeout)`` plus
  ``slack`` (the time between the service reading an answer and the kernel starting its
  timeout: the request's own latency): what is not leased -- entries this mount made or
  changed, ``readdirplus`` entries, names known absent, kept listings -- lives that long;
  leased answers are coherent and lie inside it. Each path component may come from a
  different instant of that window (the kernel caches them one by one), and a listing
  may join two pages of different instants (a kept page up to an entry the kernel was
  told newer attributes of since, then a fresh page after the last entry served);
* a mount's *contents* are close-to-open with no window: whatever inode the open
  resolved (``fstat`` tells which), the bytes are those of a version current between
  the open and the end of the read (``keep_cache`` only for the version last seen);
* while a rewrite, truncate or a mount's create of a file is in flight (and for a
  mount, up to ``window`` after it, what it cached meanwhile), that file's size and
  times are anything, and a read may mix blocks of the old and new versions and zeros.

Anything else is a :class:`Violation`, reported with the op, what it saw and what was
allowed. The lease TTL enters no window: it only bounds how long a change may wait for
a holder that does not acknowledge.

Caveats:
    * Mutations never race each other (the lock); concurrency is reads against
      mutations, and daemons' and watches' own threads against everything.
    * A mount mutates only names whose resolution was the same in every state of the
      last ``window`` (the kernel would act on a stale one, legitimately).
    * Directory attributes are not compared (plain ``attr_timeout``, and every create
      changes them), nor atime, modes or owners.
"""

from __future__ import annotations

import argparse
import bisect
import errno
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from stripefs.fsclient import Client

__all__ = ["Node", "State", "Record", "Violation", "Workload", "History", "Rig", "run_history", "check", "main"]

BLOCK = 4096
FILES, DIRS, LINKS = [f"f{i}" for i in range(6)], [f"d{i}" for i in range(4)], [f"l{i}" for i in range(3)]
ERRORS = ("ENOENT", "ESTALE")  # a mount's stale name of an inode that is gone


# -- contents -------------------------------------------------------------------------------
def block(version: int, index: int) -> bytes:
    return (b"<%08d:%05d>" % (version, index)) * (BLOCK // 16)  # 16 bytes a tag


def content(version: int, blocks: int) -> bytes:
    return b"".join(block(version, i) for i in range(blocks))


def decode(data: bytes) -> tuple[int, tuple[int, ...]]:
    """``(size, per-block version)``: 0 for a block of zeros, -1 for one that is neither."""
    out = []
    for i in range(0, len(data), BLOCK):
        piece = data[i:i + BLOCK]
        if piece.count(0) == len(piece):
            out.append(0)
            continue
        m = re.match(rb"<(\d{8}):(\d{5})>", piece)
        ok = m is not None and int(m.group(2)) == i // BLOCK and block(int(m.group(1)), i // BLOCK).startswith(piece)
        out.append(int(m.group(1)) if ok and m else -1)
    return len(data), tuple(out)


# -- the state --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    kind: str  # "d", "f", "l"
    size: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    target: str | None = None
    blocks: tuple[int, ...] = ()  # a file's per-block versions (0: zeros)

    def seen(self, ino: int) -> tuple:
        return ("f", ino, self.size, self.mtime_ns, self.ctime_ns) if self.kind == "f" else (self.kind, ino)


@dataclass
class State:
    root: int
    dentries: dict[tuple[int, str], int]
    nodes: dict[int, Node]

    def paths(self) -> dict[str, int]:
        """Every real path (no symlink on the way), relative to the tree's root ("" is it)."""
        out, todo = {"": self.root}, [("", self.root)]
        children: dict[int, list[tuple[str, int]]] = {}
        for (parent, name), ino in self.dentries.items():
            children.setdefault(parent, []).append((name, ino))
        while todo:
            path, ino = todo.pop()
            for name, child in children.get(ino, ()):
                p = f"{path}/{name}" if path else name
                out[p] = child
                if self.nodes[child].kind == "d":
                    todo.append((p, child))
        return out

    def names(self, ino: int) -> tuple[str, ...]:
        return tuple(sorted(n for (p, n) in self.dentries if p == ino))


def resolve(states: list[State], root: int, path: str, follow: bool) -> set[int | str]:
    """Where ``path`` may lead when each component may be looked up in any of ``states``
    (a list of one: a single snapshot): inode numbers, or errno names."""
    out: set[int | str] = set()
    todo = [(root, tuple(p for p in path.split("/") if p), 0)]
    seen = set()
    while todo:
        item = todo.pop()
        if item in seen:
            continue
        seen.add(item)
        ino, rest, hops = item
        if not rest:
            out.add(ino)
            continue
        for st in states:
            node = st.nodes.get(ino)
            if node is None:
                out.add("ENOENT")
            elif node.kind != "d":
                out.add("ENOTDIR")
            elif (child := st.dentries.get((ino, rest[0]))) is None:
                out.add("ENOENT")
            elif st.nodes[child].kind == "l" and (len(rest) > 1 or follow):
                if hops >= 8:
                    out.add("ELOOP")
                else:
                    target = tuple(p for p in (st.nodes[child].target or "").split("/") if p)
                    todo.append((ino, target + rest[1:], hops + 1))
            else:
                todo.append((child, rest[1:], hops))
    return out


# -- records --------------------------------------------------------------------------------
@dataclass
class Record:
    """One operation: ``result`` is ``("err", name)`` or the op's normalised answer."""

    seq: int
    actor: str
    mount: bool
    op: str
    args: tuple
    start: float
    end: float
    result: tuple = ()
    fuzzy: tuple[int, ...] = ()  # mutations: inodes whose attributes/bytes are in flux meanwhile

    def to_json(self) -> str:
        return json.dumps({"seq": self.seq, "actor": self.actor, "mount": self.mount, "op": self.op,
                           "args": list(self.args), "t0": self.start, "t1": self.end, "result": list(self.result),
                           "fuzzy": list(self.fuzzy)}, default=str)


@dataclass
class Violation:
    record: Record
    seen: Any
    allowed: Any
    why: str

    def __str__(self) -> str:
        r = self.record
        return (f"{r.actor} #{r.seq} {r.op}{r.args} [{r.start:.3f}, {r.end:.3f}] {self.why}: "
                f"saw {self.seen!r}, allowed {self.allowed!r}")


@dataclass
class Workload:
    """What the generator draws: the share of mutations, each op's weight, file sizes."""

    mutate: float = 0.3
    observe: dict[str, float] = field(default_factory=lambda: {"stat": 4, "lstat": 1, "read": 2, "lsread": 1, "listdir": 2})
    mutations: dict[str, float] = field(default_factory=lambda: {
        "rewrite": 4, "truncate": 1, "rename_file": 2, "rename_dir": 1, "symlink": 1, "unlink_link": 1,
        "create": 1, "unlink": 1})
    sizes: tuple[int, ...] = (1, 2, 4, 16)  # blocks of 4 KiB
    recent: float = 0.5  # share of observations aimed at names a recent mutation touched


# -- the file systems the actors use -----------------------------------------------------------
def _err(exc: OSError) -> tuple:
    return ("err", errno.errorcode.get(exc.errno or 0, str(exc.errno)))


def _seen_stat(st: os.stat_result | Any) -> tuple:
    import stat as S

    mode = st.st_mode if hasattr(st, "st_mode") else st.mode
    kind = "d" if S.S_ISDIR(mode) else "l" if S.S_ISLNK(mode) else "f"
    if hasattr(st, "st_mode"):
        ino, size, mt, ct = st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
    else:
        ino, size, mt, ct = st.ino, st.size, st.mtime_ns, st.ctime_ns
    return ("f", ino, size, mt, ct) if kind == "f" else (kind, ino)


class NativeFS:
    """The actor's view through a :class:`Client` (paths relative to the tree's root)."""

    mount = False

    def __init__(self, client: Client, root: str):
        self.c, self.root = client, root

    def p(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def stat(self, rel: str) -> tuple:
        return _seen_stat(self.c.stat(self.p(rel)))

    def lstat(self, rel: str) -> tuple:
        return _seen_stat(self.c.lstat(self.p(rel)))

    def listdir(self, rel: str) -> tuple:
        return ("ok", tuple(sorted(self.c.listdir(self.p(rel)))))

    def read(self, rel: str) -> tuple:
        with self.c.open(self.p(rel), "rb") as f:
            data = f.read()
            return ("ok", f.ino, *decode(data))

    def write(self, rel: str, data: bytes, how: str) -> None:
        if how == "new":
            self.c.write_bytes(self.p(rel), data, exclusive=True)
        elif how == "wb":
            self.c.write_bytes(self.p(rel), data)
        else:
            with self.c.open(self.p(rel), "r+b") as f:
                f.write(data)

    def utime(self, rel: str, ns: int) -> None:
        self.c.utime(self.p(rel), (ns, ns))

    def truncate(self, rel: str, size: int) -> None:
        self.c.truncate(self.p(rel), size)

    def rename(self, src: str, dst: str) -> None:
        self.c.rename(self.p(src), self.p(dst))

    def symlink(self, target: str, rel: str) -> None:
        self.c.symlink(target, self.p(rel))

    def unlink(self, rel: str) -> None:
        self.c.remove(self.p(rel))


class MountFS(NativeFS):
    """The same through a mount (plain ``os`` calls)."""

    mount = True

    def __init__(self, mountpoint: str, root: str):
        self.root = mountpoint.rstrip("/") + root

    def stat(self, rel: str) -> tuple:
        return _seen_stat(os.stat(self.p(rel)))

    def lstat(self, rel: str) -> tuple:
        return _seen_stat(os.lstat(self.p(rel)))

    def listdir(self, rel: str) -> tuple:
        return ("ok", tuple(sorted(os.listdir(self.p(rel)))))

    def read(self, rel: str) -> tuple:
        with open(self.p(rel), "rb") as f:
            ino = os.fstat(f.fileno()).st_ino
            return ("ok", ino, *decode(f.read()))

    def write(self, rel: str, data: bytes, how: str) -> None:
        with open(self.p(rel), {"new": "xb", "wb": "wb"}.get(how, "r+b")) as f:
            f.write(data)

    def utime(self, rel: str, ns: int) -> None:
        os.utime(self.p(rel), ns=(ns, ns))

    def truncate(self, rel: str, size: int) -> None:
        os.truncate(self.p(rel), size)

    def rename(self, src: str, dst: str) -> None:
        os.rename(self.p(src), self.p(dst))

    def symlink(self, target: str, rel: str) -> None:
        os.symlink(target, self.p(rel))

    def unlink(self, rel: str) -> None:
        os.unlink(self.p(rel))


# -- the history: a generator, serialised mutations checked by an oracle, the records ------------
NEW = -1  # a predicted dentry of an inode the mutation makes


class History:
    """The shared record of one run: the states, the mutations that made them, the observations.

    Args:
        oracle: a client with no cache (``leases=False, attr_timeout=0``): what it reads
            after a mutation, under the lock, is the state.
        root: the tree's directory in the cluster (made and filled already).
        window: seconds a mount's names and attributes may lag (see the module's doc).
    """

    def __init__(self, oracle: Client | None, root: str, window: float, workload: Workload | None = None, *,
                 initial: State | None = None):
        self.oracle, self.root, self.window = oracle, root, window
        self.workload = workload or Workload()
        self.lock = threading.Lock()
        self.records: list[Record] = []
        self.mutations: list[Record | None] = [None]  # mutations[i] made states[i]
        self.starts: list[float] = [float("-inf")]  # a_i
        self.ends: list[float] = [float("-inf")]  # b_i
        self.problems: list[Violation] = []  # found while mutating (unexpected errors, wrong effects)
        self.crashes: list[str] = []
        self.recent: deque[str] = deque(maxlen=12)
        self._seq = iter(range(1, 1 << 62))
        self._version = iter(range(1, 1 << 30))
        self.states: list[State] = [initial if initial is not None else self.snapshot(None, {}, {})]

    def add(self, rec: Record, state: State | None = None) -> None:
        """Record an operation; a mutation (``state``: the tree after it) also starts a new state."""
        self.records.append(rec)
        if state is not None:
            self.mutations.append(rec)
            self.starts.append(rec.start)
            self.ends.append(rec.end)
            self.states.append(state)

    # -- the oracle's state ----------------------------------------------------------------------
    def snapshot(self, prev: State | None, blocks: dict[str, tuple[int, ...]], targets: dict[str, str]) -> State:
        """The tree as the service has it now; ``blocks``/``targets`` (by path) are what the last
        mutation wrote; every other file keeps its predecessor's blocks (same inode)."""
        o = self.oracle
        assert o is not None, "a history with no oracle is given its states"
        root = o.stat(self.root).ino
        dentries: dict[tuple[int, str], int] = {}
        nodes: dict[int, Node] = {root: Node("d")}
        todo = [("", root)]
        while todo:
            rel, ino = todo.pop()
            for e in o.scandir(f"{self.root}/{rel}" if rel else self.root):
                path = f"{rel}/{e.name}" if rel else e.name
                dentries[(ino, e.name)] = e.ino
                a = e.attr if e.attr is not None else o.lstat(f"{self.root}/{path}")
                old = prev.nodes.get(e.ino) if prev is not None else None
                if stat_kind(a.mode) == "d":
                    nodes[e.ino] = Node("d")
                    todo.append((path, e.ino))
                elif stat_kind(a.mode) == "l":
                    target = targets.get(path) or (old.target if old is not None else None) or o.readlink(
                        f"{self.root}/{path}")
                    nodes[e.ino] = Node("l", target=target)
                else:
                    bl = blocks.get(path, old.blocks if old is not None else None)
                    if bl is None:  # the initial files: read once
                        bl = decode(o.read_bytes(f"{self.root}/{path}"))[1]
                    nodes[e.ino] = Node("f", a.size, a.mtime_ns, a.ctime_ns, blocks=bl)
        return State(root, dentries, nodes)

    # -- windows -----------------------------------------------------------------------------------
    def span(self, lo: float, hi: float) -> list[int]:
        """Indices of the states that may have been current at some instant of [lo, hi]."""
        last = bisect.bisect_right(self.starts, hi) - 1
        first = max(0, bisect.bisect_left(self.ends, lo) - 1)
        return list(range(first, max(first, last) + 1))

    def in_flux(self, lo: float, hi: float) -> set[int]:
        """Inodes a mutation overlapping [lo, hi] had in flux."""
        first, last = bisect.bisect_left(self.ends, lo), bisect.bisect_right(self.starts, hi) - 1
        return {ino for i in range(max(1, first), last + 1) for ino in self.mutations[i].fuzzy}  # type: ignore[union-attr]

    def context(self, v: Violation, before: float = 1.0) -> str:
        """What a violation's report needs to be judged without the run: the mutations
        that overlap ``[start - window - before, end]`` of its observation, one per line,
        their intervals in seconds from the observation's start, each with what its state
        held at the observed path (a listing's names, a node's kind and size)."""
        rec = v.record
        lo, rel = rec.start - self.window - before, rec.args[0] if rec.args else ""
        lines = [f"mutations around {rec.actor} #{rec.seq} {rec.op}({rel!r}) at 0 (its window: {self.window:.3f} s):"]
        for i in self.span(lo, rec.end):
            m, s = self.mutations[i], self.states[i]
            at = set()
            for r in resolve([s], s.root, rel, rec.op != "lstat"):
                node = s.nodes.get(r) if isinstance(r, int) else None
                at.add(r if isinstance(r, str) else "ENOENT" if node is None else
                       s.names(r) if node.kind == "d" else (node.kind, node.size))
            what = "the state before" if m is None else (
                f"[{m.start - rec.start:+.3f}, {m.end - rec.start:+.3f}] {m.actor} {m.op}{tuple(m.args)!r}")
            lines.append(f"  {what} -> {sorted(at, key=repr)}")
        return "\n".join(lines)

    # -- actors ------------------------------------------------------------------------------------
    def run_actor(self, name: str, fs: NativeFS, rng: random.Random, deadline: float) -> None:
        try:
            while time.monotonic() < deadline and not self.crashes:
                if rng.random() < self.workload.mutate and self.mutate(name, fs, rng):
                    continue
                self.observe(name, fs, rng)
        except Exception as exc:  # a bug of the harness, or an error no op expects: stop the run
            self.crashes.append(f"{name}: {type(exc).__name__}: {exc}")
            raise

    def observe(self, name: str, fs: NativeFS, rng: random.Random) -> None:
        st = self.states[-1]
        op = _draw(rng, self.workload.observe)
        rel = self._pick(rng, st, "read" if op == "lsread" else op)
        # "lsread": `ls -l DIR; cat DIR/F` -- the mount learns F from a listing first (readdirplus)
        for op, rel in [("listdir", rel.rpartition("/")[0]), ("read", rel)] if op == "lsread" else [(op, rel)]:
            rec = Record(next(self._seq), name, fs.mount, op, (rel,), time.monotonic(), 0.0)
            try:
                rec.result = getattr(fs, op)(rel)
            except OSError as exc:
                rec.result = _err(exc)
            rec.end = time.monotonic()
            self.add(rec)

    def _pick(self, rng: random.Random, st: State, op: str) -> str:
        if self.recent and rng.random() < self.workload.recent:
            return rng.choice(list(self.recent))
        paths = st.paths()
        kinds: dict[str, list[str]] = {"d": [], "f": [], "l": []}
        for p, ino in paths.items():
            kinds[st.nodes[ino].kind].append(p)
        if op == "read" and kinds["f"] and rng.random() < 0.7:
            return rng.choice(kinds["f"])
        if op == "listdir" and rng.random() < 0.7:
            return rng.choice(kinds["d"])
        base = rng.choice(kinds["l"]) if kinds["l"] and rng.random() < 0.25 else rng.choice(kinds["d"])
        name = rng.choice(FILES + DIRS + LINKS)
        return f"{base}/{name}" if base else name

    # -- mutations ---------------------------------------------------------------------------------
    def mutate(self, name: str, fs: NativeFS, rng: random.Random) -> bool:
        """Draw a mutation valid in the current state and do it, under the lock; False when none fits."""
        with self.lock:
            st = self.states[-1]
            now = time.monotonic()
            recent = [self.states[i] for i in self.span(now - self.window - 0.1, now)] if fs.mount else [st]
            paths = st.paths()
            for _ in range(12):
                op = _draw(rng, self.workload.mutations)
                plan = self._plan(op, rng, st, paths, lambda rel, want: resolve(recent, st.root, rel, False) == {want})
                if plan is not None:
                    self._do(name, fs, op, *plan)
                    return True
        return False

    def _plan(self, op: str, rng: random.Random, st: State, paths: dict[str, int],
              stable: Callable[[str, int | str], bool]) -> tuple | None:
        files = [p for p, i in paths.items() if st.nodes[i].kind == "f" and stable(p, i)]
        dirs = [p for p, i in paths.items() if st.nodes[i].kind == "d" and stable(p, i)]
        links = [p for p, i in paths.items() if st.nodes[i].kind == "l" and stable(p, i)]
        join = lambda d, n: f"{d}/{n}" if d else n  # noqa: E731

        def fresh(pool: list[str], parents: list[str]) -> str | None:
            d, n = rng.choice(parents), rng.choice(pool)
            p = join(d, n)
            return p if p not in paths and stable(p, "ENOENT") else None

        if op in ("rewrite", "truncate", "rename_file", "unlink") and files:
            src = rng.choice(files)
            node = st.nodes[paths[src]]
            if op == "rewrite" and node.size:
                return (src, rng.choice(["wb", "r+b"]), rng.random() < 0.8)
            if op == "truncate":
                return (src, BLOCK * rng.randrange(0, max(len(node.blocks), 1) + 2))
            if op == "unlink" and len(files) > 2:
                return (src,)
            if op == "rename_file":
                dst = join(rng.choice(dirs), rng.choice(FILES))
                over = paths.get(dst)
                if dst != src and (fresh([dst.rsplit("/", 1)[-1]], [dst.rpartition("/")[0]]) if over is None else
                                   st.nodes[over].kind == "f" and stable(dst, over)):
                    return (src, dst)
        if op == "rename_dir":
            srcs = [d for d in dirs if d]
            if srcs:
                src = rng.choice(srcs)
                parents = [d for d in dirs if d != src and not d.startswith(src + "/") and d.count("/") < 2]
                dst = fresh(DIRS, parents) if parents else None
                if dst is not None:
                    return (src, dst)
        if op == "symlink":
            dst = fresh(LINKS, dirs)
            target = rng.choice([*FILES, *DIRS, f"{rng.choice(DIRS)}/{rng.choice(FILES)}"])
            return (dst, target) if dst is not None else None
        if op == "unlink_link" and links:
            return (rng.choice(links),)
        if op == "create" and len(files) < 8:
            dst = fresh(FILES, dirs)
            return (dst, rng.choice(self.workload.sizes)) if dst is not None else None
        return None

    def _do(self, name: str, fs: NativeFS, op: str, *args: Any) -> None:
        st = self.states[-1]
        paths = st.paths()
        blocks: dict[str, tuple[int, ...]] = {}
        targets: dict[str, str] = {}
        expect = dict(st.dentries)
        where = lambda p: (paths[p.rpartition("/")[0]], p.rpartition("/")[2])  # noqa: E731
        sizes: dict[str, int] = {}
        fuzzy: tuple[int, ...] = ()
        if op == "rewrite":
            rel, how, utime = args
            node = st.nodes[paths[rel]]
            v = next(self._version)
            blocks[rel] = (v,) * (node.size // BLOCK)
            sizes[rel] = node.size
            self._run(name, fs, op, (rel, how), lambda: fs.write(rel, content(v, node.size // BLOCK), how), expect,
                      blocks, targets, sizes, (paths[rel],))
            if utime:
                self._run(name, fs, "utime", (rel, node.mtime_ns), lambda: fs.utime(rel, node.mtime_ns), expect,
                          {}, {}, {}, (), mtime=(rel, node.mtime_ns))
            return
        if op == "truncate":
            rel, size = args
            old = st.nodes[paths[rel]].blocks
            blocks[rel] = (old + (0,) * size)[:size // BLOCK]
            sizes[rel] = size
            call: Callable[[], None] = lambda: fs.truncate(rel, size)  # noqa: E731
            fuzzy = (paths[rel],)
        elif op in ("rename_file", "rename_dir"):
            src, dst = args
            expect.pop(where(src))
            expect[where(dst)] = paths[src]
            call = lambda: fs.rename(src, dst)  # noqa: E731
        elif op in ("unlink", "unlink_link"):
            (rel,) = args
            expect.pop(where(rel))
            call = lambda: fs.unlink(rel)  # noqa: E731
        elif op == "symlink":
            rel, target = args
            expect[where(rel)] = NEW
            targets[rel] = target
            call = lambda: fs.symlink(target, rel)  # noqa: E731
        else:  # create
            rel, n = args
            v = next(self._version)
            expect[where(rel)] = NEW
            blocks[rel], sizes[rel] = (v,) * n, n * BLOCK
            call = lambda: fs.write(rel, content(v, n), "new")  # noqa: E731
            args = (rel, n * BLOCK)
        self._run(name, fs, op, args, call, expect, blocks, targets, sizes, fuzzy)

    def _run(self, name: str, fs: NativeFS, op: str, args: tuple, call: Callable[[], None],
             expect: dict[tuple[int, str], int], blocks: dict[str, tuple[int, ...]], targets: dict[str, str],
             sizes: dict[str, int], fuzzy: tuple[int, ...], mtime: tuple[str, int] | None = None) -> None:
        rec = Record(next(self._seq), name, fs.mount, op, args, time.monotonic(), 0.0, fuzzy=fuzzy)
        try:
            call()
            rec.result = ("ok",)
        except OSError as exc:
            rec.result = _err(exc)
        rec.end = time.monotonic()
        prev = self.states[-1]
        new = self.snapshot(prev, blocks if rec.result == ("ok",) else {}, targets)
        if op == "create" and fs.mount:  # the new file is empty until the writer's close
            rec.fuzzy = tuple(i for k, i in new.dentries.items() if expect.get(k) == NEW)
        self.add(rec, new)
        for a in args:
            if isinstance(a, str) and a and not a.startswith(("wb", "r+b")):
                self.recent.append(a)
        self._verify(rec, prev, new, expect, blocks, sizes, mtime)

    def _verify(self, rec: Record, prev: State, new: State, expect: dict[tuple[int, str], int],
                blocks: dict[str, tuple[int, ...]], sizes: dict[str, int], mtime: tuple[str, int] | None) -> None:
        if rec.result != ("ok",):
            self.problems.append(Violation(rec, rec.result, ("ok",), "the mutation failed"))
            expect = prev.dentries
        got = new.dentries
        wrong = expect.keys() != got.keys() or any(
            (v != got[k]) if v != NEW else (got[k] in prev.nodes) for k, v in expect.items())
        if wrong:
            self.problems.append(Violation(rec, _diff(got, expect), "the predicted names", "the mutation's effect"))
            return
        paths = new.paths()
        for rel, want in blocks.items():
            if rec.result != ("ok",):
                break
            data = decode(self.oracle.read_bytes(f"{self.root}/{rel}"))
            if data != (sizes[rel], want) or new.nodes[paths[rel]].size != sizes[rel]:
                self.problems.append(Violation(rec, data, (sizes[rel], want), "the bytes the service holds after it"))
        if mtime is not None and rec.result == ("ok",) and new.nodes[paths[mtime[0]]].mtime_ns != mtime[1]:
            self.problems.append(Violation(rec, new.nodes[paths[mtime[0]]].mtime_ns, mtime[1], "the mtime after it"))


def _draw(rng: random.Random, weights: dict[str, float]) -> str:
    names = list(weights)
    return rng.choices(names, [weights[n] for n in names])[0]


def _diff(got: dict, expect: dict) -> dict[str, Any]:
    return {"missing": sorted(set(expect) - set(got)), "unexpected": sorted(set(got) - set(expect)),
            "moved": sorted(k for k in set(got) & set(expect) if expect[k] not in (NEW, got[k]))}


def stat_kind(mode: int) -> str:
    import stat as S

    return "d" if S.S_ISDIR(mode) else "l" if S.S_ISLNK(mode) else "f"


# -- the checker -----------------------------------------------------------------------------------
def check(h: History) -> list[Violation]:
    """Every observation against the states its window allows (see the module's doc), plus
    what the mutations themselves got wrong."""
    out = list(h.problems)
    for rec in h.records:
        if rec.op in ("stat", "lstat", "read", "listdir"):
            v = _check_one(h, rec)
            if v is not None:
                out.append(v)
    return out


def _groups(h: History, rec: Record, lo: float, hi: float) -> list[list[State]]:
    """A mount resolves each component in any state of its window; a native client in one state."""
    states = [h.states[i] for i in h.span(lo, hi)]
    return [states] if rec.mount else [[s] for s in states]


def _check_one(h: History, rec: Record) -> Violation | None:
    seen = rec.result
    if rec.mount and seen == ("err", "ESTALE"):
        seen = ("err", "ENOENT")  # a stale name of an inode that is gone: either errno
    lo, hi = rec.start - (h.window if rec.mount else 0.0), rec.end
    rel = rec.args[0]
    allowed: set = set()
    inos: set[int] = set()
    for group in _groups(h, rec, lo, hi):
        for r in resolve(group, group[0].root, rel, rec.op != "lstat"):
            if isinstance(r, str):
                allowed.add(("err", r))
                continue
            inos.add(r)
            for s in group:
                node = s.nodes.get(r)
                if node is None:
                    allowed.add(("err", "ENOENT"))
                elif rec.op in ("stat", "lstat"):
                    allowed.add(node.seen(r))
                elif rec.op == "listdir":
                    allowed.add(("ok", s.names(r)) if node.kind == "d" else ("err", "ENOTDIR"))
                elif node.kind == "d":
                    allowed.add(("err", "EISDIR"))
    if seen in allowed:
        return None
    if rec.op in ("stat", "lstat"):
        if seen[0] == "f" and seen[1] in inos and seen[1] in h.in_flux(lo, hi):
            return None  # its size and times are in flux
        return Violation(rec, seen, sorted(allowed, key=repr), _staleness(h, rec))
    if rec.op == "listdir":
        if rec.mount and seen[0] == "ok" and _joined(seen[1], [a[1] for a in allowed if a[0] == "ok"]):
            return None
        return Violation(rec, seen, sorted(allowed, key=repr), _staleness(h, rec))
    # read: the inode opened must be one the name led to; its bytes, close-to-open
    if seen[0] == "err":
        return Violation(rec, seen, sorted(allowed, key=repr), "the open's error")
    ino, size, got = seen[1], seen[2], tuple(seen[3])
    if ino not in inos:
        return Violation(rec, ("inode", ino), sorted(inos), "the inode the name led to")
    versions = [n for i in h.span(rec.start, rec.end) if (n := h.states[i].nodes.get(ino)) is not None and n.kind == "f"]
    if any((n.size, n.blocks) == (size, got) for n in versions):
        return None
    if versions and ino in h.in_flux(rec.start, rec.end) and size <= max(n.size for n in versions) and all(
            b == 0 or any(j < len(n.blocks) and n.blocks[j] == b for n in versions) for j, b in enumerate(got)):
        return None  # blocks of versions in flight, and zeros
    return Violation(rec, (size, _runs(got)), sorted({(n.size, _runs(n.blocks)) for n in versions}),
                     "the bytes of a version current between the open and the end of the read")


def _joined(seen: tuple[str, ...], listings: list[tuple[str, ...]]) -> bool:
    """A listing made of one kept page up to a name and a fresh one from there on: the
    names of ``a`` before some cut and those of ``b`` from it. The cut need not be a name
    seen: the daemon refetches after the last name it served, and the first name of the
    kept page it did not serve may be gone from the fresh one (it cuts at that name)."""
    for a in listings:
        for b in listings:
            for cut in {*a, *b, "\U0010ffff"}:
                if tuple(n for n in a if n < cut) + tuple(n for n in b if n >= cut) == seen:
                    return True
    return False


def _runs(blocks: Iterable[int]) -> str:
    """``(7, 7, 7, 0)`` -> ``"v7x3 zx1"``."""
    out: list[list[int]] = []
    for b in blocks:
        if out and out[-1][0] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return " ".join(f"{'z' if b == 0 else f'v{b}'}x{n}" for b, n in out) or "empty"


def _staleness(h: History, rec: Record) -> str:
    """How old a state must be to explain what was seen (the window it exceeds)."""
    seen = ("err", "ENOENT") if rec.result == ("err", "ESTALE") else rec.result
    window = h.window if rec.mount else 0.0
    for i in reversed(h.span(float("-inf"), rec.end)):
        s = h.states[i]
        for r in resolve([s], s.root, rec.args[0], rec.op != "lstat"):
            node = s.nodes.get(r) if isinstance(r, int) else None
            val = (("err", r) if isinstance(r, str) else ("err", "ENOENT") if node is None else
                   node.seen(r) if rec.op != "listdir" else ("ok", s.names(r)))
            if val == seen:
                until = h.ends[i + 1] if i + 1 < len(h.ends) else rec.end
                return f"stale by {rec.start - until:.3f}s (state {i}, window {window:.3f}s)"
    return f"no state ever had it (window {window:.3f}s)"


# -- the rig: a private cluster, its mounts and clients -------------------------------------------
class Rig:
    """A one-server cluster with ``lease_ttl``, two mounts (``attr_timeout`` = ``entry_timeout``
    = ``mount_timeout``), two native clients with leases and an oracle with no cache.

    Args:
        daemon_code: per mount index, Python run in that mount's daemon before it serves
            (tests inject a bug this way; the daemon then runs ``--foreground`` under us).
        mounts: how many mounts (0 where FUSE is not usable).
        services: metadata services; more than one needs ``store="postgresql"`` (a private
            PostgreSQL under ``workdir``, destroyed by :meth:`close`). Every client, the
            mounts' included, sends each request to the next service in turn, so a lease is
            granted by one service and broken by a change through another.
    """

    def __init__(self, workdir: str, *, lease_ttl: float, mount_timeout: float = 0.5, slack: float = 0.5,
                 mounts: int = 2, daemon_code: dict[int, str] | None = None, store: str = "sqlite",
                 services: int = 1):
        from stripefs.fsclient.testing import LocalCluster

        self.workdir, self.window = workdir, mount_timeout + slack
        self.store = store
        self.cluster = LocalCluster.start(os.path.join(workdir, "cluster"), servers=1, chunk_size=256 * 1024,
                                          lease_ttl=lease_ttl, metadata_store=store, metadata_services=services)
        self.mounts: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self.clients: list[Client] = []
        try:
            for i in range(mounts):
                mp = os.path.join(workdir, f"mnt{i}")
                self._mount(mp, [f"attr_timeout={mount_timeout}", f"entry_timeout={mount_timeout}"],
                            (daemon_code or {}).get(i))
            self.clients = [self.cluster.client(leases=True) for _ in range(2)]
            self.oracle = self.cluster.client(leases=False, attr_timeout=0)
        except BaseException:
            self.close()
            raise
        self._runs = 0

    def _mount(self, mp: str, opts: list[str], code: str | None) -> None:
        from stripefs.fsclient.fuse import main as fuse_main, mounted_fstype

        os.makedirs(mp, exist_ok=True)
        args = ["mount", mp, "--cluster", self.cluster.file] + [x for o in opts for x in ("-o", o)]
        if code is None:
            if fuse_main(args) != 0:
                raise RuntimeError(f"mount {mp} failed")
            self.mounts.append(mp)
            return
        script = code + "\nimport sys\nfrom stripefs.fsclient.fuse._daemon import main\nsys.exit(main(sys.argv[1:]))\n"
        with open(mp + ".log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-c", script, *args, "--foreground"], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log, start_new_session=True)
        self._procs.append(proc)
        deadline = time.monotonic() + 30
        while mounted_fstype(mp) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon of {mp} did not mount (log: {mp}.log)")
            time.sleep(0.05)
        os.stat(mp)
        self.mounts.append(mp)

    def close(self) -> None:
        from stripefs.fsclient.fuse import main as fuse_main

        for c in self.clients + ([self.oracle] if hasattr(self, "oracle") else []):
            c.close()
        for mp in self.mounts:
            if fuse_main(["umount", mp]) != 0:
                fuse_main(["umount", mp, "--lazy"])
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.cluster.down()
        if self.store == "postgresql":
            from stripefs.fsclient.testing import LocalPostgres

            LocalPostgres(self.cluster.root).destroy()

    def __enter__(self) -> "Rig":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_history(rig: Rig, seed: int, duration: float, workload: Workload | None = None) -> History:
    """One seeded run of ``duration`` seconds over the rig's clients and mounts, in a fresh tree."""
    rig._runs += 1
    root = f"/coh-{seed}-{os.getpid()}-{rig._runs}"
    o = rig.oracle
    for d in ("", "/d0", "/d1", "/d0/d2"):
        o.mkdir(root + d)
    for i, f in enumerate(("f0", "d0/f1", "d1/f2", "d0/d2/f3")):
        o.write_bytes(f"{root}/{f}", content(1000 + i, (1, 2, 4, 16)[i]))
    o.symlink("d1", f"{root}/l0")
    o.symlink("f1", f"{root}/d0/l1")
    h = History(o, root, rig.window, workload)
    h._version = iter(range(2000, 1 << 30))
    actors: list[tuple[str, NativeFS]] = [(f"n{i}", NativeFS(c, root)) for i, c in enumerate(rig.clients)]
    actors += [(f"m{i}", MountFS(mp, root)) for i, mp in enumerate(rig.mounts)]
    deadline = time.monotonic() + duration
    threads = [threading.Thread(target=h.run_actor, args=(name, fs, random.Random(f"{seed}:{name}"), deadline),
                                name=f"coherence-{name}", daemon=True) for name, fs in actors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + 120)
    return h


def summary(h: History, violations: list[Violation]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in h.records:
        key = f"{'mount' if r.mount else 'native'}.{r.op}{'' if r.result[:1] != ('err',) else '.err'}"
        counts[key] = counts.get(key, 0) + 1
    return {"operations": len(h.records), "mutations": len(h.mutations) - 1, "by_op": dict(sorted(counts.items())),
            "violations": len(violations), "crashes": list(h.crashes)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.fsclient.testing.coherence",
                                description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of operations")
    p.add_argument("--ttl", type=float, default=1.0, help="the service's lease TTL (seconds)")
    p.add_argument("--mount-timeout", type=float, default=0.5, help="the mounts' attr_timeout and entry_timeout")
    p.add_argument("--slack", type=float, default=0.5, help="added to the mounts' window (request latency)")
    p.add_argument("--no-mounts", action="store_true", help="native clients only (no FUSE here)")
    p.add_argument("--metadata-store", choices=("sqlite", "postgresql"), default="sqlite")
    p.add_argument("--metadata-services", type=int, default=1, help="more than one needs postgresql")
    p.add_argument("--history", help="write every record here (JSON lines)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stripefs-coherence-") as work, \
            Rig(work, lease_ttl=a.ttl, mount_timeout=a.mount_timeout, slack=a.slack,
                mounts=0 if a.no_mounts else 2, store=a.metadata_store, services=a.metadata_services) as rig:
        h = run_history(rig, a.seed, a.duration)
        violations = check(h)
    if a.history:
        with open(a.history, "w") as f:
            f.writelines(r.to_json() + "\n" for r in h.records)
    print(json.dumps(summary(h, violations), indent=1))
    for v in violations[:30]:
        print("VIOLATION", v)
    return 1 if violations or h.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
