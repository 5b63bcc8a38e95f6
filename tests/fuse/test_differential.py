"""The FUSE mount's write path against a local file (fsclient/testing/differential.py).

The same seeded sequences as tests/core/test_differential.py, through Python's
``open`` on the mount (buffered, as programs write). After every fsync and close
the file is read back through the mount and through a native client (the
length committed at close/fsync must be visible to other clients).
``STRIPEFS_DIFF_SEEDS=N`` replays a seed.
"""

from __future__ import annotations

import os

import pytest

from stripefs.fsclient import Client
from tests.conftest import TEST_CHUNK
from stripefs.fsclient.testing.differential import LocalRoute, MountRoute, parse_seeds, run_seed

pytestmark = pytest.mark.fuse

SEEDS = parse_seeds(range(10))
OPS = 100
MAX_SIZE = 4 << 20


@pytest.mark.parametrize("seed", SEEDS)
def test_differential_fuse(mdir: str, client: Client, testdir: str, tmp_path, seed: int) -> None:
    with client.open(f"{testdir}/probe", "wb") as f:
        window = f.window  # the daemon's StripeFile has the same layout, so the same window
    run_seed(MountRoute(mdir, client, testdir), LocalRoute(str(tmp_path)), f"f{seed}", seed, ops=OPS,
             chunk=TEST_CHUNK, window=window, max_size=MAX_SIZE)


def test_header_patch_after_large_body(mdir: str, client: Client, testdir: str) -> None:
    """The issue's case through the mount: ``open(..., "wb")``, 10 MiB body, seek(0),
    100-byte patch, one more write past the end, close, read back (lost in 9 of 20 runs)."""
    client.makedirs(f"{testdir}/4m")
    client.set_layout(f"{testdir}/4m", chunk_size=4 << 20)  # the default layout's chunks
    for round_ in range(3):
        body, patch, tail = os.urandom(10 << 20), os.urandom(100), os.urandom(1000)
        path = f"{mdir}/4m/ckpt{round_}"
        with open(path, "wb") as f:
            f.write(body)
            f.seek(0)
            f.write(patch)
            f.seek(len(body))
            f.write(tail)
        with open(path, "rb") as f:
            got = f.read()
        assert got[:100] == patch, f"round {round_}: the header patch was lost"
        assert got == patch + body[100:] + tail
        assert client.read_bytes(f"{testdir}/4m/ckpt{round_}") == got
