"""Helpers shared by the FUSE tests (imported as tests.fuse.fuse_helpers)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any, Callable

from stripefs.storage import chunk_path


def sh(cmd: str, cwd: str, timeout: float = 120) -> str:
    """Run a shell command, failing the test with its output if it fails."""
    r = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd!r} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def as_user(uid: int, directory: str, action: Callable[[int], object]) -> int:
    """Run ``action(dirfd)`` in a forked child running as ``uid``; return its errno (0: success).

    The directory is opened as root first: the test's temporary parents are
    private to root, and ``openat`` on the fd skips checking them.
    """
    dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    pid = os.fork()
    if pid == 0:  # child: drop privileges, try, report errno as the exit status
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            action(dirfd)
        except OSError as exc:
            code = exc.errno or 255
        except BaseException:
            code = 255
        os._exit(code)
    os.close(dirfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def fuse_unusable() -> str | None:
    """Why FUSE mounts cannot be made here (None: they can)."""
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"/dev/fuse cannot be opened: {exc.strerror}"
    return None


@contextlib.contextmanager
def chunk_writes_fail(servers: list[dict[str, Any]], ino: int, chunks: int = 64) -> Iterator[None]:
    """Every new chunk file of inode ``ino`` (the first ``chunks``) fails to be created on
    every storage server: a directory sits where the chunk's ``.tmp`` would be made. Chunk
    files only: a file's small chunks go to a container log (up to 256 KiB written whole, but
    never a whole chunk of the file), so a test writes at least a whole chunk."""
    blockers = [chunk_path(s["root"], ino, i) + ".tmp" for s in servers for i in range(chunks)]
    for b in blockers:
        os.makedirs(b)
    try:
        yield
    finally:
        for b in blockers:
            os.rmdir(b)


def wait_gone(pid: int, timeout: float = 20.0) -> None:
    """Wait until process ``pid`` is gone (reaped when it is our child).

    Raises:
        AssertionError: it still runs after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still running after {timeout}s")


def alive(pid: int) -> bool:
    """Is process ``pid`` still there (reaped first when it is our child and exited)?"""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def assert_inside_windows(rig: Any, seed: int, seconds: float) -> None:
    """One seeded coherence history on ``rig``: no crash, no observation outside the
    documented windows, and a run that did its work (reads by both kinds of actor, changes)."""
    from stripefs.fsclient.testing.coherence import check, run_history, summary

    h = run_history(rig, seed, seconds)
    violations = check(h)
    counts = summary(h, violations)
    assert not h.crashes, h.crashes
    assert not violations, "\n".join([*(str(v) for v in violations[:20]), h.context(violations[0])])
    by_op = counts["by_op"]
    assert by_op.get("mount.read", 0) and by_op.get("native.read", 0), by_op
    assert counts["mutations"] >= 10, counts
