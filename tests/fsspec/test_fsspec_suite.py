"""fsspec's own conformance suite, run against a real local cluster (as s3fs's ``tests/derived/``).

The fixtures the suite asks its derived classes for are provided the way s3fs's
``tests/derived/s3fs_fixtures.py`` does; every inherited test runs unchanged.
"""

from __future__ import annotations

import itertools
import posixpath
from typing import Any, Callable, Iterator

import fsspec
import fsspec.tests.abstract as abstract
import pytest

from stripefs.fsclient.fsspec import StripeFileSystem

_ids = itertools.count()


class StripeFsFixtures(abstract.AbstractFixtures):
    """What ``fsspec.tests.abstract`` needs: ``fs``, ``fs_path``, ``fs_join``, empty-directory support."""

    @pytest.fixture(scope="class")
    @classmethod
    def fs(cls, cluster: Any) -> StripeFileSystem:
        fs = fsspec.filesystem("stripefs", cluster=cluster.file)
        fs.invalidate_cache()
        return fs

    @pytest.fixture
    def fs_path(self, fs: StripeFileSystem, request: pytest.FixtureRequest) -> Iterator[str]:
        path = f"/fsspec-suite/{type(request.instance).__name__}-{next(_ids)}"
        fs.makedirs(path, exist_ok=True)
        yield path
        fs.rm(path, recursive=True)

    @pytest.fixture
    def fs_join(self) -> Callable[..., str]:
        return posixpath.join

    @pytest.fixture
    def supports_empty_directories(self) -> bool:
        return True


class TestStripeCopy(abstract.AbstractCopyTests, StripeFsFixtures):
    pass


class TestStripeGet(abstract.AbstractGetTests, StripeFsFixtures):
    pass


class TestStripePut(abstract.AbstractPutTests, StripeFsFixtures):
    pass


class TestStripePipe(abstract.AbstractPipeTests, StripeFsFixtures):
    pass


class TestStripeOpen(abstract.AbstractOpenTests, StripeFsFixtures):
    pass
