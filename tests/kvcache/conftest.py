"""Helpers of the page store tests: pages whose bytes follow from their key, fresh namespaces."""

from __future__ import annotations

import itertools
import os
import random

import pytest

_names = itertools.count()


def page_of(key: bytes, size: int) -> bytes:
    """The page a test stores under ``key``: any hit can be checked against it."""
    return random.Random(key).randbytes(size)


@pytest.fixture
def ns() -> str:
    """A namespace no other test uses."""
    return f"t{os.getpid()}-{next(_names)}"
