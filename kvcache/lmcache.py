"""An LMCache storage plugin: LMCache's KV chunks in a stripefs KV-cache namespace.

LMCache (0.5.x, ``lmcache.v1``) loads storage backends named in its ``storage_plugins``
setting from a module path and a class name in ``extra_config``, with no patch to LMCache
(``lmcache.v1.storage_backend.storage_plugin_launcher``)::

    chunk_size: 256
    local_cpu: true                     # the plugin allocates its gets from LocalCPUBackend
    max_local_cpu_size: 5
    storage_plugins: ["stripefs"]
    extra_config:
      storage_plugin.stripefs.module_path: stripefs.kvcache.lmcache
      storage_plugin.stripefs.class_name: StripefsBackend
      stripefs.cluster: /etc/stripefs/cluster.json   # else $STRIPEFS_CLUSTER / the last `stripefs up`
      stripefs.capacity: 200G                        # bytes of pages the namespace holds
      stripefs.namespace: llama3-70b-tp8             # optional (see PluginConfig)

Each chunk is one page of a :class:`~stripefs.kvcache.PageStore`, named by the BLAKE2b-256
of LMCache's own text of its key (``CacheEngineKey.to_string()``, stable across processes,
unlike ``hash()``): ``[header, HEADER bytes][the chunk's bytes]``, the header holding the
key's text (checked on every get) and the chunk's shapes, dtypes and memory format (so a
get can allocate it again). A put is reported done (``on_complete_callback``) only for
chunks the store stored; a get that misses drops the key's index entry, so ``contains``
agrees with gets; a store that cannot be reached answers misses, never an exception into
the engine. docs/kvcache.md has the configuration keys and what was tested.

Caveats:
    * A get copies each chunk once: from the page read into a staging buffer to the
      memory object LMCache's allocator gives, which can only be asked for once the
      header (shape, dtype) is read. A put copies twice (page assembly, then the store's
      segment staging).
    * ``pin``/``unpin`` are answers, not promises: the namespace is shared by every
      process of the cluster and evicts by segment age; a chunk found by a lookup may be
      evicted before its get (the get then returns fewer chunks, which LMCache tolerates).
    * ``cached_positions`` (CacheBlend) is not kept; memory objects must live in host
      memory (LMCache's ``LocalCPUBackend`` allocates them there).
    * Deleting a missed key races with another process putting it again: at worst a
      fresh page's index entry is removed (a miss later, never wrong bytes).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stripefs.fsclient import Client
from stripefs.wire import StripefsError

from ._namespace import ROOT
from ._store import PageStore

if TYPE_CHECKING:
    _Base = object
else:
    try:  # LMCache installed: its loader gets a real subclass of its interface
        from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface as _Base
    except ImportError:  # not installed: the same methods, called by duck typing
        _Base = object

__all__ = ["HEADER", "PluginConfig", "StripefsBackend", "key_text", "page_key"]

log = logging.getLogger("stripefs.kvcache.lmcache")

HEADER = 4096  # bytes before a chunk's bytes in its page
STAGING = 256 << 20  # bytes of pages staged per store call, at most (a long prompt has many chunks)
_HEAD = struct.Struct("<4sHHIQ")  # magic, version, flags, length of the JSON after it, chunk bytes
_MAGIC, _VERSION = b"SFLM", 1
_ALIGN = 4096


# -- configuration --------------------------------------------------------------------------
def _size(value: Any) -> int:
    """``200G``, ``512M``, ``4096`` or a number of bytes (binary units)."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"stripefs.capacity: not a size: {value!r}")
    return int(float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2).lower() or " "))))


@dataclass(frozen=True)
class PluginConfig:
    """The plugin's settings, from LMCache's ``extra_config`` (keys ``stripefs.*``).

    Attributes:
        cluster: ``stripefs.cluster``: a cluster.json path or ``host:port``; None finds
            the cluster as ``Client()`` does ($STRIPEFS_CLUSTER, the last ``stripefs up``).
        namespace: ``stripefs.namespace``; default ``lmcache-<model>-<page size>``, so
            engines with another chunk layout never share (nor clash over) a namespace.
        capacity: ``stripefs.capacity``: page bytes the namespace holds (``200G``); 64 GiB.
        ttl: ``stripefs.ttl``: seconds a chunk lives; None: until evicted.
        page_size: ``stripefs.page_size``: overrides the size derived from the chunk shape.
        root: ``stripefs.root``: the directory of the namespaces (the store's default).
        retry_for: ``stripefs.retry_for``: the client's retry budget in seconds.
    """

    cluster: str | None = None
    namespace: str | None = None
    capacity: int = 64 << 30
    ttl: float | None = None
    page_size: int | None = None
    root: str | None = None
    retry_for: float | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> PluginConfig:
        extra = extra or {}

        def get(name: str, convert: Callable[[Any], Any]) -> Any:
            value = extra.get(f"stripefs.{name}")
            return None if value is None or value == "" else convert(value)

        return cls(cluster=get("cluster", str), namespace=get("namespace", str),
                   capacity=get("capacity", _size) or cls.capacity, ttl=get("ttl", float),
                   page_size=get("page_size", _size), root=get("root", str), retry_for=get("retry_for", float))


# -- keys and pages -------------------------------------------------------------------------
def key_text(key: Any) -> str:
    """LMCache's stable text of a key (``model@world@worker@hash@dtype[@layer][@tags]``)."""
    return str(key.to_string())


def page_key(key: Any) -> bytes:
    """The store key of an LMCache key: BLAKE2b-256 of its text (within the store's 127 bytes)."""
    return hashlib.blake2b(key_text(key).encode(), digest_size=32).digest()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> Any:
    import torch  # LMCache runs on torch; the plugin needs it only for the dtypes

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")  # noqa: TRY004 -- a bad value read from a page
    return dtype


def _memory_format(name: str) -> Any:
    """LMCache's ``MemoryFormat`` member of that name (without LMCache, the name itself)."""
    try:
        from lmcache.v1.memory_management import MemoryFormat
    except ImportError:
        return name
    return MemoryFormat[name]


def _bytes_of(obj: Any) -> memoryview:
    """The chunk's bytes in a memory object, as a flat writable byte view (no copy)."""
    view = memoryview(obj.byte_array)
    view = view if view.format == "B" else view.cast("B")
    if len(view) != obj.get_size():
        raise ValueError(f"a memory object of {obj.get_size()} bytes shows {len(view)}")
    return view


class _BadPage(ValueError):
    """A page read whole whose header does not describe the chunk asked for."""


@dataclass(frozen=True)
class _Layout:
    """What a get needs to allocate a chunk again, and whose chunk it is."""

    key: str
    shapes: list[list[int]]
    dtypes: list[str]
    fmt: str
    nbytes: int

    @classmethod
    def of(cls, key: Any, obj: Any) -> _Layout:
        meta = obj.metadata
        shapes = meta.shapes if meta.shapes else [meta.shape]
        dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
        fmt = getattr(meta.fmt, "name", str(meta.fmt))
        return cls(key_text(key), [list(s) for s in shapes], [_dtype_name(d) for d in dtypes], fmt, obj.get_size())

    def encode(self, into: memoryview) -> None:
        body = json.dumps({"key": self.key, "shapes": self.shapes, "dtypes": self.dtypes, "fmt": self.fmt},
                          separators=(",", ":")).encode()
        if _HEAD.size + len(body) > HEADER:
            raise ValueError(f"the header of {self.key!r} takes {len(body)} bytes, more than {HEADER}")
        _HEAD.pack_into(into, 0, _MAGIC, _VERSION, 0, len(body), self.nbytes)
        into[_HEAD.size:_HEAD.size + len(body)] = body
        into[_HEAD.size + len(body):HEADER] = bytes(HEADER - _HEAD.size - len(body))

    @classmethod
    def decode(cls, head: memoryview) -> _Layout:
        magic, version, _flags, length, nbytes = _HEAD.unpack_from(head, 0)
        if magic != _MAGIC or version != _VERSION or _HEAD.size + length > HEADER:
            raise ValueError("not a stripefs LMCache page header")
        d = json.loads(bytes(head[_HEAD.size:_HEAD.size + length]))
        return cls(str(d["key"]), [list(map(int, s)) for s in d["shapes"]], [str(t) for t in d["dtypes"]],
                   str(d["fmt"]), int(nbytes))


def _chunk_bytes(config: Any, metadata: Any, local_cpu_backend: Any) -> int:
    """LMCache's full chunk size in bytes: its CPU backend's figure, else the metadata's shapes."""
    if local_cpu_backend is not None and hasattr(local_cpu_backend, "get_full_chunk_size_bytes"):
        return int(local_cpu_backend.get_full_chunk_size_bytes())
    if metadata is None:
        raise ValueError("StripefsBackend needs LMCache's metadata (or stripefs.page_size) to size its pages")
    shapes, dtypes = metadata.get_shapes(), metadata.get_dtypes()
    return sum(int(s.numel()) * d.itemsize for s, d in zip(shapes, dtypes))


# -- the backend ----------------------------------------------------------------------------
class StripefsBackend(_Base):
    """LMCache's ``StoragePluginInterface`` over one stripefs KV-cache namespace.

    Constructed by LMCache's plugin loader with keyword arguments (config, metadata,
    local_cpu_backend, loop, dst_device); settings from ``config.extra_config``
    (:class:`PluginConfig`). Puts run on one background thread of the plugin's (a batch of
    chunks per store call); gets run on the caller's thread (blocking) or a worker thread
    (the ``async`` methods).

    Raises:
        ValueError: no way to size the pages (no metadata, no ``stripefs.page_size``).
        StripefsError: the cluster cannot be reached, or the namespace has another page size.
    """

    def __init__(self, config: Any = None, metadata: Any = None, local_cpu_backend: Any = None,
                 loop: asyncio.AbstractEventLoop | None = None, dst_device: str = "cpu"):
        # The interface's constructor only keeps these (and checks the device name): done
        # here alike, so that the class also works where LMCache is not installed.
        self.dst_device, self.config, self.metadata = dst_device, config, metadata
        self.local_cpu_backend, self.loop = local_cpu_backend, loop
        self.settings = PluginConfig.from_extra(getattr(config, "extra_config", None))
        s = self.settings
        payload = s.page_size - HEADER if s.page_size else _chunk_bytes(config, metadata, local_cpu_backend)
        self.page_size = HEADER + -(-payload // _ALIGN) * _ALIGN
        model = getattr(metadata, "model_name", None) or "model"
        namespace = s.namespace or f"lmcache-{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}-{self.page_size}"
        self._client = Client(s.cluster, retry_for=s.retry_for)
        try:
            self.store = PageStore(self._client, namespace, self.page_size, s.capacity, s.ttl, root=s.root or ROOT)
        except BaseException:
            self._client.close()
            raise
        # Pages per store call: within the staging bound, and less than the capacity holds.
        self._batch = max(1, min(s.capacity // self.page_size // 2, STAGING // self.page_size))
        self._puts = ThreadPoolExecutor(1, thread_name_prefix="stripefs-lmcache-put")
        self._gets = ThreadPoolExecutor(2, thread_name_prefix="stripefs-lmcache-get")  # get_non_blocking
        self._inflight: set[bytes] = set()
        self._lock = threading.Lock()
        self.failed_puts = 0  # chunks handed to a put and not stored

    def __str__(self) -> str:
        return "StripefsBackend"

    # -- lookups ---------------------------------------------------------------------------
    def contains(self, key: Any, pin: bool = False) -> bool:
        """Whether a get would find the chunk now (``pin`` is ignored: see the caveats)."""
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        """How many of ``keys``, from the first, are stored (one index lookup for all)."""
        try:
            found = self.store.exists([page_key(k) for k in keys])
        except StripefsError as exc:
            log.warning("stripefs: lookup of %d keys failed, answering none: %s", len(keys), exc)
            return 0
        return found.index(False) if False in found else len(found)

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys, pin)

    def exists_in_put_tasks(self, key: Any) -> bool:
        with self._lock:
            return page_key(key) in self._inflight

    def pin(self, key: Any) -> bool:
        """Whether the chunk is there; nothing is held (the namespace is shared)."""
        return self.contains(key)

    def unpin(self, key: Any) -> bool:
        return self.contains(key)

    def touch_cache(self) -> None:
        """Nothing to do: a get moves its segment's recency forward itself."""

    # -- puts --------------------------------------------------------------------------------
    def batched_submit_put_task(self, keys: Sequence[Any], objs: list[Any], transfer_spec: Any = None,
                                on_complete_callback: Callable[[Any], None] | None = None) -> list[Future[list[Any]]]:
        """Store the chunks in the background; returns one future, whose result is the list
        of keys stored by this call (keys already stored or in flight are skipped).

        The objects are held (``ref_count_up``) until written: LMCache releases its
        reference when this returns.
        """
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys for {len(objs)} memory objects")
        todo: list[tuple[Any, bytes, Any]] = []
        with self._lock:
            for key, obj in zip(keys, objs):
                name = page_key(key)
                if name not in self._inflight:
                    self._inflight.add(name)
                    todo.append((key, name, obj))
        for _key, _name, obj in todo:
            obj.ref_count_up()
        return [self._puts.submit(self._put, todo, on_complete_callback)]

    async def async_batched_submit_put_task(self, keys: Sequence[Any], objs: list[Any], transfer_spec: Any = None,
                                            on_complete_callback: Callable[[Any], None] | None = None) -> None:
        for future in self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback):
            await asyncio.wrap_future(future)

    def _put(self, todo: list[tuple[Any, bytes, Any]], callback: Callable[[Any], None] | None) -> list[Any]:
        try:
            stored = self._store_all(todo)
        finally:
            with self._lock:
                self._inflight.difference_update(name for _key, name, _obj in todo)
            for _key, _name, obj in todo:
                obj.ref_count_down()
        for key in stored:
            try:
                if callback is not None:
                    callback(key)
            except Exception:  # LMCache's callback failing is its own matter: logged, not raised
                log.exception("stripefs: on_complete_callback failed for %s", key_text(key))
        return stored

    def _store_all(self, todo: list[tuple[Any, bytes, Any]]) -> list[Any]:
        """Store what is not stored yet, a batch per store call; the keys newly stored."""
        try:
            present = self.store.exists([name for _key, name, _obj in todo])
        except StripefsError as exc:
            self._failed(len(todo), "the lookup before a put failed", exc)
            return []
        todo = [t for t, there in zip(todo, present) if not there]
        stored: list[Any] = []
        for start in range(0, len(todo), self._batch):
            stored += self._store_batch(todo[start:start + self._batch])
        return stored

    def _store_batch(self, batch: list[tuple[Any, bytes, Any]]) -> list[Any]:
        buf = self._client.buffers.get(len(batch) * self.page_size)
        whole = memoryview(buf)
        try:
            keys: list[Any] = []
            names: list[bytes] = []
            pages: list[memoryview] = []
            for key, name, obj in batch:
                page = whole[len(pages) * self.page_size:(len(pages) + 1) * self.page_size]
                try:
                    self._assemble(key, obj, page)
                except (ValueError, TypeError, AttributeError) as exc:
                    self._failed(1, f"chunk {key_text(key)} refused", exc)
                    continue
                keys.append(key)
                names.append(name)
                pages.append(page)
            if not pages:
                return []
            try:
                self.store.batch_put(names, pages)
                return keys
            except StripefsError as exc:
                there = self._exists_or_none(names)
                self._failed(len(names) - sum(there), "a put failed", exc)
                return [k for k, ok in zip(keys, there) if ok]
        finally:
            whole.release()
            self._client.buffers.put(buf)

    def _assemble(self, key: Any, obj: Any, page: memoryview) -> None:
        """Header and chunk bytes into ``page``; ValueError for a chunk that does not fit."""
        data = _bytes_of(obj)
        if len(data) > self.page_size - HEADER:
            raise ValueError(f"{len(data)} bytes, more than the {self.page_size - HEADER} of a page")
        _Layout.of(key, obj).encode(page[:HEADER])
        page[HEADER:HEADER + len(data)] = data
        page[HEADER + len(data):] = bytes(len(page) - HEADER - len(data))

    def _exists_or_none(self, names: list[bytes]) -> list[bool]:
        """Which pages are stored, after a put failed part-way (none, if that cannot be known)."""
        try:
            return self.store.exists(names)
        except StripefsError:
            return [False] * len(names)

    def _failed(self, count: int, what: str, exc: BaseException) -> None:
        with self._lock:
            self.failed_puts += count
        log.error("stripefs: %s: %d chunk(s) not stored: %s", what, count, exc)

    # -- gets --------------------------------------------------------------------------------
    def get_blocking(self, key: Any) -> Any:
        return self._get([key], prefix=False)[0]

    def batched_get_blocking(self, keys: list[Any]) -> list[Any]:
        """The chunks of ``keys``, None where missing (aligned with ``keys``)."""
        return self._get(keys, prefix=False)

    def get_non_blocking(self, key: Any, location: str | None = None) -> Future[Any] | None:
        return self._gets.submit(self.get_blocking, key) if self.contains(key) else None

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any], transfer_spec: Any = None) -> list[Any]:
        """The chunks of ``keys`` up to the first missing one (LMCache loads a prefix)."""
        return await asyncio.to_thread(self._get, keys, prefix=True)

    def _get(self, keys: list[Any], *, prefix: bool) -> list[Any]:
        """A memory object per key, None for a miss; with ``prefix``, only those before
        the first miss. One store call per group of keys that fits the staging bound."""
        out: list[Any] = []
        for start in range(0, len(keys), self._batch):
            part = self._get_group(keys[start:start + self._batch], prefix=prefix)
            out += part
            if prefix and len(part) < len(keys[start:start + self._batch]):
                break
        return out

    def _get_group(self, keys: list[Any], *, prefix: bool) -> list[Any]:
        """One store get for all ``keys``, then a memory object per hit (up to the first
        miss with ``prefix``, which leaves the rest out). Misses are forgotten (see caveats)."""
        names = [page_key(k) for k in keys]
        buf = self._client.buffers.get(len(keys) * self.page_size)
        whole = memoryview(buf)
        try:
            pages = [whole[i * self.page_size:(i + 1) * self.page_size] for i in range(len(keys))]
            try:
                hits = self.store.batch_get_into(names, pages)
            except StripefsError as exc:
                log.warning("stripefs: get of %d chunks failed, answering misses: %s", len(keys), exc)
                hits = [False] * len(keys)
            out, bad = self._objects(keys, pages, hits, prefix)
        finally:
            whole.release()
            self._client.buffers.put(buf)
        if bad:
            self._forget([names[i] for i in bad])
        return out

    def _objects(self, keys: list[Any], pages: list[memoryview], hits: list[bool],
                 prefix: bool) -> tuple[list[Any], list[int]]:
        """Per key, a memory object rebuilt from its page or None; and the indexes of the
        pages that cannot be used (missed, or rejected)."""
        out: list[Any] = []
        bad = [i for i, hit in enumerate(hits) if not hit]
        for i, (key, page, hit) in enumerate(zip(keys, pages, hits)):
            obj = None
            if hit:
                try:
                    obj = self._rebuild(key, page)
                except _BadPage as exc:
                    log.warning("stripefs: page of %s rejected: %s", key_text(key), exc)
                    bad.append(i)
            if obj is None and prefix:
                break
            out.append(obj)
        return out, bad

    def _rebuild(self, key: Any, page: memoryview) -> Any:
        """The memory object of a page read whole; None if LMCache's allocator has no room.

        Raises:
            _BadPage: the header does not decode, names another key, or a size that does not fit.
        """
        try:
            layout = _Layout.decode(page[:HEADER])
            if layout.key != key_text(key) or layout.nbytes > len(page) - HEADER:
                raise ValueError(f"the page holds {layout.key!r}, {layout.nbytes} bytes")
            shapes = [self._torch_size(s) for s in layout.shapes]
            dtypes = [_dtype(t) for t in layout.dtypes]
            fmt = _memory_format(layout.fmt)
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise _BadPage(str(exc)) from exc
        one = len(shapes) == 1
        obj = self.get_allocator_backend().allocate(shapes[0] if one else shapes, dtypes[0] if one else dtypes, fmt)
        if obj is None:
            log.warning("stripefs: LMCache's allocator has no room for %s", key_text(key))
            return None
        try:
            dst = _bytes_of(obj)
            if len(dst) != layout.nbytes:
                raise _BadPage(f"{len(dst)} bytes allocated for a chunk of {layout.nbytes}")
            dst[:] = page[HEADER:HEADER + layout.nbytes]
        except BaseException:
            obj.ref_count_down()
            raise
        return obj

    @staticmethod
    def _torch_size(shape: list[int]) -> Any:
        import torch

        return torch.Size(shape)

    def _forget(self, names: list[bytes]) -> None:
        """Remove the index entries of pages a get could not use, so ``contains`` agrees."""
        try:
            self.store.delete(names)
        except StripefsError as exc:
            log.warning("stripefs: could not drop %d unusable index entries: %s", len(names), exc)

    # -- the rest ----------------------------------------------------------------------------
    def remove(self, key: Any, force: bool = True) -> bool:
        return self.batched_remove([key], force) == 1

    def batched_remove(self, keys: list[Any], force: bool = True) -> int:
        try:
            return self.store.delete([page_key(k) for k in keys])
        except StripefsError as exc:
            log.warning("stripefs: remove of %d keys failed: %s", len(keys), exc)
            return 0

    def get_allocator_backend(self) -> Any:
        """LMCache's CPU backend, which allocates the memory objects of gets."""
        if self.local_cpu_backend is None:
            raise RuntimeError("StripefsBackend needs LMCache's LocalCPUBackend (local_cpu: true) to allocate gets")
        return self.local_cpu_backend

    def stats(self) -> Any:
        """The store's counters (:class:`~stripefs.kvcache.StoreStats`)."""
        return self.store.stats()

    def close(self) -> None:
        """Finish the puts in flight, then close the store and the client."""
        self._puts.shutdown(wait=True)
        self._gets.shutdown(wait=True)
        self.store.close()
        self._client.close()
