"""Finding the cluster: ``cluster=`` argument, ``STRIPEFS_CLUSTER``, then the last ``stripefs up``.

"The last ``stripefs up``" is a per-user pointer file (:func:`default_state_file`) that any
``up`` on the machine rewrites. A process reads it once -- when this module is imported,
else the first time it needs it -- and keeps that answer (its own ``up`` moves it): a
running program never changes clusters because someone else started one. The resolved
:class:`ClusterConfig` says where it came from (``source``), so tools can tell the user.

A cluster is named by a path to its ``cluster.json`` or by ``host:port`` of the
metadata service (the client credential then comes from ``secret=`` or
``STRIPEFS_SECRET``). With several metadata services the file lists them all
(``metadata_services``) and ``host:port,host:port`` names them all; ``metadata``
stays the first one, so files and tools from before keep working.

Credentials: a ``cluster.json`` holds the *client* credential
(``client_secret``), derived one-way from the cluster secret, so its holders
cannot authenticate as servers. A file written before roles existed holds the
cluster secret itself (``secret``): the client credential is derived from it.
The servers' file (``server.json`` beside it, ``"role": "server"``) holds the
cluster secret; reading it gives a configuration that authenticates as a server
(administration: ``stripefs remove-server``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from stripefs.wire import ErrorCode, StripefsError, role_credential

__all__ = ["ClusterConfig", "find_cluster", "default_state_file", "remember_cluster"]


@dataclass(frozen=True)
class ClusterConfig:
    metadata: tuple[str, int]
    secret: str  # the credential of ``role`` (wire.role_credential)
    cluster_id: str = ""
    path: str | None = None  # the cluster.json it came from
    role: str = "client"  # what connections authenticate as
    services: tuple[tuple[str, int], ...] = ()  # every metadata service, ``metadata`` first
    source: str = ""  # what named it: "argument", "STRIPEFS_CLUSTER" or "last up" (the pointer file)

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        """Every metadata service's address (just ``metadata`` for a single service)."""
        return self.services or (self.metadata,)

    @classmethod
    def from_file(cls, path: str) -> "ClusterConfig":
        """Read a cluster.json (client), an older one holding the cluster secret, or the servers' file.

        Raises:
            StripefsError: NOT_FOUND for a missing file; INVALID for one without a
                metadata address or a credential.
        """
        try:
            with open(path) as f:
                raw: dict[str, Any] = json.load(f)
        except FileNotFoundError as exc:
            raise StripefsError(ErrorCode.NOT_FOUND, f"no cluster file at {path}") from exc
        except (OSError, ValueError) as exc:
            raise StripefsError(ErrorCode.INVALID, f"cannot read cluster file {path}: {exc}") from exc
        try:
            host, port = raw["metadata"]["host"], int(raw["metadata"]["port"])
            role = "server" if raw.get("role") == "server" else "client"
            if "client_secret" in raw and role == "client":
                credential = str(raw["client_secret"])
            else:  # the cluster secret itself (the servers' file, or a cluster.json from before roles)
                credential = role_credential(str(raw["secret"]), role)
            services = tuple((str(s["host"]), int(s["port"])) for s in raw.get("metadata_services") or [])
            return cls((host, port), credential, str(raw.get("cluster_id", "")), os.path.abspath(path), role,
                       services if len(services) > 1 else ())
        except (KeyError, TypeError, ValueError) as exc:
            raise StripefsError(ErrorCode.INVALID, f"cluster file {path} lacks metadata address or credential") from exc


def default_state_file() -> str:
    """Per-user file naming the cluster of the most recent ``stripefs up``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "stripefs", "last_cluster")


def _read_pointer() -> str:
    try:
        with open(default_state_file()) as f:
            return f.read().strip()
    except OSError:
        return ""


# The pointer as this process first read it, or the cluster of this process's own last `up`.
_pinned = _read_pointer()
_pin_lock = threading.Lock()


def remember_cluster(cluster_file: str) -> None:
    """Make ``cluster_file`` the default of this process and of the processes started after."""
    global _pinned
    path = default_state_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(os.path.abspath(cluster_file))
    os.replace(tmp, path)
    with _pin_lock:
        _pinned = os.path.abspath(cluster_file)


def _last_up() -> str:
    """The cluster.json of the last ``stripefs up`` as this process first saw it (read now if never)."""
    global _pinned
    with _pin_lock:
        if not _pinned:
            _pinned = _read_pointer()
        return _pinned


def _parse(spec: str, secret: str | None) -> ClusterConfig:
    if os.path.isdir(spec):
        spec = os.path.join(spec, "cluster.json")
    if os.path.exists(spec) or spec.endswith(".json"):
        return ClusterConfig.from_file(spec)
    addresses = []
    for part in spec.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or "/" in spec:  # a path (to a cluster.json or its directory) that is not there
            raise StripefsError(ErrorCode.NOT_FOUND, "no such file or directory (a cluster is named by its "
                                                     "cluster.json, the directory holding it, or host:port)", spec)
        if not port.isdigit():
            raise StripefsError(ErrorCode.INVALID, f"cluster must be a cluster.json path or host:port, got {spec!r}")
        addresses.append((host or "127.0.0.1", int(port)))
    secret = secret or os.environ.get("STRIPEFS_SECRET")
    if not secret:
        raise StripefsError(ErrorCode.AUTH, f"cluster {spec} given as host:port needs the client credential "
                                            "(cluster.json's client_secret, as secret= or STRIPEFS_SECRET)")
    return ClusterConfig(addresses[0], secret, services=tuple(addresses) if len(addresses) > 1 else ())


def find_cluster(cluster: "str | os.PathLike[str] | ClusterConfig | None" = None, secret: str | None = None) -> ClusterConfig:
    """Resolve the cluster in the documented order: ``cluster``, ``STRIPEFS_CLUSTER``, then
    the last ``stripefs up`` as this process first saw it (module docstring).

    Raises:
        StripefsError: NOT_FOUND when nothing names a cluster.
    """
    if isinstance(cluster, ClusterConfig):
        return cluster
    if cluster:
        return dataclasses.replace(_parse(os.fspath(cluster), secret), source="argument")
    env = os.environ.get("STRIPEFS_CLUSTER")
    if env:
        return dataclasses.replace(_parse(env, secret), source="STRIPEFS_CLUSTER")
    last = _last_up()
    if last:
        return dataclasses.replace(ClusterConfig.from_file(last), source="last up")
    raise StripefsError(
        ErrorCode.NOT_FOUND,
        "no stripefs cluster: pass cluster=, set STRIPEFS_CLUSTER, or start one with `stripefs up --root DIR`",
    )
