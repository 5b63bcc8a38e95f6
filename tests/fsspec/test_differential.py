"""``stripefs://`` files against a local file (fsclient/testing/differential.py), for what fsspec expresses.

fsspec files open as ``wb``, ``ab``, ``xb`` or ``rb`` and have no ``fsync`` or
``pwrite``: the sequences use writes, seeks back over bytes in flight, reads,
truncates, flushes and close/reopen, and the file is compared through
``fs.cat`` and a native client after every close. ``STRIPEFS_DIFF_SEEDS=N``
replays a seed.
"""

from __future__ import annotations

from typing import Any

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.fsspec import StripeFileSystem
from tests.conftest import TEST_CHUNK
from stripefs.fsclient.testing.differential import LocalRoute, parse_seeds, run_seed

SEEDS = parse_seeds(range(8))
OPS = 80
MAX_SIZE = 4 << 20
MODES = ("wb", "ab", "ab", "rb")
KINDS = frozenset({"write", "seek", "read", "truncate", "flush", "close"})


class FsspecRoute:
    """Files under ``root`` through ``fs.open``; read back with ``fs.cat`` and a native client."""

    name = "fsspec"

    def __init__(self, fs: StripeFileSystem, client: Client, root: str):
        self.fs, self.client, self.root = fs, client, root

    def open(self, path: str, mode: str, who: int) -> Any:
        return self.fs.open(f"{self.root}/{path}", mode)

    def pwrite(self, handle: Any, data: bytes, offset: int) -> None:
        raise AssertionError("fsspec files have no pwrite")

    def fsync(self, handle: Any) -> None:
        raise AssertionError("fsspec files have no fsync")

    def write(self, handle: Any, data: bytes) -> None:
        assert handle.write(data) == len(data)

    def read(self, handle: Any, n: int) -> bytes:
        return handle.read(n)

    def contents(self, path: str) -> list[tuple[str, bytes]]:
        p = f"{self.root}/{path}"
        return [("fs.cat", self.fs.cat(p)), ("native client", self.client.read_bytes(p))]


@pytest.mark.parametrize("seed", SEEDS)
def test_differential_fsspec(sfs: StripeFileSystem, client: Client, root: str, tmp_path, seed: int) -> None:
    with client.open(f"{root}/probe", "wb") as f:
        window = f.window
    run_seed(FsspecRoute(sfs, client, root), LocalRoute(str(tmp_path)), f"f{seed}", seed, ops=OPS,
             chunk=TEST_CHUNK, window=window, max_size=MAX_SIZE, first_mode="wb", reopen_modes=MODES, kinds=KINDS)
