"""A local cluster on 127.0.0.1: ``stripefs up`` / ``stripefs down``, tests, benchmarks, the demo.

Real processes (``python -m stripefs.metadata``, ``python -m stripefs.storage``) on loopback; the
functions :func:`up`, :func:`down` and :func:`add_server` are what the CLI runs,
and :class:`LocalCluster` is the handle tests and benchmarks hold::

    with LocalCluster.start("/tmp/c", servers=4) as cluster:
        with cluster.client() as fs:
            fs.write_bytes("/x", b"...")

Everything lives under ``ROOT``::

    ROOT/cluster.json      addresses, pids, the client credential (mode 0600): what clients read
    ROOT/server.json       the same plus the cluster secret (mode 0600): what servers read
    ROOT/meta/             metadata database (meta.db; servers.json of older versions, imported)
    ROOT/storage-N/        one storage target per server (chunks/, target.json)
    ROOT/logs/*.log        server logs

``up`` on an existing ROOT restarts that cluster with its data (same secret,
same metadata port when it is free, same server ids).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

from stripefs.wire import ErrorCode, StripefsError, new_secret, role_credential

from ..core import Client, pid_alive, remember_cluster

__all__ = ["LocalCluster", "up", "down", "add_server", "read_cluster", "mark_removed"]

READY_TIMEOUT = 30.0
MAX_METADATA_SERVICES = 16


SERVER_FILE = "server.json"


def read_cluster(root: str) -> dict[str, Any] | None:
    """cluster.json's content with the cluster ``secret`` (from server.json, or from a
    cluster.json written before roles, which held it; the next write upgrades it)."""
    try:
        with open(os.path.join(root, "cluster.json")) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    if "secret" not in data:
        try:
            with open(os.path.join(root, SERVER_FILE)) as f:
                server = json.load(f)
            data["secret"] = server["secret"]
            if "metadata_store_url" in server:
                data["metadata_store_url"] = server["metadata_store_url"]
        except (FileNotFoundError, KeyError):
            pass
    return data


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _write_cluster(root: str, data: dict[str, Any]) -> str:
    """Write server.json (with the cluster secret) and cluster.json (the client credential only)."""
    secret = data["secret"]
    _write_json(os.path.join(root, SERVER_FILE), {**data, "role": "server"})
    # The database URL carries its password: servers need it, clients do not.
    client = {k: v for k, v in data.items() if k not in ("secret", "role", "metadata_store_url")}
    path = os.path.join(root, "cluster.json")
    _write_json(path, {**client, "client_secret": role_credential(secret, "client")})
    return path


def _spawn(args: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )
    finally:
        log.close()


def _wait_ready(proc: subprocess.Popen, ready: str, what: str, log_path: str) -> str:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if os.path.exists(ready):
            with open(ready) as f:
                return f.read().strip()
        if proc.poll() is not None:
            tail = open(log_path, errors="replace").read()[-2000:]
            raise StripefsError(ErrorCode.IO, f"{what} exited with status {proc.returncode}:\n{tail}")
        time.sleep(0.05)
    proc.kill()
    raise StripefsError(ErrorCode.TIMEOUT, f"{what} did not start within {READY_TIMEOUT:.0f}s (see {log_path})")


def _port_free(port: int, within: float = 0.0) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1, waiting up to ``within`` seconds for it
    (a service stopped just now may hold it for a moment)."""
    from ._postgres import port_is_free

    deadline = time.monotonic() + within
    while not port_is_free(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def up(root: str, *, servers: int = 4, replicas: int = 1, chunk_size: int = 4 << 20, stripe: int = 16,
       gc_grace: float = 30.0, metadata_store: str = "sqlite", postgres_url: str | None = None,
       metadata_services: int = 1, metadata_sync: str | None = None,
       lease_ttl: float | None = None, data_sync: str | None = None) -> dict[str, Any]:
    """Start (or restart) the cluster under ``root``; returns the cluster.json content.

    Args:
        metadata_store: ``sqlite`` (a file under ``root/meta``) or ``postgresql``.
        postgres_url: the database for ``postgresql``; without one, a private
            PostgreSQL server is initialised under ``root`` and started (and
            ``down`` stops it).
        metadata_services: metadata service processes on the one store (more than
            one needs ``postgresql``); cluster.json lists them all.
        metadata_sync: the SQLite store's durability, ``full`` (each acknowledged
            operation survives power loss; the default) or ``normal`` (it survives a
            kill -9 of any process, not a power loss). None: the cluster's setting
            on a restart, else ``full``.
        lease_ttl: seconds an attribute lease lives (the metadata service's
            ``--lease-ttl``; 0 grants none). None: the cluster's setting on a restart,
            else the service's default.
        data_sync: the storage servers' durability, ``full`` (an acknowledged chunk
            write is synced to disk: it survives power loss; the default) or ``none``
            (acknowledged from the page cache: it survives a kill -9 of any process, not
            a power loss or a kernel crash; MooseFS's chunkservers behave so by
            default). None: the cluster's setting on a restart, else ``full``.
    """
    if data_sync not in (None, "full", "none"):
        raise StripefsError(ErrorCode.INVALID, f"--data-sync {data_sync!r}: use full or none")
    if not 1 <= replicas <= 3 or replicas > servers:
        raise StripefsError(ErrorCode.INVALID, "--replicas must be 1, 2 or 3 and at most --servers")
    if metadata_store not in ("sqlite", "postgresql"):
        raise StripefsError(ErrorCode.INVALID, "--metadata-store is sqlite or postgresql")
    if postgres_url and metadata_store != "postgresql":
        raise StripefsError(ErrorCode.INVALID, "--postgres-url needs --metadata-store postgresql")
    if not 1 <= metadata_services <= MAX_METADATA_SERVICES:
        raise StripefsError(ErrorCode.INVALID, f"--metadata-services must be 1-{MAX_METADATA_SERVICES}")
    if metadata_services > 1 and metadata_store != "postgresql":
        raise StripefsError(ErrorCode.INVALID, "--metadata-services above 1 needs --metadata-store postgresql "
                            "(a SQLite file belongs to one process)")
    if metadata_sync not in (None, "full", "normal"):
        raise StripefsError(ErrorCode.INVALID, f"--metadata-sync {metadata_sync!r}: use full or normal")
    if metadata_sync == "normal" and metadata_store == "postgresql":
        raise StripefsError(ErrorCode.INVALID, "--metadata-sync normal applies to SQLite; with PostgreSQL set "
                            "the database's synchronous_commit instead")
    if lease_ttl is not None and not lease_ttl >= 0:
        raise StripefsError(ErrorCode.INVALID, f"--lease-ttl {lease_ttl!r}: seconds, 0 or more (0: no leases)")
    root = os.path.abspath(root)
    os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    old = read_cluster(root)
    if metadata_sync == "normal" and (old or {}).get("metadata_store") == "postgresql":
        raise StripefsError(ErrorCode.INVALID, "--metadata-sync normal applies to SQLite; this cluster keeps "
                            "its namespace in PostgreSQL")
    _start_private_postgres(root, old)
    if old and any(pid_alive(p) for p in old.get("pids", [])):
        if all(pid_alive(p) for p in old.get("pids", [])):
            remember_cluster(os.path.join(root, "cluster.json"))
            return old
        _restart_metadata(root, old)
        return _restart_dead_servers(root, old)
    existing = sorted(int(d.split("-")[1]) for d in os.listdir(root) if d.startswith("storage-") and d.split("-")[1].isdigit())
    count = max(servers, len(existing))
    cluster: dict[str, Any] = {
        "cluster_id": (old or {}).get("cluster_id") or secrets.token_hex(8),
        "secret": (old or {}).get("secret") or new_secret(),
        "root": root,
        "metadata": {"host": "127.0.0.1", "port": 0},
        "servers": [],
        "pids": [],
        "chunk_size": chunk_size,
        "stripe": stripe,
        "replicas": replicas,
        "gc_grace": gc_grace,
        "metadata_store": (old or {}).get("metadata_store") or metadata_store,
        "metadata_services": [],
        "metadata_sync": metadata_sync or (old or {}).get("metadata_sync") or "full",
        "data_sync": data_sync or (old or {}).get("data_sync") or "full",
    }
    if lease_ttl is not None or (old or {}).get("lease_ttl") is not None:
        cluster["lease_ttl"] = lease_ttl if lease_ttl is not None else old["lease_ttl"]  # type: ignore[index]
    if old and old.get("metadata_services"):  # a restart keeps the number of services
        metadata_services = max(metadata_services, len(old["metadata_services"]))
    if cluster["metadata_store"] == "postgresql":
        url = (old or {}).get("metadata_store_url") or postgres_url
        if url is None:  # a private server under ROOT
            url = _start_private_postgres(root, {"metadata_store": "postgresql", "private_postgres": True})
            cluster["private_postgres"] = True
        else:
            cluster["private_postgres"] = bool((old or {}).get("private_postgres"))
        cluster["metadata_store_url"] = url
    path = _write_cluster(root, cluster)  # secret must be on disk (0600) before servers read it
    spath = os.path.join(root, SERVER_FILE)  # what the servers read: the cluster secret
    procs: list[subprocess.Popen] = []
    try:
        old_ports = [int(s.get("port", 0)) for s in _services(old or {})]
        spawned = []
        for i in range(metadata_services):
            old_port = old_ports[i] if i < len(old_ports) else 0
            port = old_port if old_port and _port_free(old_port, within=3.0) else 0
            proc, ready, log_path = _spawn_metadata(root, cluster, i, port)
            procs.append(proc)
            spawned.append((i, proc, ready, log_path))
        for i, proc, ready, log_path in spawned:
            maddr = _wait_ready(proc, ready, f"metadata service {i}" if i else "metadata service", log_path)
            host, _, mport = maddr.rpartition(":")
            cluster["metadata_services"].append({"host": host, "port": int(mport), "pid": proc.pid})
        cluster["metadata"] = cluster["metadata_services"][0]
        maddr = _metadata_arg(cluster)
        starting: list[tuple[int, Any, str, str, Any]] = []
        before = (old or {}).get("servers", [])
        for i in range(count):
            if i < len(before) and before[i].get("removed"):
                starting.append((i, None, "", "", before[i]))  # removed for good: never started again
                continue
            sp, sready, slog = _start_server(root, i, maddr, spath, cluster.get("data_sync", "full"))
            procs.append(sp)
            starting.append((i, sp, sready, slog, os.path.join(root, f"storage-{i}")))
        for i, sp, sready, slog, sroot in starting:
            if sp is None:
                cluster["servers"].append(sroot)
                continue
            addr = _wait_ready(sp, sready, f"storage server {i}", slog)
            h, _, p = addr.rpartition(":")
            cluster["servers"].append({"root": sroot, "host": h, "port": int(p), "pid": sp.pid})
    except BaseException:
        for started in procs:
            started.kill()
        raise
    cluster["pids"] = [started.pid for started in procs]
    _write_cluster(root, cluster)
    remember_cluster(path)
    return cluster


def _services(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    """The metadata services of a cluster file (older files name just one)."""
    listed = cluster.get("metadata_services")
    if listed:
        return list(listed)
    return [cluster["metadata"]] if cluster.get("metadata") else []


def _metadata_arg(cluster: dict[str, Any]) -> str:
    """Every metadata address, as storage servers take them (``--metadata a,b``)."""
    return ",".join(f"{s['host']}:{s['port']}" for s in _services(cluster))


def _spawn_metadata(root: str, cluster: dict[str, Any], i: int, port: int) -> tuple[subprocess.Popen, str, str]:
    """Start metadata service ``i`` (its own ready file and log); returns ``(process, ready, log)``."""
    suffix = f"-{i}" if i else ""
    ready = os.path.join(root, f"meta{suffix}.ready")
    if os.path.exists(ready):
        os.unlink(ready)
    log_path = os.path.join(root, "logs", f"metadata{suffix}.log")
    proc = _spawn(["-m", "stripefs.metadata", "--state", os.path.join(root, "meta"), "--cluster", os.path.join(root, SERVER_FILE),
                   "--port", str(port), "--chunk-size", str(cluster.get("chunk_size", 4 << 20)),
                   "--stripe", str(cluster.get("stripe", 16)), "--gc-grace", str(cluster.get("gc_grace", 30.0)),
                   "--replicas", str(cluster.get("replicas", 1)), "--sync", cluster.get("metadata_sync", "full"),
                   *(["--lease-ttl", str(cluster["lease_ttl"])] if cluster.get("lease_ttl") is not None else []),
                   "--ready", ready], log_path)
    return proc, ready, log_path


def _start_private_postgres(root: str, cluster: dict[str, Any] | None) -> str | None:
    """Start the private PostgreSQL of a cluster that has one; returns its URL."""
    if not cluster or cluster.get("metadata_store") != "postgresql" or not cluster.get("private_postgres"):
        return None
    from ._postgres import LocalPostgres

    pg = LocalPostgres(root)
    url = pg.start()
    pg.ensure_database()
    return url


def _start_server(root: str, i: int, maddr: str, cluster_file: str,
                  data_sync: str = "full") -> tuple[subprocess.Popen, str, str]:
    sroot = os.path.join(root, f"storage-{i}")
    os.makedirs(sroot, exist_ok=True)
    sready = os.path.join(sroot, "ready")
    if os.path.exists(sready):
        os.unlink(sready)
    slog = os.path.join(root, "logs", f"storage-{i}.log")
    sp = _spawn(["-m", "stripefs.storage", "--root", sroot, "--metadata", maddr, "--cluster", cluster_file, "--ready", sready,
                 "--data-sync", data_sync], slog)
    return sp, sready, slog


def _restart_metadata(root: str, cluster: dict[str, Any]) -> None:
    """Start dead metadata services again on their old ports; running storage servers re-register."""
    _write_cluster(root, cluster)  # a cluster.json from before roles: server.json first
    services = _services(cluster)
    for i, old in enumerate(services):
        if pid_alive(old.get("pid", -1)):
            continue
        port = int(old["port"])
        _port_free(port, within=10.0)  # TIME_WAIT of the dead one
        proc, ready, log_path = _spawn_metadata(root, cluster, i, port)
        addr = _wait_ready(proc, ready, f"metadata service {i}" if i else "metadata service", log_path)
        host, _, mport = addr.rpartition(":")
        services[i] = {"host": host, "port": int(mport), "pid": proc.pid}
    cluster["metadata_services"] = services
    cluster["metadata"] = services[0]


def _restart_dead_servers(root: str, cluster: dict[str, Any]) -> dict[str, Any]:
    """The metadata service runs but some storage servers died: start just those again."""
    _write_cluster(root, cluster)  # a cluster.json from before roles: server.json first
    maddr = _metadata_arg(cluster)
    for i, s in enumerate(cluster["servers"]):
        if pid_alive(s["pid"]) or s.get("removed"):
            continue
        sp, sready, slog = _start_server(root, i, maddr, os.path.join(root, SERVER_FILE), cluster.get("data_sync", "full"))
        addr = _wait_ready(sp, sready, f"storage server {i}", slog)
        h, _, p = addr.rpartition(":")
        cluster["servers"][i] = {"root": s["root"], "host": h, "port": int(p), "pid": sp.pid}
    cluster["pids"] = [s["pid"] for s in _services(cluster)] + [s["pid"] for s in cluster["servers"]]
    path = _write_cluster(root, cluster)
    remember_cluster(path)
    return cluster


def add_server(root: str) -> dict[str, Any]:
    """Start one more storage server in the running cluster under ``root``.

    The metadata service moves it into a fair share of the chains; it copies
    those chains' data in the background and then serves, while the servers it
    relieves drop their copies. No downtime: reads and writes go on meanwhile.
    """
    root = os.path.abspath(root)
    cluster = read_cluster(root)
    if not cluster or not any(pid_alive(m.get("pid", -1)) for m in _services(cluster)):
        raise StripefsError(ErrorCode.UNAVAILABLE, f"no running cluster under {root} (stripefs up first)")
    _write_cluster(root, cluster)  # a cluster.json from before roles: server.json first
    i = len(cluster["servers"])
    maddr = _metadata_arg(cluster)
    sp, sready, slog = _start_server(root, i, maddr, os.path.join(root, SERVER_FILE), cluster.get("data_sync", "full"))
    addr = _wait_ready(sp, sready, f"storage server {i}", slog)
    h, _, p = addr.rpartition(":")
    cluster["servers"].append({"root": os.path.join(root, f"storage-{i}"), "host": h, "port": int(p), "pid": sp.pid})
    cluster["pids"].append(sp.pid)
    _write_cluster(root, cluster)
    return cluster


def mark_removed(root: str, host: str, port: int) -> bool:
    """Record that the server at ``host:port`` was removed (``stripefs remove-server``), so
    ``up`` never starts it again. Returns whether it was one of this cluster's servers."""
    root = os.path.abspath(root)
    cluster = read_cluster(root)
    if not cluster or "secret" not in cluster:
        return False
    for s in cluster.get("servers", []):
        if (s.get("host"), s.get("port")) == (host, port):
            s["removed"] = True
            _write_cluster(root, cluster)
            return True
    return False


def down(root: str, timeout: float = 10.0) -> int:
    """Stop every process of the cluster under ``root``; returns how many were running."""
    cluster = read_cluster(os.path.abspath(root))
    if not cluster:
        raise StripefsError(ErrorCode.NOT_FOUND, f"no cluster.json under {root}")
    pids = [p for p in cluster.get("pids", []) if pid_alive(p)]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    for p in pids:
        if pid_alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # Killed is not yet gone: a process holds its files (the metadata store's lock) until
    # the kernel has torn it down, and the caller may open them next.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.02)
    cluster["pids"] = []
    _write_cluster(os.path.abspath(root), cluster)
    if cluster.get("private_postgres"):
        from ._postgres import LocalPostgres

        LocalPostgres(os.path.abspath(root)).stop()
    return len(pids)


class LocalCluster:
    """A running local cluster: :attr:`file` is its cluster.json, :attr:`data` its content.

    ``kw`` are :func:`up`'s options; :meth:`restart` stops every process and starts
    them again with the same data, :meth:`up` starts only what is not running.
    """

    def __init__(self, root: str, **kw: Any):
        self.root = os.path.abspath(root)
        self.kw = kw
        self.data: dict[str, Any] = read_cluster(self.root) or {}
        self.file = os.path.join(self.root, "cluster.json")

    @classmethod
    def start(cls, root: str, **kw: Any) -> "LocalCluster":
        handle = cls(root, **kw)
        handle.up()
        return handle

    def up(self) -> dict[str, Any]:
        """Start whatever is not running (the whole cluster, or just its dead processes)."""
        self.data = up(self.root, **self.kw)
        return self.data

    def down(self) -> int:
        return down(self.root)

    def restart(self) -> None:
        self.down()
        self.up()

    def add_server(self) -> dict[str, Any]:
        self.data = add_server(self.root)
        return self.data

    def client(self, **kw: Any) -> Client:
        return Client(self.file, **kw)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        except OSError:
            pass
