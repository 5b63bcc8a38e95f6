"""The ``kvcache`` workload: the shared-storage tier of an inference server's KV cache.

Every client plays the same game against one page store whose capacity is smaller than the
key space, so pages are evicted: each round it draws a batch of ``kv_batch`` distinct keys
from a Zipf distribution (exponent 1.2, a fixed seed per client) over ``kv_keys`` keys, gets
them into one reused buffer, and puts the pages that missed, as a serving engine admits what
it had to recompute. Pages are ``kv_page`` bytes, the same for the whole run. ``kv_warmup``
rounds are played untimed, then ``kv_rounds`` measured ones (either, when not given: as many
as ``duration`` seconds allow, at least one). Records:

=================  ===================================================================
kvcache_get        GB/s of the hits into the get buffer, pages looked up per second,
                   p50/p99 per batch; ``hits``, ``misses``, ``hit_ratio``,
                   ``verified_pages``, ``checksum_failures``, ``read_errors``,
                   ``pinned_clients`` (clients whose buffer was pinned memory)
kvcache_put        GB/s and pages per second of the pages put back, p50/p99 per batch
                   (batches with at least one miss); ``evictions`` (pages)
=================  ===================================================================

What holds the pages, by route (``bench._kvcache_pages``): on ``native``, ``zerocopy`` and
``fsspec`` the real :class:`~stripefs.kvcache.PageStore` over the route's client (one store
whichever way in: the zerocopy and fsspec records repeat native's, as the batched metadata
records do), its capacity ``kv_capacity`` for all clients together; on ``local_disk`` and
the peers' mounts one file per page (write, fsync, rename; ``O_DIRECT`` reads on 64 threads;
each client evicting the least recently used of the pages it wrote, keeping ``kv_capacity /
clients``); ``fuse`` and ``s3fs`` are skipped, with the reason in the report.

The clients move in lock step: every get and every put phase starts at a barrier and ends
at the next, so a record's ``seconds`` is the summed wall time of its phases (the slowest
client's), not the span of the whole workload, and gets never overlap puts. Before each get,
``exists`` is asked for the same keys (untimed): nothing is put between the two, so a hit
the lookup did not announce is an error.

Verification: each page is the bench's pattern (``bench._pattern``, a ``kv_page`` block)
stamped with an id of its key, so a page of another key, of another offset or zeros fails.
Every hit's stamps are checked and every 8th hit is compared byte for byte (the store has
also checked its CRC32C); a short read is an error.

Caveats:
    * The get buffer is pinned memory (``torch.empty(..., pin_memory=True)``) when
      ``torch.cuda.is_available()``, else page-aligned anonymous memory; GPU copies are not
      part of the measurement.
    * Gets are not cold: recently put pages sit in the storage servers' page cache, as they
      would in serving. POSIX reads are ``O_DIRECT`` (no client cache answers them).
    * The POSIX baseline evicts per client by its own accesses; the store evicts whole
      segments by their shared recency. Hit ratios differ a little for that reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._kvcache_pages import Pages, open_pages, remove_pages
from ._pattern import Pattern, VerifyError, file_id
from ._sessions import Session
from ._workloads import ClientContext, PartResult, aligned, clock

__all__ = ["KvcacheConfig", "kvcache", "kvcache_cleanup", "kvcache_finish", "PARTS"]

PARTS = ["kvcache_get", "kvcache_put"]
ZIPF, SEED = 1.2, 3300
EXACT_EVERY = 8  # hits compared byte for byte: every 8th (stamps: every hit)
MIN_PAGE, MAX_PAGE, MIN_BATCH, MAX_BATCH = 256 << 10, 2 << 20, 32, 256  # the ranges


@dataclass(frozen=True)
class KvcacheConfig:
    """The workload's knobs: a run's ``kv_*`` settings (``BenchConfig``, ``--kv-*`` flags).

    ``capacity`` None: a quarter of the key space, or a batch per client if more;
    ``rounds`` (measured) and ``warmup`` (untimed) None: batches for ``--duration`` seconds
    each (at least one), else that many batches per client.
    """

    page: int
    batch: int
    keys: int
    capacity: int | None
    rounds: int | None
    warmup: int | None

    @classmethod
    def of(cls, settings: dict[str, Any]) -> "KvcacheConfig":
        """From a task or a ``BenchConfig.__dict__`` (its ``kv_*`` keys)."""
        return cls(**{f: settings[f"kv_{f}"] for f in cls.__dataclass_fields__})

    def capacity_bytes(self, clients: int) -> int:
        if self.capacity is not None:
            return self.capacity
        return max(self.keys // 4, clients * self.batch) * self.page

    def check(self, clients: int) -> None:
        """Raises ValueError for a shape the issue does not allow or that cannot evict."""
        if not MIN_PAGE <= self.page <= MAX_PAGE or self.page % 4096:
            raise ValueError(f"--kv-page must be a multiple of 4 KiB in 256 KiB..2 MiB, not {self.page}")
        if not MIN_BATCH <= self.batch <= MAX_BATCH:
            raise ValueError(f"--kv-batch must be in {MIN_BATCH}..{MAX_BATCH}, not {self.batch}")
        if self.keys < 2 * self.batch or (self.rounds is not None and self.rounds < 1) \
                or (self.warmup is not None and self.warmup < 0):
            raise ValueError("--kv-keys must be at least twice --kv-batch, --kv-rounds >= 1, --kv-warmup >= 0")
        if not clients * self.batch * self.page <= self.capacity_bytes(clients) < self.keys * self.page:
            raise ValueError(f"the kvcache capacity must hold a batch per client ({clients} x {self.batch} "
                             f"pages) and be smaller than the key space ({self.keys} pages, --kv-keys), "
                             "so that pages are evicted")


def _page_id(k: int) -> int:
    """The id stamped into every 4 KiB of key ``k``'s page."""
    return file_id(f"kvcache/{k}")


def _gpu_driver() -> bool:
    """Whether a GPU driver is loaded (NVIDIA, or ROCm's ``/dev/kfd``): without one
    ``torch.cuda`` cannot be available, and importing torch to learn that takes seconds."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd"))


def _pinned(n: int) -> memoryview | None:
    """``n`` bytes of pinned (page-locked) host memory when ``torch.cuda`` is available."""
    if not _gpu_driver():
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy().data  # a memoryview (it keeps the tensor)


def _get_buffer(n: int) -> tuple[memoryview, bool]:
    """``n`` bytes to get pages into, and whether they are pinned."""
    pinned = _pinned(n)
    return (pinned, True) if pinned is not None else (aligned(n), False)


def _draw(rng: np.random.Generator, cfg: KvcacheConfig) -> list[int]:
    """``cfg.batch`` distinct keys, in the order drawn (a batch never names a key twice)."""
    seen: dict[int, None] = {}
    while len(seen) < cfg.batch:
        for k in (rng.zipf(ZIPF, cfg.batch) - 1) % cfg.keys:
            seen.setdefault(int(k), None)
            if len(seen) == cfg.batch:
                break
    return list(seen)


class _Phases:
    """Lock-step timing: a phase runs between two barriers, so its wall time is the slowest
    client's and the same for every client."""

    def __init__(self, ctx: ClientContext):
        self.ctx = ctx

    def run(self, part: PartResult | None, op: Any, *args: Any, lat: bool = True) -> Any:
        """Run ``op(*args)`` as one phase. With ``part``: ``part.t1`` moves on by the phase's
        wall time and, with ``lat``, this client's time in ``op`` joins the latencies."""
        self.ctx.wait()
        t = clock()
        out = op(*args)
        done = clock()
        self.ctx.wait()
        if part is not None:
            part.t1 += clock() - t
            if lat:
                part.lat.append(done - t)
        return out


def kvcache(s: Session, task: dict[str, Any], ctx: ClientContext) -> dict[str, PartResult]:
    cfg = KvcacheConfig.of(task)
    cfg.check(ctx.clients)
    pages = open_pages(s, task.get("route", ""), task["tag"], cfg.page, cfg.capacity_bytes(ctx.clients), ctx)
    try:
        return _Game(pages, cfg, ctx, task["duration"]).play()
    finally:
        pages.close()


class _Game:
    """One client's rounds: draw, look up, get, check, put back what missed."""

    def __init__(self, pages: Pages, cfg: KvcacheConfig, ctx: ClientContext, duration: float):
        self.pages, self.cfg, self.ctx, self.duration = pages, cfg, ctx, duration
        ps = cfg.page
        got, self.pinned = _get_buffer(cfg.batch * ps)
        staging = aligned(cfg.batch * ps)
        self.slots = [got[i * ps:(i + 1) * ps] for i in range(cfg.batch)]
        self.staged = [staging[i * ps:(i + 1) * ps] for i in range(cfg.batch)]
        self.pattern, self.rng = Pattern(ps), np.random.default_rng(SEED + ctx.index)
        self.phases = _Phases(ctx)
        self.get, self.put = PartResult(), PartResult()
        self.counts = {"hits": 0, "misses": 0, "verified_pages": 0, "exists_not_got": 0}
        self.checked = 0  # hits checked so far, warm-up included (picks the exact sample)

    def play(self) -> dict[str, PartResult]:
        try:
            self._rounds(self.cfg.warmup, measured=False)
            before = self.pages.counts()
            self.ctx.wait()
            self.get.t0 = self.get.t1 = self.put.t0 = self.put.t1 = clock()
            self._rounds(self.cfg.rounds, measured=True)
            after = self.pages.counts()
        finally:
            self.pattern.close()
        self.get.counts = {**self.counts, "pinned_clients": int(self.pinned),
                           **{k: after[k] - before[k] for k in ("checksum_failures", "read_errors")}}
        self.put.counts = {"evictions": after["evictions"] - before["evictions"]}
        return {"kvcache_get": self.get, "kvcache_put": self.put}

    def _rounds(self, count: int | None, measured: bool) -> None:
        """``count`` rounds; None: rounds for ``duration`` seconds (at least one), as the
        first client decides. It raises the task's shared flag (``writers_done``, which the
        pool clears for every task) before a barrier; every client reads it after."""
        if count is not None:
            for _ in range(count):
                self._round(measured)
            return
        flag = self.ctx.writers_done
        if self.ctx.index == 0:  # everyone read the previous verdict before the barrier just passed
            flag.value = 0
        self.ctx.wait()
        end = clock() + self.duration
        while True:
            self._round(measured)
            if self.ctx.index == 0 and clock() >= end:
                flag.value = 1
            self.ctx.wait()
            if flag.value:
                return

    def _round(self, measured: bool) -> None:
        ps, keys = self.cfg.page, _draw(self.rng, self.cfg)
        listed = self.pages.exists(keys)  # untimed; nothing is put between it and the get
        hits = self.phases.run(self.get if measured else None, self.pages.get_into, keys, self.slots)
        exact = self._check(keys, listed, hits, measured)
        missed = [k for k, h in zip(keys, hits) if not h]
        for k, view in zip(missed, self.staged):
            view[:] = self.pattern.stamped(_page_id(k), 0, ps)
        part = self.put if measured else None
        if missed:
            self.phases.run(part, self.pages.put, missed, self.staged[:len(missed)])
        else:  # the others may be putting: keep in step, with no latency for nothing done
            self.phases.run(part, lambda: None, lat=False)
        if measured:
            found = sum(hits)
            self.counts["hits"] += found
            self.counts["misses"] += len(keys) - found
            self.get.ops, self.get.nbytes = self.get.ops + len(keys), self.get.nbytes + found * ps
            self.get.verified += exact
            self.put.ops, self.put.nbytes = self.put.ops + len(missed), self.put.nbytes + len(missed) * ps
            self.ctx.add((found + len(missed)) * ps)

    def _check(self, keys: list[int], listed: list[bool], hits: list[bool], measured: bool) -> int:
        """Check every hit's page (stamps; every ``EXACT_EVERY``-th byte for byte) and that
        ``exists`` announced it; returns the bytes compared exactly.

        Raises:
            VerifyError: a page holds other bytes, or a hit was not announced.
        """
        exact = 0
        for k, was, hit, view in zip(keys, listed, hits, self.slots):
            if hit and not was:
                raise VerifyError(f"kvcache: key {k} was got, but exists() had just said it was not there")
            if hit:
                exact += self.pattern.check(view, _page_id(k), 0, exact=self.checked % EXACT_EVERY == 0)
                self.checked += 1
            if measured:
                self.counts["verified_pages"] += hit
                self.counts["exists_not_got"] += was and not hit
        return exact


def kvcache_finish(recs: list[dict[str, Any]]) -> None:
    """``hit_ratio`` on the get record, from the hits and misses of every client."""
    for r in recs:
        if r["workload"] == "kvcache_get":
            asked = r.get("hits", 0) + r.get("misses", 0)
            r["hit_ratio"] = r.get("hits", 0) / asked if asked else 0.0


def kvcache_cleanup(s: Session, task: dict[str, Any], ctx: ClientContext) -> None:
    """Remove the task's pages (the first client; the footprint of repeated runs stays bounded)."""
    if not ctx.index:
        remove_pages(s, task["tag"])
