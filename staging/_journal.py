"""The mover's durable journal: SQLite in the staging directory, and per-checkpoint locks.

States of a checkpoint::

    writing ──> staged ──> committed
       │          │
       └─> abandoned      failed   (checksum mismatch, conflict: never retried)

    streaming ──> committed          (keep_local=0: no local copy)
       └─> abandoned / failed

``writing``: the trainer is serializing it; its lock is held. A ``writing``
row whose lock is free means the writer died before the copy was locally
durable: the mover abandons it and removes the remains. ``staged``: every
local file and the local manifest are fsynced; ``file.done`` is the upload's
durable offset per file. Whoever holds the checkpoint's ``flock``
(``locks/<id>.lock``) may upload it — the trainer's own thread or a standalone
mover; the kernel drops the lock when the holder is killed, so a ``kill -9``
never leaves a checkpoint stuck.

``streaming``: a ``keep_local=0`` save uploading straight from the trainer's
memory; ``file.done`` lets a retry in the same process resume, but nothing on
disk can: if the trainer dies before the commit, the step is lost, and a
mover that finds the lock free abandons it (naming ``keep_local=0`` in its
error) after removing the partial upload.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from . import _stats

__all__ = ["Journal", "CkptRow", "FileRow", "CkptLock", "fault_point"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ckpt (
    id TEXT PRIMARY KEY, url TEXT NOT NULL, cluster TEXT, local_dir TEXT NOT NULL, state TEXT NOT NULL,
    step INTEGER, pinned INTEGER NOT NULL DEFAULT 0, keep_local INTEGER, keep_remote INTEGER,
    created REAL NOT NULL, committed REAL, error TEXT, attempts INTEGER NOT NULL DEFAULT 0,
    kind TEXT NOT NULL DEFAULT 'state_dict', durability TEXT
);
CREATE TABLE IF NOT EXISTS file (
    ckpt TEXT NOT NULL, name TEXT NOT NULL, size INTEGER NOT NULL, crc INTEGER NOT NULL,
    chunk INTEGER NOT NULL, chunk_crcs TEXT NOT NULL, done INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (ckpt, name)
);
"""

# Named, never SELECT *: what a row reads does not depend on how the table grew (ALTER TABLE).
_COLUMNS = ("id, url, cluster, local_dir, state, step, pinned, keep_local, keep_remote, created, committed, error, "
            "attempts, kind, durability")


def fault_point(name: str) -> None:
    """Test hook: ``STRIPEFS_STAGING_KILL_AT=name[:n]`` SIGKILLs this process at the n-th hit.

    ``STRIPEFS_STAGING_TRACE=FILE`` appends every point passed to FILE, one name a line, so a
    kill sweep can enumerate the points (and hit counts) of a run instead of guessing them.
    Kill tests use these to stop a trainer or mover at an exact step; unset, each costs a dict lookup.

    ``STRIPEFS_STAGING_FAIL_AT=name[,name...]`` raises a transient ``ConnectionError`` at every hit of
    those points while it is set, instead of killing: an upload that fails its retries (and is left
    ``staged`` for a later mover pass) without any fault in the store.
    """
    trace = os.environ.get("STRIPEFS_STAGING_TRACE")
    if trace:
        with open(trace, "a") as f:  # O_APPEND: threads and processes never interleave a line
            f.write(name + "\n")
    fail = os.environ.get("STRIPEFS_STAGING_FAIL_AT")
    if fail and name in fail.split(","):
        raise ConnectionError(f"injected transient failure at {name} (STRIPEFS_STAGING_FAIL_AT)")
    spec = os.environ.get("STRIPEFS_STAGING_KILL_AT")
    if not spec:
        return
    want, _, count = spec.partition(":")
    if want != name:
        return
    n = _hits.get(name, 0) + 1
    _hits[name] = n
    if n >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)


_hits: dict[str, int] = {}


@dataclass
class FileRow:
    name: str
    size: int
    crc: int
    chunk: int
    chunk_crcs: list[int]
    done: int


@dataclass
class CkptRow:
    id: str
    url: str
    cluster: str | None
    local_dir: str
    state: str
    step: int | None
    pinned: bool
    keep_local: int | None
    keep_remote: int | None
    created: float
    committed: float | None
    error: str | None
    attempts: int
    kind: str
    durability: str | None = None  # JSON of a _replicas.Durability, set at the commit


def _wal(db: sqlite3.Connection) -> None:
    """Put the journal in WAL mode (once per file: it stays so). Ranks of one node sharing a
    staging directory open it at the same moment, and switching the mode takes a lock that
    SQLite's busy timeout does not wait for ("database is locked"): those that lose retry."""
    deadline = time.monotonic() + 30.0
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class CkptLock:
    """Exclusive ``flock`` on one checkpoint; released on close or when the process dies."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Journal:
    """SQLite journal of one staging directory; safe to share between threads and processes."""

    def __init__(self, staging_dir: str):
        self.dir = os.path.abspath(staging_dir)
        for sub in ("steps", "locks"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        self.path = os.path.join(self.dir, "journal.sqlite")
        self._local = threading.local()
        self._db().executescript(_SCHEMA)  # idempotent; executescript manages its own transaction
        self._migrate()
        _stats.watch(self)

    def _migrate(self) -> None:
        """Columns added since a journal was created (a staging directory outlives upgrades)."""
        db = self._db()
        have = {r[1] for r in db.execute("PRAGMA table_info(ckpt)").fetchall()}
        if "durability" not in have:
            try:
                db.execute("ALTER TABLE ckpt ADD COLUMN durability TEXT")
            except sqlite3.OperationalError as exc:  # another process added it first
                if "duplicate column" not in str(exc):
                    raise

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None or getattr(self._local, "pid", None) != os.getpid():
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            _wal(db)
            db.execute("PRAGMA synchronous=FULL")  # a recorded upload offset must survive power loss
            self._local.db, self._local.pid = db, os.getpid()
        return db

    def _tx(self) -> "_Tx":
        return _Tx(self._db())

    def lock(self, ckpt_id: str) -> CkptLock:
        return CkptLock(os.path.join(self.dir, "locks", f"{ckpt_id}.lock"))

    def step_dir(self, ckpt_id: str) -> str:
        return os.path.join(self.dir, "steps", ckpt_id)

    # -- writes ---------------------------------------------------------------------------
    def begin(self, row: CkptRow, files: list[FileRow]) -> None:
        with self._tx() as db:
            db.execute(f"INSERT INTO ckpt ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", (
                row.id, row.url, row.cluster, row.local_dir, row.state, row.step, int(row.pinned),
                row.keep_local, row.keep_remote, row.created, row.committed, row.error, row.attempts, row.kind,
                row.durability))
            db.executemany("INSERT INTO file VALUES (?,?,?,?,?,?,?)", [
                (row.id, f.name, f.size, f.crc, f.chunk, json.dumps(f.chunk_crcs), f.done) for f in files])

    def add_files(self, ckpt_id: str, files: list[FileRow]) -> None:
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO file VALUES (?,?,?,?,?,?,?)", [
                (ckpt_id, f.name, f.size, f.crc, f.chunk, json.dumps(f.chunk_crcs), f.done) for f in files])

    def set_state(self, ckpt_id: str, state: str, error: str | None = None, durability: str | None = None) -> None:
        """``durability``: what the commit was durable on (JSON, see ``_replicas``), for ``committed``."""
        with self._tx() as db:
            committed = time.time() if state == "committed" else None
            db.execute("UPDATE ckpt SET state=?, error=?, committed=COALESCE(?, committed), "
                       "durability=COALESCE(?, durability) WHERE id=?", (state, error, committed, durability, ckpt_id))
        _stats.count_end(state, durability)

    def note_error(self, ckpt_id: str, error: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE ckpt SET error=?, attempts=attempts+1 WHERE id=?", (error, ckpt_id))

    def progress(self, ckpt_id: str, name: str, done: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE file SET done=? WHERE ckpt=? AND name=?", (done, ckpt_id, name))

    def reset_progress(self, ckpt_id: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE file SET done=0 WHERE ckpt=?", (ckpt_id,))

    def set_pinned(self, ckpt_id: str, pinned: bool) -> None:
        with self._tx() as db:
            db.execute("UPDATE ckpt SET pinned=? WHERE id=?", (int(pinned), ckpt_id))

    def delete(self, ckpt_id: str) -> None:
        """Forget a checkpoint nobody works on any more (committed and trimmed, or abandoned),
        its lock file too: one inode per checkpoint would otherwise stay forever."""
        with self._tx() as db:
            db.execute("DELETE FROM file WHERE ckpt=?", (ckpt_id,))
            db.execute("DELETE FROM ckpt WHERE id=?", (ckpt_id,))
        try:
            os.unlink(self.lock(ckpt_id).path)
        except FileNotFoundError:
            pass

    # -- reads ----------------------------------------------------------------------------
    def get(self, ckpt_id: str) -> CkptRow | None:
        rows = list(self._rows("WHERE id=?", (ckpt_id,)))
        return rows[0] if rows else None

    def checkpoints(self, where: str = "", args: tuple[Any, ...] = ()) -> list[CkptRow]:
        return list(self._rows(where + " ORDER BY created, id", args))

    def files(self, ckpt_id: str) -> list[FileRow]:
        cur = self._db().execute("SELECT name,size,crc,chunk,chunk_crcs,done FROM file WHERE ckpt=? ORDER BY name",
                                 (ckpt_id,))
        return [FileRow(n, s, c, ch, json.loads(cc), d) for n, s, c, ch, cc, d in cur.fetchall()]

    def _rows(self, where: str, args: tuple[Any, ...]) -> Iterator[CkptRow]:
        cur = self._db().execute(f"SELECT {_COLUMNS} FROM ckpt {where}", args)
        for r in cur.fetchall():
            yield CkptRow(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), r[7], r[8], r[9], r[10], r[11], r[12], r[13],
                          r[14])


class _Tx:
    """``BEGIN IMMEDIATE`` … ``COMMIT``: one writer at a time across processes."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
