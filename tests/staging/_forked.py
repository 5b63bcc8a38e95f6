"""The mover and a saving trainer, each run in a process forked from a preloaded forkserver.

The kill sweep starts them dozens of times; a fresh interpreter costs seconds (torch's import)
each time, a fork from a preloaded, single-threaded forkserver milliseconds. The child is still
a process of its own: SIGKILL, the kernel dropping its flocks and everything it held in memory
are exactly those of ``python -m stripefs mover`` or a training job.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
from typing import Any, Callable

import torch

import staging
import staging._save
from staging import mover_cli

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["staging", "staging.mover_cli", __name__])

# The checksum chunk is recorded per file in the manifest and the journal, and the mover's
# piece is a whole number of them: a 256 KiB chunk keeps each of the many runs small.
CHUNK = 256 << 10
PIECE = CHUNK                   # the smallest upload piece (one checksum chunk)
LAYER = 2 * PIECE + 4096        # one data file per layer: two full pieces and a tail
SHARD = 64 << 10                # below LAYER, so every layer gets its own data file


def state_for(step: int) -> dict[str, Any]:
    """The training state saved as ``step``: tensors in several files plus plain values."""
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {f"layer{i}": torch.randn(LAYER // 4, generator=g) for i in range(3)},
        "rng": torch.Generator().manual_seed(1000 + step).get_state(),
        "py_rng": random.Random(step).getstate(),
        "config": {"lr": 0.1 * step, "name": f"run-{step}", "betas": (0.9, 0.99), "warmup": None},
    }


def save_step(sdir: str, url: str, step: int, cluster: str, upload: bool, keep_local: int = 1) -> None:
    """Save ``state_for(step)`` as the sweep's trainer does; returns once globally (or, without
    ``upload``, locally) durable, when the standalone mover can take the checkpoint.
    ``keep_local=0`` streams the upload from memory and writes nothing locally."""
    staging._save.CHECK_CHUNK = CHUNK  # only ever in a forked child: the test process keeps 4 MiB
    h = staging.save(state_for(step), url, staging_dir=sdir, cluster=cluster, upload=upload, background_mover=False,
                     keep_local=keep_local, shard_bytes=SHARD,
                     options=staging.MoverOptions(cluster=cluster, piece=PIECE, concurrency=1))
    h.wait(120, durable="global" if upload else "local")


def _child(fn: Callable[..., int | None], args: tuple[Any, ...], env: dict[str, str], out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)  # the kill and trace hooks read the environment at every point
    code = 1
    try:
        code = int(fn(*args) or 0)
    except BaseException as exc:  # reported through the output file; the exit status says it failed
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_forked(fn: Callable[..., int | None], args: tuple[Any, ...], env: dict[str, str], out_path: str,
               timeout: float = 120.0) -> tuple[int, str]:
    """Run ``fn(*args)`` in a forked child with ``env`` added (``fn``: a module-level function).

    Returns:
        ``(exit status, output)``; the status is ``-signal`` when a signal ended the child.

    Raises:
        TimeoutError: the child ran past ``timeout`` (it is killed).
    """
    p = _ctx.Process(target=_child, args=(fn, args, env, out_path))
    p.start()
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise TimeoutError(f"{fn.__name__}{args} still running after {timeout}s")
    with open(out_path) as f:
        return p.exitcode, f.read()


def mover_main(argv: list[str]) -> int:
    return mover_cli.main(argv)
