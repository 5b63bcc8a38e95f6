"""The store's counters: what ``PageStore.stats()`` returns."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

__all__ = ["StoreStats", "Counters"]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters of one :class:`PageStore` (this process), and the namespace's occupancy.

    ``misses`` counts every page asked for and not returned; ``expired``,
    ``checksum_failures`` and ``read_errors`` are the misses for those reasons (a page
    that was found but failed its checks, or whose read failed). ``evictions`` are
    pages in segments this process evicted. ``occupancy_bytes`` and ``segments`` are
    the whole namespace's, from the metadata service when ``stats()`` was called.
    """

    hits: int = 0
    misses: int = 0
    expired: int = 0
    checksum_failures: int = 0
    read_errors: int = 0
    puts: int = 0
    bytes_in: int = 0  # page bytes stored by batch_put
    bytes_out: int = 0  # page bytes returned by batch_get_into
    evictions: int = 0
    evicted_segments: int = 0
    reclaimed_segments: int = 0
    occupancy_bytes: int = 0
    segments: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Counters:
    """Thread-safe running totals of the :class:`StoreStats` counter fields."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: 0 for f in fields(StoreStats)}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._values[name] += n

    def snapshot(self, **current: int) -> StoreStats:
        with self._lock:
            return StoreStats(**{**self._values, **current})
