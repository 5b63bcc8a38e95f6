"""Fixtures of the ``stripefs://`` tests: filesystems and directories on the session cluster."""

from __future__ import annotations

import itertools
import os
from typing import Any, Iterator

import fsspec
import pytest

from stripefs.fsclient.fsspec import StripeFileSystem

_ids = itertools.count()


@pytest.fixture
def sfs(cluster: Any) -> StripeFileSystem:
    """The ``stripefs`` filesystem on the session cluster, as ``fsspec.filesystem`` builds it."""
    fs = fsspec.filesystem("stripefs", cluster=cluster.file)
    assert isinstance(fs, StripeFileSystem)
    return fs


@pytest.fixture
def root(sfs: StripeFileSystem, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh directory (no protocol) for one test; removed afterwards."""
    name = "".join(ch if ch.isalnum() else "_" for ch in request.node.name)[:60]
    path = f"/fsspec-tests/{name}-{next(_ids)}-{os.getpid()}"
    sfs.makedirs(path)
    yield path
    if sfs.exists(path):
        sfs.rm(path, recursive=True)


@pytest.fixture
def cluster_env(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """``STRIPEFS_CLUSTER`` pointing at the session cluster, so bare ``stripefs://`` URLs work."""
    monkeypatch.setenv("STRIPEFS_CLUSTER", cluster.file)
    return cluster.file
