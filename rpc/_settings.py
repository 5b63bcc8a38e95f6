"""Settings a process reads from its environment."""

from __future__ import annotations

import logging
import os

__all__ = ["int_setting"]

log = logging.getLogger(__name__)


def int_setting(env: str, default: int) -> int:
    """An integer setting from the environment variable ``env`` (``default`` when unset or
    not a number, said in the log)."""
    raw = os.environ.get(env, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        log.warning("%s=%r is not a number: using %d", env, raw, default)
        return default
