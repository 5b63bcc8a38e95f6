"""A private PostgreSQL cluster on 127.0.0.1 for ``stripefs up --metadata-store postgresql``.

``initdb`` and ``pg_ctl`` from the machine's PostgreSQL (Debian: ``postgresql``),
password authentication (SCRAM) with a random password kept in a 0600 state file,
TCP on 127.0.0.1 only (no Unix socket), fsync on. Started and stopped by the
local-cluster launcher (``fsclient.testing``); the metadata service only sees a URL.

PostgreSQL refuses to run as root. As root the cluster runs as the ``postgres``
user; its data directory is ``ROOT/postgres`` when that user can reach it, and
otherwise ``/var/tmp/stripefs-postgres/<hash of ROOT>`` (recorded in the state
file, so ``stripefs up`` on the same ROOT finds it again).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from typing import Any

from stripefs.wire import ErrorCode, StripefsError

__all__ = ["LocalPostgres", "port_is_free", "postgres_bin"]

DB_USER, DB_NAME = "stripefs", "stripefs"


def postgres_bin(tool: str) -> str | None:
    """Path of a PostgreSQL server tool (``initdb``, ``pg_ctl``), newest version first."""
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True):
        if os.access(os.path.join(d, tool), os.X_OK):
            return os.path.join(d, tool)
    return shutil.which(tool)


def _reachable_by(path: str, uid: int, gid: int) -> bool:
    """Can ``uid`` traverse every directory above ``path``? (A cheap check of x bits.)"""
    d = os.path.abspath(path)
    while True:
        d = os.path.dirname(d)
        st = os.stat(d)
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            return False
        if d == "/":
            return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPostgres:
    """The PostgreSQL cluster of the stripefs cluster under ``root``.

    Args:
        root: the stripefs cluster directory; state goes to ``root/postgres.json``.
    """

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.state_file = os.path.join(self.root, "postgres.json")

    # -- state ----------------------------------------------------------------------------
    def _state(self) -> dict[str, Any] | None:
        try:
            with open(self.state_file) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def _save(self, state: dict[str, Any]) -> None:
        tmp = self.state_file + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.state_file)

    @property
    def url(self) -> str:
        st = self._state()
        if st is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"no PostgreSQL cluster under {self.root}")
        return f"postgresql://{DB_USER}:{st['password']}@127.0.0.1:{st['port']}/{DB_NAME}"

    # -- processes ------------------------------------------------------------------------
    def _run(self, args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        tool = os.path.basename(args[0])
        if os.getuid() == 0:  # PostgreSQL refuses root
            args = ["runuser", "-u", "postgres", "--", *args]
        res = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd="/")
        if check and res.returncode != 0:
            raise StripefsError(ErrorCode.IO, f"{tool} failed: {(res.stderr or res.stdout).strip()[-800:]}")
        return res

    def _data_dir(self) -> str:
        if os.getuid() != 0:
            return os.path.join(self.root, "postgres")
        pw = pwd.getpwnam("postgres")
        if _reachable_by(os.path.join(self.root, "postgres"), pw.pw_uid, pw.pw_gid):
            return os.path.join(self.root, "postgres")
        digest = hashlib.sha1(self.root.encode()).hexdigest()[:16]
        return os.path.join("/var/tmp/stripefs-postgres", digest)

    def _tool(self, name: str) -> str:
        path = postgres_bin(name)
        if path is None:
            raise StripefsError(ErrorCode.NOT_SUPPORTED,
                                f"PostgreSQL's {name} is not installed (Debian: apt-get install postgresql)")
        return path

    def start(self) -> str:
        """Initialise (first time) and start the cluster; returns its URL."""
        st = self._state()
        if st is None:
            st = {"data": self._data_dir(), "port": _free_port(), "password": secrets.token_hex(16)}
            self._init(st)
            self._save(st)
        if not self.running():
            if not port_is_free(st["port"]):
                st["port"] = _free_port()
                self._save(st)
            log = os.path.join(st["data"], "server.log")
            self._run([self._tool("pg_ctl"), "start", "-w", "-t", "60", "-D", st["data"], "-l", log, "-o",
                       f"-p {st['port']} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''"])
        return self.url

    def _init(self, st: dict[str, Any]) -> None:
        data = st["data"]
        os.makedirs(data, mode=0o700, exist_ok=True)
        fd, pwfile = tempfile.mkstemp(prefix="stripefs-pg-")  # initdb wants the data directory empty
        with os.fdopen(fd, "w") as f:
            f.write(st["password"])
        if os.getuid() == 0:
            pw = pwd.getpwnam("postgres")
            for path in (data, pwfile):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        try:
            self._run([self._tool("initdb"), "-D", data, "-U", DB_USER, "--auth=scram-sha-256",
                       f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C", "--no-instructions"])
        finally:
            os.unlink(pwfile)
        with open(os.path.join(data, "postgresql.conf"), "a") as f:
            f.write("\n# stripefs: durable commits, a private instance\nfsync = on\nsynchronous_commit = on\n"
                    "max_connections = 200\n")
        st["fresh"] = True

    def running(self) -> bool:
        st = self._state()
        if st is None or postgres_bin("pg_ctl") is None:
            return False
        return self._run([self._tool("pg_ctl"), "status", "-D", st["data"]], check=False).returncode == 0

    def ensure_database(self) -> None:
        """Create the ``stripefs`` database once (the metadata service makes its tables)."""
        st = self._state()
        if st is None or not st.get("fresh"):
            return
        import psycopg

        admin = self.url.rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)).fetchone() is None:
                conn.execute(f"CREATE DATABASE {DB_NAME}")
        st.pop("fresh")
        self._save(st)

    def stop(self) -> None:
        st = self._state()
        if st is not None and self.running():
            self._run([self._tool("pg_ctl"), "stop", "-w", "-m", "fast", "-D", st["data"]], check=False)

    def destroy(self) -> None:
        """Stop and delete the cluster's data (tests)."""
        st = self._state()
        self.stop()
        if st is not None:
            shutil.rmtree(st["data"], ignore_errors=True)
            os.unlink(self.state_file)


def port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 now (as a service of a test cluster binds it)."""
    with socket.socket() as s:
        # As PostgreSQL binds: connections of the last run in TIME_WAIT do not hold the port
        # (without this a restart under load moved to a new port the cluster file did not name).
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
