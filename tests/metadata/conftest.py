"""Stores for the namespace tests: every backend, PostgreSQL included (a private server)."""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

from stripefs.fsclient.testing import LocalPostgres, postgres_bin
from stripefs.metadata import Namespace
from stripefs.metadata._memstore import MemoryStore
from stripefs.metadata._membership import Membership
from stripefs.metadata._service import MetadataService
from stripefs.metadata._sqlite import SqliteStore
from stripefs.metadata._store import Store

STORES = ["sqlite", "memory", "postgresql"]
_schemas = itertools.count()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """One private PostgreSQL server for the session (initdb + pg_ctl on 127.0.0.1)."""
    if postgres_bin("initdb") is None:
        pytest.skip("PostgreSQL server binaries are not installed (apt-get install postgresql)")
    pg = LocalPostgres(tempfile.mkdtemp(prefix="stripefs-pgtest-"))
    url = pg.start()
    pg.ensure_database()
    yield url
    pg.destroy()


def make_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Store:
    if kind == "sqlite":
        return SqliteStore(tmp_path / "meta.db")
    if kind == "memory":
        return MemoryStore()
    import psycopg

    from stripefs.metadata._pgstore import PostgresStore

    url = request.getfixturevalue("pg_url")
    schema = f"t{os.getpid()}_{next(_schemas)}"  # a fresh namespace per test, cheaper than a database
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    request.addfinalizer(lambda: _drop_schema(url, schema))
    return PostgresStore(f"{url}?options=-csearch_path%3D{schema}")


def _drop_schema(url: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s = make_store(request.param, tmp_path, request)
    yield s
    s.close()


def sqlite_service(tmp_path: Path, sync: str = "full", sync_log: Callable[[SqliteStore], None] | None = None,
                   ) -> tuple[MetadataService, SqliteStore]:
    """A metadata service in this process on a fresh SQLite store (the caller runs its
    ``commit.run`` and closes the store), with one directory ``/d`` made already: the
    first number handed out moves the counters' reserve (a durable commit), so the
    commits a test watches are ordinary ones. ``sync_log`` replaces the store's log
    fsync (a test's gate or fault)."""
    store = SqliteStore(tmp_path / "meta.db", synchronous=sync)
    if sync_log is not None:
        store.sync_log = lambda: sync_log(store)  # type: ignore[method-assign]
    ns = Namespace(store)
    ns.mkdir(1, "d", 0o755, 0, 0)
    return MetadataService(ns, lambda doc, restarted: Membership(None, doc=doc, restarted=restarted), "secret",
                           sync=sync), store
