"""N client *processes* kept alive across workloads, started together behind a barrier.

Each client process opens its route's session once (so interpreter start-up and connection
set-up are not timed), then runs one task per request from the benchmark process and sends
back its per-part results. A client that fails aborts the shared barrier, so the others fail
fast instead of waiting out the timeout.

Caveats:
    * Processes are *spawned*, never forked: the benchmark process runs a live display thread
      and client libraries hold sockets, neither of which survives a fork cleanly.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
import traceback
from typing import Any, Callable

from ._pattern import Pattern
from ._sessions import open_session
from ._tasks import run_workload
from ._workloads import ClientContext

__all__ = ["ClientPool", "WorkloadError", "WorkloadSkipped"]


class WorkloadError(RuntimeError):
    """A client failed (the message carries its traceback) or the pool broke."""


class WorkloadSkipped(RuntimeError):
    """The route cannot run this workload (e.g. offset writes over fsspec); args[0] says why."""


def _client_main(index: int, clients: int, spec: dict[str, Any], conn: Any, barrier: Any,
                 progress: Any, writers_done: Any, block: int, timeout: float) -> None:
    """Client process: open the session, then serve tasks until None."""
    try:
        session = open_session(spec)
        pattern = Pattern(block)
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        return
    conn.send({"ready": True})
    ctx = ClientContext(index, clients, barrier, progress, writers_done, pattern, timeout)
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            try:
                parts = run_workload(session, task, ctx)
                conn.send({"parts": {k: dataclasses.asdict(v) for k, v in parts.items()}})
            except NotImplementedError as exc:
                barrier.abort()
                conn.send({"skip": str(exc)})
            except BaseException:
                barrier.abort()
                conn.send({"error": traceback.format_exc()})
    finally:
        session.close()


class ClientPool:
    """Start ``clients`` processes on the route described by ``spec``.

    Args:
        spec: the route's session spec (see ``bench._sessions.open_session``).
        clients: number of client processes.
        block: I/O block size of sequential workloads (the pattern block).
        timeout: seconds any barrier or task may take.

    Raises:
        WorkloadError: a client could not open its session.
    """

    def __init__(self, spec: dict[str, Any], clients: int, block: int, timeout: float = 300.0):
        ctx = mp.get_context("spawn")
        self.clients, self.timeout = clients, timeout
        self.barrier = ctx.Barrier(clients)
        self.progress = ctx.Array("q", clients, lock=False)
        self.writers_done = ctx.Value("i", 0)
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        try:
            for i in range(clients):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_client_main, name=f"bench-client-{i}", daemon=True,
                                args=(i, clients, spec, child, self.barrier, self.progress,
                                      self.writers_done, block, timeout))
                p.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(p)
            for reply in self._gather(lambda: None):
                if "error" in reply:
                    raise WorkloadError(f"client could not start:\n{reply['error']}")
        except BaseException:
            self.close(kill=True)
            raise

    def _gather(self, tick: Callable[[], None]) -> list[dict[str, Any]]:
        """One reply per client, calling ``tick`` about 5 times a second while waiting."""
        replies: list[dict[str, Any] | None] = [None] * self.clients
        deadline = time.monotonic() + self.timeout
        while any(r is None for r in replies):
            for i, c in enumerate(self.conns):
                if replies[i] is None and c.poll(0):
                    try:
                        replies[i] = c.recv()
                    except EOFError:
                        replies[i] = {"error": f"client {i} exited (status {self.procs[i].exitcode})"}
            for i, p in enumerate(self.procs):
                if replies[i] is None and not p.is_alive() and not self.conns[i].poll(0):
                    replies[i] = {"error": f"client {i} died (status {p.exitcode})"}
                    self.barrier.abort()
            if time.monotonic() > deadline:
                self.barrier.abort()
                raise WorkloadError(f"clients did not answer within {self.timeout:.0f} s")
            tick()
            if any(r is None for r in replies):
                time.sleep(0.05)
        return replies  # type: ignore[return-value]

    def run(self, task: dict[str, Any],
            on_progress: Callable[[int], None] | None = None) -> list[dict[str, dict[str, Any]]]:
        """Run ``task`` in every client; returns each client's parts (dicts of PartResult fields).

        Raises:
            WorkloadSkipped: a client reported that the route cannot run this workload.
            WorkloadError: a client failed; the pool stays usable for the next task.
        """
        self.barrier.reset()
        self.writers_done.value = 0
        for i in range(self.clients):
            self.progress[i] = 0
        for c in self.conns:
            c.send(task)
        last = [0.0]

        def tick() -> None:
            now = time.monotonic()
            if on_progress is not None and now - last[0] >= 0.2:
                last[0] = now
                on_progress(sum(self.progress))

        replies = self._gather(tick)
        if on_progress is not None:
            on_progress(sum(self.progress))
        skips = [r["skip"] for r in replies if "skip" in r]
        if skips:
            raise WorkloadSkipped(skips[0])
        errors = [r["error"] for r in replies if "error" in r]
        if errors:
            # the others only saw the aborted barrier: report the root cause first
            errors.sort(key=lambda e: "BrokenBarrierError" in e)
            raise WorkloadError(errors[0])
        return [r["parts"] for r in replies]

    def close(self, kill: bool = False) -> None:
        """Stop the clients (politely unless ``kill``)."""
        for c in self.conns:
            try:
                if not kill:
                    c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []
