"""What one namespace operation costs on PostgreSQL, and the shortcuts that make it cheap
staying correct (issue 35).

A mutation runs as the metadata service's writer runs it (``_run_batch``: a batch of its
own, ``apply_once`` recording its result). Counted on the writer connection: the
statements sent and the waits for their answers (round trips). Then what the shortcuts
must not change:

* the result record's check is sent without waiting for it (taken as "not applied yet"):
  a request applied already is still answered from its record, never applied twice --
  even where applying it again would fail (``O_EXCL`` on the name it made);
* writes held back and sent as one statement: two writes to one row still happen in order;
* statements prepared on the server stay usable after rollbacks (an operation undone to
  its savepoint; a batch whose statement failed, run again statement by statement).

Skipped when the PostgreSQL server binaries are missing (``pg_url``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections import Counter
from typing import Any, Callable, Iterator

import pytest

from stripefs.metadata import Namespace
from stripefs.metadata._replay import apply_once
from stripefs.metadata._store import GarbageItem
from stripefs.wire import ErrorCode, StripefsError
from stripefs.wire._types import DirEntry, Layout

CHAINS = [1, 2, 3]
_schemas = itertools.count()


@pytest.fixture
def pg_store(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A PostgresStore on a fresh schema of the session's PostgreSQL."""
    import psycopg

    from stripefs.metadata._pgstore import PostgresStore

    url = request.getfixturevalue("pg_url")
    schema = f"rt{os.getpid()}_{next(_schemas)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    store = PostgresStore(f"{url}?options=-csearch_path%3D{schema}")
    yield store
    store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Statements executed and waits for answers, on every psycopg connection from now on."""
    import psycopg
    from psycopg import _pipeline_base

    counts: Counter[str] = Counter()
    execute = psycopg.Cursor.execute
    fetch = _pipeline_base.BasePipeline._fetch_gen

    def counting_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["statements"] += 1
        return execute(self, *args, **kwargs)

    def counting_fetch(self: Any, *, flush: bool) -> Any:
        if self.result_queue:  # answers outstanding: this waits for them
            counts["waits"] += 1
        return (yield from fetch(self, flush=flush))

    monkeypatch.setattr(psycopg.Cursor, "execute", counting_execute)
    monkeypatch.setattr(_pipeline_base.BasePipeline, "_fetch_gen", counting_fetch)
    return counts


_requests = itertools.count(1)


def _mutate(store: Any, fn: Callable[[], Any], req: int | None = None) -> Any:
    """``fn`` as the service's writer runs a request's mutation (``CommitPath._run_batch``):
    alone in a batch, once; its failure its own; the batch run again when it must be."""
    key = (b"client-1", next(_requests) if req is None else req)
    return _batch(store, [lambda: apply_once(store, key, fn)])[0]


def _batch(store: Any, ops: list[Callable[[], Any]]) -> list[Any]:
    """Results of ``ops`` run in one batch as ``CommitPath._run_batch`` runs them (raised
    when it is an error)."""
    for _ in range(4):
        out: list[Any] = []
        try:
            with store.batch():
                for op in ops:
                    try:
                        out.append(op())
                    except StripefsError as exc:
                        out.append(exc)
        except Exception as exc:  # noqa: BLE001
            if store.retryable(exc):
                continue
            raise
        for result in out:
            if isinstance(result, StripefsError):
                raise result
        return out
    raise AssertionError("the batch never committed")


def test_a_create_an_unlink_and_a_rename_wait_twice_each_a_stat_reads_four_times(pg_store: Any, counted: Counter[str]) -> None:
    ns = Namespace(pg_store)
    d = ns.mkdir(1, "d", 0o755, 0, 0).ino
    pg_store.publish_keys(lambda number, groups, barrier: ["keys"])  # as a service sharing the store does
    # A block of inode numbers and one of garbage ids taken (one round trip per 64).
    _mutate(pg_store, functools.partial(ns.create, d, "gone", 0o644, 0, 0, chains=CHAINS))
    _mutate(pg_store, functools.partial(ns.unlink, d, "gone"))
    _mutate(pg_store, functools.partial(ns.create, d, "warm", 0o644, 0, 0, chains=CHAINS))

    cost: dict[str, Counter[str]] = {}
    for op, fn in [("create", functools.partial(ns.create, d, "f", 0o644, 0, 0, chains=CHAINS, exclusive=True)),
                   ("rename", functools.partial(ns.rename, d, "f", d, "g")),
                   ("unlink", functools.partial(ns.unlink, d, "g"))]:
        counted.clear()
        _mutate(pg_store, fn)
        cost[op] = Counter(counted)
    # create: BEGIN, the result record, the directory (locked) and its dirs row, the name
    # [wait]; the inode, entry, directory's times, result record and keys in one statement;
    # COMMIT [wait]
    assert cost["create"] == Counter(statements=7, waits=2), cost
    assert cost["unlink"] == Counter(statements=8, waits=2), cost
    assert cost["rename"] == Counter(statements=10, waits=2), cost
    # A stat on a read connection (not pipelined: each statement a round trip): BEGIN, the
    # directory's entry, the file's entry with its inode, COMMIT.
    reads, warm = ns.reading(pg_store.reader()), ns.lookup(d, "warm")
    counted.clear()
    assert reads.resolve("/d/warm") == warm
    assert counted["statements"] == 4, counted
    assert ns.readdir(d) and [e.name for e in ns.readdir(d)[0]] == ["warm"]


def test_a_request_applied_already_is_answered_from_its_record_not_applied_again(pg_store: Any) -> None:
    ns = Namespace(pg_store)
    d = ns.mkdir(1, "d", 0o755, 0, 0).ino
    create = functools.partial(ns.create, d, "once", 0o644, 0, 0, chains=CHAINS, exclusive=True)
    first, created = _mutate(pg_store, create, req=7)
    assert created
    # The retry (say, through another service): O_EXCL would now fail with EEXIST, and a
    # second application would make a second file; the record answers it instead.
    again = _mutate(pg_store, create, req=7)
    assert again == (first, True)
    assert [e.name for e in ns.readdir(d)[0]] == ["once"]
    # The same inside a batch with other work, the record found by its unchecked read.
    other, retried = _batch(pg_store, [
        lambda: apply_once(pg_store, (b"client-1", 8), functools.partial(ns.create, d, "other", 0o644, 0, 0,
                                                                         chains=CHAINS)),
        lambda: apply_once(pg_store, (b"client-1", 7), create)])
    assert retried == (first, True) and other[1]
    # Applied again first in its batch (opening the file it made, no O_EXCL), its record
    # written again clashes with the one there when the next operation reads: still the
    # record's answer, not a batch that fails the same way every time it runs again.
    reopen = functools.partial(ns.create, d, "once", 0o644, 0, 0, chains=CHAINS)
    retried, third = _batch(pg_store, [
        lambda: apply_once(pg_store, (b"client-1", 7), reopen),
        lambda: apply_once(pg_store, (b"client-1", 10), functools.partial(ns.create, d, "third", 0o644, 0, 0,
                                                                          chains=CHAINS))])
    assert retried == (first, True) and third[1]
    # A request not applied yet is applied, and its failure is its own.
    with pytest.raises(StripefsError) as err:
        _mutate(pg_store, create, req=9)
    assert err.value.code == ErrorCode.EXISTS
    assert [e.name for e in ns.readdir(d)[0]] == ["once", "other", "third"]


def test_writes_to_one_row_sent_together_land_in_order(pg_store: Any) -> None:
    ns = Namespace(pg_store)
    d = ns.mkdir(1, "d", 0o755, 0, 0).ino
    attr, _ = ns.create(d, "f", 0o644, 0, 0, chains=CHAINS)

    def rewrite() -> None:  # several writes of one operation, none read back in between
        with pg_store.transaction() as txn:
            txn.put_inode(dataclasses.replace(attr, size=1))
            txn.put_inode(dataclasses.replace(attr, size=2))
            txn.delete_dentry(d, "f")
            txn.put_dentry(d, DirEntry("f", attr.ino, attr.mode))
            txn.put_inode(dataclasses.replace(attr, size=3))

    with pg_store.batch():
        rewrite()
    assert ns.getattr(attr.ino).size == 3
    assert [(e.name, e.ino) for e in ns.readdir(d)[0]] == [("f", attr.ino)]


def test_prepared_statements_outlive_rollbacks(pg_store: Any) -> None:
    from stripefs.metadata._pgstore import _Unattributed

    ns = Namespace(pg_store)
    d = ns.mkdir(1, "d", 0o755, 0, 0).ino
    for i in range(3):
        _mutate(pg_store, functools.partial(ns.create, d, f"a{i}", 0o644, 0, 0, chains=CHAINS))

    def fails_after_writing() -> None:
        with pg_store.transaction() as txn:
            txn.get_inode(d)  # (a read: its writes go out under a savepoint)
            txn.put_meta("x", "1")
            txn.get_meta("x")
            raise StripefsError(ErrorCode.INVALID, "undone")

    # An operation undone to its savepoint, between operations that use prepared statements.
    with pg_store.batch():
        ns.create(d, "b0", 0o644, 0, 0, chains=CHAINS)
        with pytest.raises(StripefsError):
            fails_after_writing()
        ns.create(d, "b1", 0o644, 0, 0, chains=CHAINS)
    # A batch whose statement fails (pipelined: not known whose), then run again.
    with pytest.raises(_Unattributed):
        with pg_store.batch():
            ns.create(d, "c0", 0o644, 0, 0, chains=CHAINS)
            with pg_store.transaction() as txn:
                item = GarbageItem(10**9, "remove", 10**9, 0, Layout(1 << 20, (1,)))
                txn.put_garbage(item)
                txn.put_garbage(item)  # the same id twice: the batch fails
            ns.create(d, "c1", 0o644, 0, 0, chains=CHAINS)
    for i in range(3):
        _mutate(pg_store, functools.partial(ns.create, d, f"e{i}", 0o644, 0, 0, chains=CHAINS))
        _mutate(pg_store, functools.partial(ns.unlink, d, f"e{i}"))
    assert [e.name for e in ns.readdir(d)[0]] == ["a0", "a1", "a2", "b0", "b1"]
    with pg_store.transaction() as txn:
        assert txn.get_meta("x") is None
    prepared = pg_store._conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0]
    assert prepared >= 5  # the hot statements are prepared, and were not dropped by the rollbacks
