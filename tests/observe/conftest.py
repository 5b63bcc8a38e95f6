"""A cluster whose processes serve metrics on free ports (``STRIPEFS_METRICS`` inherited)."""

from __future__ import annotations

from typing import Any, Callable

import pytest


@pytest.fixture
def metered(make_cluster: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """A 2-server cluster whose metadata service and storage servers serve metrics."""
    monkeypatch.setenv("STRIPEFS_METRICS", "127.0.0.1:0")
    return make_cluster(servers=2)
