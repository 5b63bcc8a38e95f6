"""``stripefs mover`` run in a process forked from a forkserver that has already imported it.

The kill sweep starts the mover dozens of times; a fresh interpreter costs seconds (torch's
import) each time, a fork from a preloaded, single-threaded forkserver milliseconds. The child
is still a process of its own: SIGKILL, the kernel dropping its flocks and its lost state are
exactly those of ``python -m stripefs mover``.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from staging import mover_cli

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["staging.mover_cli", __name__])


def _child(argv: list[str], env: dict[str, str], out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)  # the kill and trace hooks read the environment at every point
    try:
        code = mover_cli.main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_mover(argv: list[str], env: dict[str, str], out_path: str, timeout: float = 120.0) -> tuple[int, str]:
    """Run ``mover_cli.main(argv)`` in a forked child with ``env`` added.

    Returns:
        ``(exit status, output)``; the status is ``-signal`` when a signal ended the child.
    """
    p = _ctx.Process(target=_child, args=(argv, env, out_path))
    p.start()
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise TimeoutError(f"mover {argv} still running after {timeout}s")
    with open(out_path) as f:
        return p.exitcode, f.read()
