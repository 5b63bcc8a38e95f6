"""Names are bytes on Linux: what is not UTF-8 must work through the mount and the native API."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.fuse


def test_names_that_are_not_utf8(mdir: str, client, testdir: str) -> None:
    raw = b"caf\xe9-\xff.bin"
    path = os.path.join(os.fsencode(mdir), raw)
    with open(path, "wb") as f:
        f.write(b"latin-1 name")
    assert raw in os.listdir(os.fsencode(mdir))
    os.mkdir(os.path.join(os.fsencode(mdir), b"d\x80"))
    os.rename(path, os.path.join(os.fsencode(mdir), b"d\x80", raw))
    # The native API sees the same name (as Python's surrogate escapes).
    sub = os.fsdecode(b"d\x80")
    assert client.read_bytes(f"{testdir}/{sub}/{os.fsdecode(raw)}") == b"latin-1 name"
    os.unlink(os.path.join(os.fsencode(mdir), b"d\x80", raw))
    os.rmdir(os.path.join(os.fsencode(mdir), b"d\x80"))
    assert os.listdir(mdir) == []
