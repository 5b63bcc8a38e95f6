"""What every route is: the :class:`Route` base, :class:`RunEnv`, :class:`RouteSkipped`.

Shared by the stripefs routes (``bench._routes``) and the peers (``bench._peers``).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Route", "RouteSkipped", "RunEnv", "wait_for", "need_module"]


class RouteSkipped(RuntimeError):
    """The route cannot run here; ``args[0]`` is the reason shown in the report."""


@dataclass
class RunEnv:
    """Where a route runs: the cluster (None for routes without one) and a scratch dir."""

    cluster_file: str | None
    workdir: str
    run_id: str
    servers: int = 0


def wait_for(pred: Any, timeout: float, what: str) -> None:
    """Poll ``pred()`` until true. Raises RouteSkipped after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RouteSkipped(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.1)


def need_module(name: str, route: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        raise RouteSkipped(f"{route}: {name} is not importable ({exc})") from exc


class Route:
    """Base: ``start(env) -> spec`` in the benchmark process, ``stop()`` afterwards."""

    name = "route"
    servers: int | None = None  # peers report their own server count
    on_cluster = False  # served by the benchmark's own stripefs cluster (its servers' CPU is the route's)

    def start(self, env: RunEnv) -> dict[str, Any]:
        raise NotImplementedError

    def stop(self) -> None:
        pass

    def pids(self) -> list[int]:
        """Processes this route runs that serve the clients (their CPU is the route's cost)."""
        return []

    def _root(self, env: RunEnv) -> str:
        return f"/bench-{env.run_id}/{self.name}"

    def _cluster(self, env: RunEnv) -> str:
        if env.cluster_file is None:
            raise RouteSkipped(f"{self.name}: no stripefs cluster in this run")
        return env.cluster_file
