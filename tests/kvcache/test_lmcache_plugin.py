"""The LMCache storage plugin (``stripefs.kvcache.lmcache``) on a real local cluster.

Driven through LMCache's own classes where LMCache is importable: its config with
``storage_plugins`` / ``extra_config``, its loader (``CreateStorageBackends``) building the
plugin from the module path and class name, its ``LocalCPUBackend`` allocating the memory
objects, its ``CacheEngineKey``. Where it is not (``pip install lmcache`` needs CUDA-only
packages -- cupy-cuda13x, nvtx, cufile, a CUDA torch -- and about 40 more, ~500 MB, that
the project does not install), the same tests run against small stand-ins written here for
LMCache's types, with the attribute names of its interface (``lmcache.v1``, 0.5.6):
``CacheEngineKey.to_string()``, ``MemoryObj.metadata`` (``shape``, ``dtype``, ``fmt``,
``shapes``, ``dtypes``), ``.byte_array``, ``.tensor``, ``.get_size()``,
``.ref_count_up/down()``, ``LocalCPUBackend.allocate(shapes, dtypes, fmt)`` and
``.get_full_chunk_size_bytes()``, and the loader's keyword arguments.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.testing import LocalCluster
from stripefs.kvcache import PageStore
from stripefs.kvcache.lmcache import HEADER, StripefsBackend, page_key

torch = pytest.importorskip("torch")

try:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends
    from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    REAL, WHY_NOT = True, ""
except ImportError as exc:
    REAL, WHY_NOT = False, f"LMCache is not importable here ({exc})"

LAYERS, TOKENS, HEADS, DIM = 2, 16, 2, 8  # a chunk: [2, LAYERS, TOKENS, HEADS * DIM] bfloat16
CHUNK = 2 * LAYERS * TOKENS * HEADS * DIM * 2
PAGE = HEADER + 4096  # the chunk's 2 KiB rounded up to 4 KiB


# -- stand-ins for LMCache's types (used only where LMCache is not importable) ----------------
@dataclass(frozen=True)
class StandInKey:
    """``CacheEngineKey``: what the plugin reads of it is ``to_string()``."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: Any

    def to_string(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.model_name}@{self.world_size}@{self.worker_id}@{self.chunk_hash:x}@{dtype}"


@dataclass
class StandInMeta:
    """``MemoryObjMetadata``: shape, dtype, fmt and the per-group shapes and dtypes."""

    shape: Any
    dtype: Any
    fmt: str
    shapes: list[Any] = field(default_factory=list)
    dtypes: list[Any] = field(default_factory=list)


class StandInObj:
    """``TensorMemoryObj``: a CPU tensor with metadata and a reference count."""

    def __init__(self, shape: Any, dtype: Any, fmt: str, owner: StandInCPUBackend):
        self.raw = torch.zeros(shape, dtype=dtype)
        self.metadata = StandInMeta(torch.Size(shape), dtype, fmt, [torch.Size(shape)], [dtype])
        self.owner, self.refs = owner, 1

    @property
    def tensor(self) -> Any:
        return self.raw

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.raw.reshape(-1).view(torch.uint8).numpy())

    def get_size(self) -> int:
        return int(self.raw.numel() * self.raw.element_size())

    def get_ref_count(self) -> int:
        return self.refs

    def ref_count_up(self) -> None:
        self.refs += 1

    def ref_count_down(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            self.owner.live -= 1


class StandInCPUBackend:
    """``LocalCPUBackend``: allocates memory objects, knows the full chunk size."""

    def __init__(self) -> None:
        self.live = 0

    def allocate(self, shapes: Any, dtypes: Any, fmt: str = "KV_2LTD") -> StandInObj:
        self.live += 1
        return StandInObj(shapes, dtypes, fmt, self)

    def get_full_chunk_size_bytes(self) -> int:
        return CHUNK


@dataclass
class StandInConfig:
    """``LMCacheEngineConfig``: the plugin reads ``extra_config``."""

    extra_config: dict[str, Any]
    chunk_size: int = TOKENS


# -- one harness over LMCache's classes or the stand-ins -----------------------------------------
def engine_chunk_values(seed: int, tokens: int = TOKENS) -> Any:
    """A chunk's values, the same for the same seed."""
    shape = torch.Size([2, LAYERS, tokens, HEADS * DIM])
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


class Engine:
    """Makes plugins the way LMCache does, keys, and memory objects filled with known bytes."""

    def __init__(self, cluster_file: str, namespace: str):
        self.cluster_file, self.namespace = cluster_file, namespace
        self.made: list[Any] = []
        self.loops: list[asyncio.AbstractEventLoop] = []
        self.cpu: Any = None

    def extra(self, **more: Any) -> dict[str, Any]:
        extra = {"storage_plugin.stripefs.module_path": "stripefs.kvcache.lmcache",
                 "storage_plugin.stripefs.class_name": "StripefsBackend",
                 "stripefs.cluster": self.cluster_file, "stripefs.namespace": self.namespace,
                 "stripefs.capacity": 64 * PAGE}
        extra.update({f"stripefs.{k}": v for k, v in more.items()})
        return extra

    def lmcache_config(self, **more: Any) -> tuple[Any, Any]:
        """LMCache's engine config (the plugin named in ``storage_plugins``) and metadata."""
        config = LMCacheEngineConfig.from_dict({
            "chunk_size": TOKENS, "local_cpu": True, "max_local_cpu_size": 0.01,
            "storage_plugins": ["stripefs"], "extra_config": self.extra(**more)})
        metadata = LMCacheMetadata(model_name="toy/model", world_size=1, local_world_size=1, worker_id=0,
                                   local_worker_id=0, kv_dtype=torch.bfloat16,
                                   kv_shape=(LAYERS, 2, TOKENS, HEADS, DIM), chunk_size=TOKENS)
        return config, metadata

    def backend(self, **more: Any) -> StripefsBackend:
        if REAL:
            config, metadata = self.lmcache_config(**more)
            self.loops.append(asyncio.new_event_loop())
            backends = CreateStorageBackends(config, metadata, self.loops[-1])
            self.made += list(backends.values())
            assert "stripefs" in backends, "LMCache's loader did not build the plugin (see its log)"
            self.cpu = backends["LocalCPUBackend"]
            plugin = backends["stripefs"]
            assert isinstance(plugin, StoragePluginInterface)
        else:
            self.cpu = StandInCPUBackend()
            plugin = StripefsBackend(config=StandInConfig(self.extra(**more)), metadata=None,
                                     local_cpu_backend=self.cpu, loop=None, dst_device="cpu")
            self.made.append(plugin)
        assert isinstance(plugin, StripefsBackend) and plugin.page_size == PAGE
        return plugin

    def key(self, n: int, worker: int = 0) -> Any:
        make = CacheEngineKey if REAL else StandInKey
        return make("toy/model", 1, worker, 0xC0FFEE00 + n, torch.bfloat16)

    def chunk(self, seed: int, tokens: int = TOKENS) -> Any:
        """A memory object of ``tokens`` tokens from LMCache's allocator, filled from ``seed``."""
        shape = torch.Size([2, LAYERS, tokens, HEADS * DIM])
        fmt = MemoryFormat.KV_2LTD if REAL else "KV_2LTD"
        obj = self.cpu.allocate(shape, torch.bfloat16, fmt)
        obj.tensor.copy_(engine_chunk_values(seed, tokens))
        return obj

    def close(self) -> None:
        for b in self.made:
            b.close()
        for loop in self.loops:
            loop.close()


@pytest.fixture
def engine(cluster: LocalCluster, ns: str) -> Iterator[Engine]:
    e = Engine(cluster.file, ns)
    yield e
    e.close()


def put(plugin: StripefsBackend, keys: list[Any], objs: list[Any]) -> list[Any]:
    """Put as LMCache's storage manager does (its reference dropped once submitted); the
    keys the plugin reported done through the callback, after the put finished."""
    done: list[Any] = []
    futures = plugin.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
    for obj in objs:
        obj.ref_count_down()
    for f in futures:
        f.result(timeout=60)
    return done


def same(a: Any, b: Any) -> bool:
    """The same chunk: shape, dtype, memory format and every value."""
    x, y = a.tensor, b.tensor
    return bool(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) and a.metadata.fmt == b.metadata.fmt)


# -- the tests ---------------------------------------------------------------------------------------
def test_chunks_round_trip_through_the_interface(engine: Engine) -> None:
    plugin = engine.backend()
    keys = [engine.key(i) for i in range(5)] + [engine.key(99)]
    objs = [engine.chunk(i) for i in range(5)] + [engine.chunk(99, tokens=5)]  # the last chunk is short
    expect = [engine.chunk(i) for i in range(5)] + [engine.chunk(99, tokens=5)]
    assert put(plugin, keys, objs) == keys
    assert [o.get_ref_count() for o in objs] == [0] * 6  # the plugin's hold is released
    assert all(plugin.contains(k) for k in keys) and not plugin.exists_in_put_tasks(keys[0])
    got = plugin.batched_get_blocking(keys + [engine.key(7)])
    assert got[-1] is None and all(same(g, e) for g, e in zip(got, expect))
    assert got[5].tensor.shape[2] == 5  # the short chunk comes back with its own shape
    one = plugin.get_blocking(keys[2])
    assert one is not None and same(one, expect[2])
    # LMCache's prefetch path: a lookup counts the stored prefix, the async get loads it.
    lookup = keys[:3] + [engine.key(7)] + keys[3:]
    assert plugin.batched_contains(lookup) == 3
    assert asyncio.run(plugin.batched_async_contains("req", lookup)) == 3
    loaded = asyncio.run(plugin.batched_get_non_blocking("req", lookup))
    assert len(loaded) == 3 and all(same(g, e) for g, e in zip(loaded, expect))
    s = plugin.stats()
    assert (s.puts, s.checksum_failures) == (6, 0) and s.hits >= 10
    # The key's name is its stable text, so another engine process finds the chunks.
    assert page_key(keys[0]) == hashlib.blake2b(keys[0].to_string().encode(), digest_size=32).digest()
    other = engine.backend()
    assert other.get_blocking(keys[4]) is not None and other.get_blocking(engine.key(4, worker=1)) is None


def test_a_put_of_stored_keys_skips_them(engine: Engine) -> None:
    plugin = engine.backend()
    assert put(plugin, [engine.key(1)], [engine.chunk(1)]) == [engine.key(1)]
    assert put(plugin, [engine.key(1), engine.key(2)], [engine.chunk(5), engine.chunk(2)]) == [engine.key(2)]
    assert same(plugin.get_blocking(engine.key(1)), engine.chunk(1))  # the first put's chunk stays
    assert plugin.stats().puts == 2


def test_contains_and_remove(engine: Engine) -> None:
    plugin = engine.backend()
    keys = [engine.key(i) for i in range(3)]
    put(plugin, keys, [engine.chunk(i) for i in range(3)])
    assert plugin.remove(keys[1]) and not plugin.remove(keys[1])
    assert [plugin.contains(k) for k in keys] == [True, False, True]
    assert plugin.get_blocking(keys[1]) is None and plugin.batched_contains(keys) == 1
    assert plugin.pin(keys[0]) and not plugin.pin(keys[1]) and plugin.unpin(keys[0])
    assert plugin.batched_remove(keys) == 2 and not any(plugin.contains(k) for k in keys)


def _segment(client: Client, store: PageStore, name: bytes) -> str:
    target = client.stat(store.ns.idx_path(name.hex()), follow=False).target
    assert target is not None
    return str(store.ns.seg_path(target.split(":")[0]))


def test_a_corrupted_or_foreign_page_is_a_miss_and_then_not_contained(engine: Engine, client: Client) -> None:
    plugin = engine.backend()
    keys = [engine.key(i) for i in range(3)]
    for k, i in zip(keys, range(3)):  # a segment each
        put(plugin, [k], [engine.chunk(i)])
    # A byte of the chunk rewritten through the file system (the storage checksums agree).
    with client.open(_segment(client, plugin.store, page_key(keys[0])), "r+b") as f:
        f.seek(HEADER + 10)
        f.write(b"\x00garbage")
    # A whole, well-checksummed page under key 1 whose header names key 2.
    page = bytearray(PAGE)
    plugin._assemble(keys[2], engine.chunk(2), memoryview(page))
    plugin.store.batch_put([page_key(keys[1])], [page])
    assert plugin.contains(keys[0]) and plugin.contains(keys[1])  # the index cannot tell yet
    assert plugin.batched_get_blocking(keys)[:2] == [None, None]
    assert plugin.stats().checksum_failures == 1
    assert [plugin.contains(k) for k in keys] == [False, False, True]  # a get's miss is remembered
    assert same(plugin.get_blocking(keys[2]), engine.chunk(2))


def test_eviction_under_capacity(engine: Engine) -> None:
    plugin = engine.backend(capacity=4 * PAGE)
    keys = [engine.key(i) for i in range(6)]
    for i, k in enumerate(keys):  # one segment each, the oldest evicted first
        assert put(plugin, [k], [engine.chunk(i)]) == [k]
    assert [plugin.contains(k) for k in keys] == [False, False, True, True, True, True]
    assert plugin.batched_get_blocking(keys[:2]) == [None, None]
    got = plugin.batched_get_blocking(keys[2:])  # in two store calls: 2 pages staged per call here
    assert len(got) == 4 and all(same(g, engine.chunk(i + 2)) for i, g in enumerate(got))
    assert len(asyncio.run(plugin.batched_get_non_blocking("r", keys[2:] + keys[:1]))) == 4
    assert len(asyncio.run(plugin.batched_get_non_blocking("r", keys[2:4] + keys[:1] + keys[4:]))) == 2
    s = plugin.stats()
    assert s.occupancy_bytes <= 4 * PAGE and s.evictions == 2


def test_a_chunk_too_big_for_a_page_is_refused_the_others_stored(engine: Engine,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    plugin = engine.backend()
    keys = [engine.key(1), engine.key(2), engine.key(3)]
    objs = [engine.chunk(1), engine.chunk(2, tokens=TOKENS * 3), engine.chunk(3)]
    with caplog.at_level(logging.ERROR, logger="stripefs.kvcache.lmcache"):
        assert put(plugin, keys, objs) == [keys[0], keys[2]]
    assert [plugin.contains(k) for k in keys] == [True, False, True] and plugin.failed_puts == 1
    assert "1 chunk(s) not stored" in caplog.text


def test_a_put_that_fails_is_not_claimed(make_cluster: Callable[..., LocalCluster], ns: str,
                                         caplog: pytest.LogCaptureFixture) -> None:
    h = make_cluster(servers=2)
    engine = Engine(h.file, ns)
    try:
        plugin = engine.backend(retry_for=1.0)
        assert put(plugin, [engine.key(0)], [engine.chunk(0)]) == [engine.key(0)]
        for s in h.data["servers"]:
            os.kill(s["pid"], signal.SIGKILL)
        keys = [engine.key(1), engine.key(2)]
        with caplog.at_level(logging.ERROR, logger="stripefs.kvcache.lmcache"):
            assert put(plugin, keys, [engine.chunk(1), engine.chunk(2)]) == []  # no callback either
        assert plugin.failed_puts == 2 and "2 chunk(s) not stored" in caplog.text
        assert [plugin.contains(k) for k in keys] == [False, False] and not plugin.exists_in_put_tasks(keys[0])
        assert plugin.stats().puts == 1
    finally:
        engine.close()


def test_puts_in_flight_are_known_and_held(engine: Engine) -> None:
    """A chunk handed to a put is ``exists_in_put_tasks`` until written, and its memory
    object stays referenced by the plugin until then (LMCache drops its own at once)."""
    plugin = engine.backend()
    gate = threading.Event()
    plugin._puts.submit(gate.wait, 30)  # the put thread busy: the next put waits behind it
    obj = engine.chunk(1)
    try:
        futures = plugin.batched_submit_put_task([engine.key(1)], [obj])
        obj.ref_count_down()
        assert plugin.exists_in_put_tasks(engine.key(1)) and obj.get_ref_count() == 1
        assert plugin.batched_submit_put_task([engine.key(1)], [obj])[0]  # in flight: skipped, not doubled
    finally:
        gate.set()
    assert futures[0].result(timeout=60) == [engine.key(1)]
    assert not plugin.exists_in_put_tasks(engine.key(1)) and obj.get_ref_count() == 0


@pytest.mark.skipif(not REAL, reason=WHY_NOT or "needs LMCache")
def test_lmcache_builds_the_plugin_from_its_config_alone(engine: Engine) -> None:
    plugin = engine.backend()
    assert type(plugin).__mro__[1] is StoragePluginInterface and str(plugin) == "StripefsBackend"
    assert plugin.get_allocator_backend() is engine.cpu


@pytest.mark.skipif(not REAL, reason=WHY_NOT or "needs LMCache")
def test_lmcache_storage_manager_puts_and_another_engine_gets(engine: Engine) -> None:
    """LMCache's own StorageManager (as its cache engine uses it) writes through the plugin;
    a second manager, with an empty CPU cache, loads the chunks from the cluster."""
    config, metadata = engine.lmcache_config()
    writer = StorageManager(config, metadata, EventManager())
    reader = None
    try:
        keys = [engine.key(i) for i in range(3)]
        objs = []
        for i in range(3):
            obj = writer.allocate(metadata.get_shapes()[0], torch.bfloat16, MemoryFormat.KV_2LTD)
            obj.tensor.copy_(engine_chunk_values(i))
            objs.append(obj)
        writer.batched_put(keys, objs)
        deadline = time.monotonic() + 30
        while not all(writer.contains(k, search_range=["stripefs"]) for k in keys):
            assert time.monotonic() < deadline, "the plugin's puts did not land"
            time.sleep(0.05)
        reader = StorageManager(config, metadata, EventManager())
        assert [reader.contains(k, search_range=["LocalCPUBackend"]) for k in keys] == [None] * 3
        got = reader.batched_get(keys, location="stripefs")
        assert all(g is not None and torch.equal(g.tensor, engine_chunk_values(i)) for i, g in enumerate(got))
        for g in got:
            g.ref_count_down()
    finally:
        writer.close()
        if reader is not None:
            reader.close()
