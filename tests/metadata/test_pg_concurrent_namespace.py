"""Several writers on one PostgreSQL namespace at once (issue 35): the invariants that
SERIALIZABLE used to keep, kept by row locks at READ COMMITTED.

Each worker is a store of its own (its own connection, as a metadata service has) on
its own thread, running its operations in batches the way the service's writer does
(group commit: each operation in a savepoint, a batch that lost a race run again).
They create, rename, link and unlink files in a private directory and in directories
they all share, race to create the same names, move directories between the shared
ones, and try to move two directories into each other at the same moment. Afterwards
one fresh connection checks the whole namespace: every entry names an inode, every
inode is named (none lost), a directory has exactly one name and its ``dirs`` row
agrees, link counts are right for files and directories, no directory is inside
itself, and each worker's own files are exactly where its committed operations left
them. Skipped when the PostgreSQL server binaries are missing (``pg_url``).
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import stat
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator

import pytest

from stripefs.metadata import Namespace
from stripefs.wire import StripefsError

WORKERS = 4
ROUNDS = 14
CHAINS = [1, 2, 3]
_schemas = itertools.count()


@pytest.fixture
def pg_ns_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh schema on the session's PostgreSQL; deadlocks (crossed directory moves) broken fast."""
    import psycopg

    url = request.getfixturevalue("pg_url")
    schema = f"cc{os.getpid()}_{next(_schemas)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    yield f"{url}?options=-csearch_path%3D{schema}%20-cdeadlock_timeout%3D100ms"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def _run_batch(store: Any, ops: list[Callable[[], Any]], stats: Counter[str]) -> list[Any]:
    """As ``CommitPath._run_batch``: one transaction, each op failing alone, a lost race rerun.
    Returns each op's result or its StripefsError, once the batch committed."""
    for attempt in range(40):
        out: list[Any] = []
        try:
            with store.batch():
                for op in ops:
                    try:
                        out.append(op())
                    except StripefsError as exc:
                        out.append(exc)
            stats["batches"] += 1
            return out
        except Exception as exc:  # noqa: BLE001 - a lost race: everything again
            if not store.retryable(exc):
                raise
            stats["reruns"] += 1
            time.sleep(random.uniform(0, 0.002 * min(2 ** attempt, 16)))
    raise AssertionError("a batch lost 40 races in a row")


class _Worker:
    """One writer: its own store, its files by inode number -> {(parent, name)} it expects."""

    def __init__(self, w: int, url: str, dirs: dict[str, int], barrier: threading.Barrier):
        from stripefs.metadata._pgstore import PostgresStore

        self.w, self.dirs, self.barrier = w, dirs, barrier
        self.store = PostgresStore(url)
        self.ns = Namespace(self.store)
        self.rng = random.Random(w)
        self.files: dict[int, set[tuple[int, str]]] = {}  # ino -> its names (only this worker changes them)
        self.subdirs: dict[int, tuple[int, str]] = {}  # ino -> (parent, name), moved only by this worker
        self.races: list[str] = []  # names of the shared race this worker won
        self.cycle_moves: list[tuple[str, bool]] = []
        self.stats: Counter[str] = Counter()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for r in range(ROUNDS):
                self.barrier.wait(timeout=60)  # every round starts together: the most contention
                self.round(r)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.barrier.abort()
        finally:
            self.store.close()

    def _name(self, r: int, j: int) -> str:
        return f"w{self.w}r{r}n{j}"

    def round(self, r: int) -> None:
        ns, d, w = self.ns, self.dirs, self.w
        shared = [d["s0"], d["s1"]]
        ops: list[Callable[[], Any]] = []
        post: list[Callable[[Any], None]] = []

        def add(op: Callable[[], Any], then: Callable[[Any], None]) -> None:
            ops.append(op)
            post.append(then)

        def created(parent: int, name: str) -> Callable[[Any], None]:
            def then(res: Any) -> None:
                assert not isinstance(res, StripefsError), res
                self.files[res[0].ino] = {(parent, name)}
            return then

        # new files: one private, two shared (the shared directory alternates per worker and round)
        for j, parent in enumerate((d[f"p{w}"], shared[(r + w) % 2], shared[(r + w + 1) % 2])):
            name = self._name(r, j)
            add(lambda p=parent, n=name: ns.create(p, n, 0o644, 0, 0, chains=CHAINS, exclusive=True),
                created(parent, name))
        # everyone races for the same name: one wins
        race = f"race{r}"
        add(lambda: ns.create(d["s0"], race, 0o644, 0, 0, chains=CHAINS, exclusive=True),
            lambda res: None if isinstance(res, StripefsError) and res.errno == errno.EEXIST
            else (self.races.append(race), self.files.__setitem__(res[0].ino, {(d["s0"], race)})))
        owned = sorted(self.files)
        busy: set[int] = set()

        def pick() -> int | None:
            free = [i for i in owned if i not in busy]
            if not free:
                return None
            ino = self.rng.choice(free)
            busy.add(ino)
            return ino

        # rename one of its files, to the other shared directory or within the private one
        ino = pick()
        if ino is not None:
            old = sorted(self.files[ino])[0]
            new = (shared[r % 2], self._name(r, 10)) if r % 2 else (d[f"p{w}"], self._name(r, 11))

            def moved(res: Any, ino: int = ino, old: tuple[int, str] = old, new: tuple[int, str] = new) -> None:
                assert not isinstance(res, StripefsError), res
                self.files[ino] = (self.files[ino] - {old}) | {new}
            add(lambda o=old, n=new: ns.rename(o[0], o[1], n[0], n[1]), moved)
        # a hard link into a shared directory
        ino = pick()
        if ino is not None and r % 3 != 2:
            new = (shared[(r + 1) % 2], self._name(r, 12))

            def linked(res: Any, ino: int = ino, new: tuple[int, str] = new) -> None:
                assert not isinstance(res, StripefsError), res
                self.files[ino].add(new)
            add(lambda i=ino, n=new: ns.link(i, n[0], n[1]), linked)
        # unlink one name of a file
        ino = pick()
        if ino is not None and r % 2 == 0:
            name = sorted(self.files[ino])[0]

            def unlinked(res: Any, ino: int = ino, name: tuple[int, str] = name) -> None:
                assert not isinstance(res, StripefsError), res
                self.files[ino].discard(name)
                if not self.files[ino]:
                    del self.files[ino]
            add(lambda n=name: ns.unlink(n[0], n[1]), unlinked)
        # a directory of its own, made in one shared directory, later moved to the other,
        # with a file made inside it while it moves about
        if r == 1:
            name = f"dir{w}"
            add(lambda: ns.mkdir(d["s0"], name, 0o755, 0, 0),
                lambda res: self.subdirs.__setitem__(res.ino, (d["s0"], name)))
        elif self.subdirs:
            sub, (parent, name) = next(iter(self.subdirs.items()))
            target = shared[1] if parent == shared[0] else shared[0]
            add(lambda p=parent, n=name, t=target: ns.rename(p, n, t, n),
                lambda res, sub=sub, t=target, n=name: self.subdirs.__setitem__(sub, (t, n)))
            fname = self._name(r, 13)
            add(lambda s=sub, f=fname: ns.create(s, f, 0o644, 0, 0, chains=CHAINS, exclusive=True),
                created(sub, fname))
        # two workers move two directories into each other at once: one move at most may win
        if w < 2 and r % 4 == 3:
            k = r // 4
            a, b = (d[f"x{k}"], d[f"y{k}"]) if w == 0 else (d[f"y{k}"], d[f"x{k}"])
            names = {d[f"x{k}"]: f"x{k}", d[f"y{k}"]: f"y{k}"}
            add(lambda a=a, b=b: ns.rename(d["s1"], names[a], b, names[a]),
                lambda res, a=a: self.cycle_moves.append((names[a], not isinstance(res, StripefsError))))
        self.rng.shuffle(order := list(range(len(ops))))
        results = _run_batch(self.store, [ops[i] for i in order], self.stats)
        for i, res in zip(order, results):
            post[i](res)


def _check_namespace(url: str) -> dict[int, Any]:
    """Read every table once and check the namespace's invariants; returns the inodes."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        inodes = {row[0]: row for row in conn.execute("SELECT ino, ftype, nlink FROM inodes")}
        dentries = [(p, bytes(n).decode(), i, m) for p, n, i, m in
                    conn.execute("SELECT parent, name, ino, mode FROM dentries")]
        dirs = dict(conn.execute("SELECT ino, parent FROM dirs").fetchall())
    names = Counter(i for _, _, i, _ in dentries)
    subdirs = Counter(p for p, _, i, m in dentries if stat.S_ISDIR(m))
    for parent, name, ino, mode in dentries:
        assert ino in inodes, f"{name!r} in {parent} names inode {ino}, which is gone"
        assert parent in inodes and stat.S_ISDIR(inodes[parent][1]), f"{name!r} is in {parent}, not a directory"
        assert stat.S_IFMT(mode) == inodes[ino][1], f"{name!r}: entry type {mode:o} but inode {inodes[ino][1]:o}"
    for ino, ftype, nlink in inodes.values():
        if ino == 1:
            assert names[ino] == 0
        else:
            assert names[ino] >= 1, f"inode {ino} is named by no entry (lost)"
        if stat.S_ISDIR(ftype):
            assert ino == 1 or names[ino] == 1, f"directory {ino} has {names[ino]} names"
            assert nlink == 2 + subdirs[ino], f"directory {ino}: nlink {nlink}, {subdirs[ino]} subdirectories"
            assert ino in dirs, f"directory {ino} has no dirs row"
        else:
            assert nlink == names[ino], f"inode {ino}: nlink {nlink} but {names[ino]} names"
    by_dir = {i: p for p, _, i, m in dentries if stat.S_ISDIR(m)}
    assert set(dirs) == set(by_dir) | {1}, "dirs rows without directories, or the reverse"
    for ino, parent in by_dir.items():
        assert dirs[ino] == parent, f"directory {ino}: dirs row says parent {dirs[ino]}, its entry is in {parent}"
        seen, up = set(), ino
        while up != 1:  # every directory reaches the root: no cycle
            assert up not in seen, f"directory {ino} is inside itself"
            seen.add(up)
            up = dirs[up]
    return inodes


def test_concurrent_writers_keep_the_namespace_whole(pg_ns_url: str) -> None:
    from stripefs.metadata._pgstore import PostgresStore

    started = time.monotonic()
    store = PostgresStore(pg_ns_url)
    ns = Namespace(store)
    dirs = {name: ns.mkdir(1, name, 0o755, 0, 0).ino for name in ("s0", "s1")}
    dirs.update({f"p{w}": ns.mkdir(1, f"p{w}", 0o755, 0, 0).ino for w in range(WORKERS)})
    for k in range(ROUNDS // 4 + 1):
        for prefix in ("x", "y"):
            dirs[f"{prefix}{k}"] = ns.mkdir(dirs["s1"], f"{prefix}{k}", 0o755, 0, 0).ino
    store.close()

    barrier = threading.Barrier(WORKERS)
    workers = [_Worker(w, pg_ns_url, dirs, barrier) for w in range(WORKERS)]
    threads = [threading.Thread(target=wk.run, name=f"writer-{wk.w}") for wk in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for wk in workers:
        if wk.error is not None and not isinstance(wk.error, threading.BrokenBarrierError):
            raise wk.error
    assert all(wk.error is None for wk in workers)

    inodes = _check_namespace(pg_ns_url)
    store = PostgresStore(pg_ns_url)
    check = Namespace(store)
    try:
        # each worker's files are exactly where its committed operations put them
        for wk in workers:
            for ino, names in wk.files.items():
                assert ino in inodes, f"worker {wk.w}: inode {ino} lost"
                for parent, name in names:
                    assert check.lookup(parent, name).ino == ino
                assert check.getattr(ino).nlink == len(names)
            for ino, (parent, name) in wk.subdirs.items():
                assert check.lookup(parent, name).ino == ino
        # each race had exactly one winner
        won = Counter(race for wk in workers for race in wk.races)
        assert set(won) == {f"race{r}" for r in range(ROUNDS)} and set(won.values()) == {1}, won
        # crossed directory moves: never both
        for k in range(ROUNDS // 4 + 1):
            wins = [ok for wk in workers for name, ok in wk.cycle_moves if name in (f"x{k}", f"y{k}")]
            assert sum(wins) <= 1, (k, wins)
        # every entry the workers expect is there, and nothing else in their directories
        expected = Counter(p for wk in workers for names in wk.files.values() for p, _ in names)
        for wk in workers:
            for parent, _ in wk.subdirs.values():
                expected[parent] += 1
        for key in ("s0", "s1") + tuple(f"p{w}" for w in range(WORKERS)):
            listed, _ = check.readdir(dirs[key])
            theirs = [e for e in listed if not (key == "s1" and e.name[:1] in "xy" and e.name[1:].isdigit())]
            assert len(theirs) == expected[dirs[key]], (key, len(theirs), expected[dirs[key]])
    finally:
        store.close()
    stats = sum((wk.stats for wk in workers), Counter())
    print(f"{stats['batches']} batches, {stats['reruns']} reruns, {time.monotonic() - started:.1f} s")
    assert time.monotonic() - started < 60
