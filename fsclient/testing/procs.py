"""Stopping a process for a test, and knowing it has stopped.

``kill(pid, SIGSTOP)`` returns once the signal is queued, not once the process has
stopped. The kernel wakes one of its threads to take the signal; the others run on
until that thread has set the group stop going. A server whose connection thread
is woken by a request in that window answers it, so a test that sends a request
"to a stopped server" must wait for every thread to stop first: :func:`pause`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, TypeVar

__all__ = ["pause", "resume", "stopped", "while_paused"]

T = TypeVar("T")


def _states(pid: int) -> list[str]:
    """The scheduler state letter of each of ``pid``'s threads ([] once it is gone)."""
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        # "tid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ')'
        states.append(stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3].decode())
    return states


def stopped(pid: int) -> bool:
    """True when every thread of ``pid`` is stopped (or the process is gone or a zombie)."""
    return all(s in "tTZX" for s in _states(pid))


def pause(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once all of its threads have stopped.

    Raises TimeoutError if they have not within ``timeout`` s (the process is left
    with the signal pending); ProcessLookupError if there is no such process.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout} s: thread states {_states(pid)}")
        time.sleep(0.001)


def resume(pid: int) -> None:
    """SIGCONT ``pid``; a process that has died meanwhile is not an error."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def while_paused(pid: int, fn: Callable[[], T], wait: float) -> T | None:
    """``fn()`` on another thread while process ``pid`` is stopped (:func:`pause`); None
    if it took over ``wait`` s (it is then left to finish once ``pid`` runs again)."""
    got: list[T] = []
    t = threading.Thread(target=lambda: got.append(fn()), daemon=True)
    pause(pid)
    try:
        t.start()
        t.join(wait)
        return got[0] if got else None
    finally:
        resume(pid)
        t.join(10)
