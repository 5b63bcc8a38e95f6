"""A KV-cache page store on stripefs for inference servers (docs/kvcache.md).

Fixed-size pages per namespace (one model's layer layout), addressed by ``bytes`` keys
(e.g. a chained hash of token blocks), stored packed in large segment files, found through
an index that every client process of the cluster shares through the metadata service:

    >>> from stripefs.kvcache import PageStore
    >>> store = PageStore(client, "llama-70b-tp8", page_size=1 << 20, capacity_bytes=64 << 30, ttl=3600)
    >>> store.batch_put(keys, pages)                 # pages: CPU tensors / memoryviews
    >>> hit = store.batch_get_into(keys, buffers)    # the bytes land in the buffers
    >>> store.stats().hits

The design, in the modules that decide it:

* :mod:`._format` -- the bytes: segments of ``[pages][table of entries]``, a 256-byte
  entry per page (key, slot, CRC32C), index targets, segment names (no I/O);
* :mod:`._namespace` -- the directories of a namespace and its fixed page size;
* :mod:`._store` -- :class:`PageStore`: put (segment whole first, then one index entry
  per page), get (index, segments, one read ring, every page checked);
* :mod:`._policy` -- which segments to evict (TTL, then least recently used; no I/O);
* :mod:`._evict` -- retiring and, after a grace period, reclaiming segments;
* :mod:`._meta` -- many metadata requests in flight from synchronous code.

**Why the index lives in the metadata service.** One directory entry per key (a symlink
named by the key's hex, whose target is ``segment:slot:crc``) makes a put's publication
one atomic metadata operation, durable when it returns; a batch of lookups is one
``StatMany`` round trip per 200 keys; every process of the cluster sees the same index
with the service's consistency, with nothing else to run, replicate or recover: a store
of the store's own would have to solve again what the metadata service already solves
(durability, failover, a crashed client's half-done changes). The price is one metadata
commit per page put (group-committed, many in flight), fine for pages of 64 KiB and up.
"""

from ._namespace import NamespaceInfo, namespaces
from ._stats import StoreStats
from ._store import PageStore

__all__ = ["NamespaceInfo", "PageStore", "StoreStats", "namespaces"]
