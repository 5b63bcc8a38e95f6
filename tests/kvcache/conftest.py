"""Helpers of the page store tests: pages whose bytes follow from their key, fresh namespaces."""

from __future__ import annotations

import itertools
import os

import pytest

from stripefs.bench.kvcache_soak import page_of  # the page stored under a key: any hit can be checked

__all__ = ["ns", "page_of"]

_names = itertools.count()


@pytest.fixture
def ns() -> str:
    """A namespace no other test uses."""
    return f"t{os.getpid()}-{next(_names)}"
