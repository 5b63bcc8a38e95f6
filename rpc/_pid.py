"""This process's id without a system call (``os.getpid`` is one, and connections ask at
every request whether the process was forked since they were made); a fork updates it."""

from __future__ import annotations

import os

__all__ = ["my_pid"]

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def my_pid() -> int:
    """This process's id, as ``os.getpid()`` (kept up to date across forks)."""
    return _pid
