"""PageStore on the session cluster: round trips, misses, replacement, eviction by
capacity (least recently used) and TTL, reclamation, and readers running beside eviction."""

from __future__ import annotations

import threading
import time

import pytest

from stripefs.fsclient import Client
from stripefs.kvcache import PageStore
from stripefs.wire import StripefsError

from .conftest import page_of

PS = 64 * 1024


def keys_of(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def put(store: PageStore, keys: list[bytes]) -> None:
    store.batch_put(keys, [page_of(k, store.page_size) for k in keys])


def get(store: PageStore, keys: list[bytes]) -> list[bool]:
    """The hit mask; every hit is checked against the page put under its key."""
    bufs = [bytearray(store.page_size) for _ in keys]
    hits = store.batch_get_into(keys, bufs)
    for k, b, hit in zip(keys, bufs, hits):
        assert not hit or bytes(b) == page_of(k, store.page_size), k
    return hits


def test_round_trip_misses_and_counters(client: Client, ns: str) -> None:
    with PageStore(client, ns, PS, 64 * PS) as store:
        keys = keys_of("a", 24)
        put(store, keys)
        assert get(store, keys + [b"absent"]) == [True] * 24 + [False]
        views = [memoryview(bytearray(PS)) for _ in range(3)]  # memoryviews land too
        assert store.batch_get_into(keys[:3], views) == [True] * 3
        assert bytes(views[2]) == page_of(keys[2], PS)
        assert store.exists([keys[0], b"absent"]) == [True, False]
        s = store.stats()
        assert (s.hits, s.misses, s.puts) == (27, 1, 24)
        assert (s.bytes_in, s.bytes_out) == (24 * PS, 27 * PS)
        assert s.occupancy_bytes == 24 * PS and s.capacity_bytes == 64 * PS and s.checksum_failures == 0


def test_replace_delete_and_bad_calls(client: Client, ns: str) -> None:
    with PageStore(client, ns, PS, 64 * PS) as store:
        k = [b"one", b"two"]
        put(store, k)
        store.batch_put([b"one"], [page_of(b"other", PS)])  # a put replaces
        buf = bytearray(PS)
        assert store.batch_get_into([b"one"], [buf]) == [True] and bytes(buf) == page_of(b"other", PS)
        assert store.delete([b"one", b"nope"]) == 1
        assert store.exists(k) == [False, True]
        for bad_keys, bad_bufs in [([b"x"], [bytes(PS - 1)]), ([b""], [bytes(PS)]), ([b"x", b"x"], [bytes(PS)] * 2),
                                   ([b"x"], [])]:
            with pytest.raises(StripefsError) as err:
                store.batch_put(bad_keys, bad_bufs)
            assert err.value.errno == 22
        with pytest.raises(StripefsError):
            store.batch_get_into([b"two"], [bytes(PS)])  # read-only
        with pytest.raises(StripefsError):
            store.batch_put(keys_of("big", 65), [bytes(PS)] * 65)  # more than the capacity
        with pytest.raises(StripefsError):
            PageStore(client, ns, 2 * PS, 64 * PS)  # the namespace's page size is fixed


def test_torch_tensors_of_any_dtype(client: Client, ns: str) -> None:
    torch = pytest.importorskip("torch")
    with PageStore(client, ns, PS, 16 * PS) as store:
        src = [torch.randn(PS // 2, dtype=torch.bfloat16) for _ in range(4)]
        store.batch_put(keys_of("t", 4), src)
        dst = torch.zeros(4, PS // 2, dtype=torch.bfloat16)
        assert store.batch_get_into(keys_of("t", 4), list(dst)) == [True] * 4  # rows of one tensor
        assert all(torch.equal(a, b) for a, b in zip(src, dst))


def test_capacity_evicts_the_least_recently_used(client: Client, ns: str) -> None:
    # Segments of 2 pages, 4 of them fill the store.
    with PageStore(client, ns, PS, 8 * PS, segment_bytes=2 * PS, touch_interval=0) as store:
        batches = [keys_of(name, 2) for name in "abcd"]
        for b in batches:
            put(store, b)
        assert get(store, batches[0]) == [True, True]  # "a" is used: now "b" is the oldest
        put(store, keys_of("e", 2))
        assert store.exists([k for b in batches for k in b]) == [True, True, False, False, True, True, True, True]
        s = store.stats()
        assert (s.evictions, s.evicted_segments, s.occupancy_bytes) == (2, 1, 8 * PS)
        assert get(store, batches[1]) == [False, False]


def test_capacity_is_never_exceeded_by_a_lone_writer(client: Client, ns: str) -> None:
    with PageStore(client, ns, PS, 20 * PS, segment_bytes=4 * PS) as store:
        for r in range(12):
            put(store, keys_of(f"r{r}", 7))
            assert store.stats().occupancy_bytes <= 20 * PS
        assert get(store, keys_of("r11", 7)) == [True] * 7
        assert store.stats().evictions > 0


def test_two_writers_exceed_capacity_by_at_most_one_batch(client: Client, cluster: object, ns: str) -> None:
    cap, batch = 24 * PS, 6
    stores = [PageStore(cluster, ns, PS, cap, segment_bytes=batch * PS) for _ in range(2)]
    seen: list[int] = []
    stop = threading.Event()

    def write(w: int) -> None:
        for r in range(8):
            put(stores[w], keys_of(f"w{w}-{r}", batch))

    def watch() -> None:
        while not stop.is_set():
            seen.append(stores[0].stats().occupancy_bytes)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    seen.append(stores[0].stats().occupancy_bytes)
    for s in stores:
        s.close()
    assert seen and max(seen) <= cap + batch * PS, max(seen) // PS


def test_ttl(client: Client, ns: str) -> None:
    with PageStore(client, ns, PS, 16 * PS, ttl=0.6) as store:
        put(store, keys_of("old", 3))
        assert get(store, keys_of("old", 3)) == [True] * 3
        time.sleep(0.7)
        put(store, keys_of("new", 1))  # its eviction pass retires the expired segment
        assert get(store, keys_of("old", 3) + keys_of("new", 1)) == [False] * 3 + [True]
        s = store.stats()
        assert (s.expired, s.misses, s.evictions, s.segments) == (3, 3, 3, 1)  # known expired by their index entries
        time.sleep(0.7)
        assert get(store, keys_of("new", 1)) == [False]  # expired, not evicted yet: a miss all the same
        assert store.stats().expired == 4
        store.evict()
        assert store.stats().segments == 0


def test_retired_segments_are_reclaimed_after_the_grace(client: Client, ns: str) -> None:
    with PageStore(client, ns, PS, 4 * PS, segment_bytes=2 * PS, grace=1.0, read_timeout=0.5) as store:
        for name in "abc":
            put(store, keys_of(name, 2))
        retired = f"{store.ns.dir}/retired"
        assert len(client.listdir(retired)) == 1 and store.exists(keys_of("a", 2)) == [False, False]
        assert all(not isinstance(a, StripefsError) for a in client.stat_many(
            [f"{store.ns.dir}/idx/{k.hex()}" for k in keys_of("a", 2)], follow=False))  # dangling until reclaimed
        time.sleep(1.1)
        store.evict()
        assert client.listdir(retired) == [] and store.stats().reclaimed_segments == 1
        assert all(isinstance(a, StripefsError) for a in client.stat_many(
            [f"{store.ns.dir}/idx/{k.hex()}" for k in keys_of("a", 2)], follow=False))


def test_readers_beside_eviction_never_see_bad_bytes(cluster: object, ns: str) -> None:
    """A writer floods a small store (evicting and reclaiming all the time) while a reader
    gets recent keys: every hit has the right bytes, and no read ever met a reclaimed segment."""
    writer = PageStore(cluster, ns, PS, 12 * PS, segment_bytes=3 * PS, grace=1.0, read_timeout=0.5)
    reader = PageStore(cluster, ns, PS, 12 * PS, grace=1.0, read_timeout=0.5)
    done = threading.Event()
    rounds = [0]
    hits = 0

    def write() -> None:
        while not done.is_set():
            put(writer, keys_of(f"w{rounds[0]}", 3))
            rounds[0] += 1

    t = threading.Thread(target=write)
    t.start()
    try:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            r = rounds[0]
            hits += sum(get(reader, [k for back in range(4) for k in keys_of(f"w{max(r - back, 0)}", 3)]))
    finally:
        done.set()
        t.join()
    rs, ws = reader.stats(), writer.stats()
    writer.close()
    reader.close()
    assert hits > 0 and ws.evictions > 0 and ws.reclaimed_segments > 0
    assert (rs.checksum_failures, rs.read_errors) == (0, 0)


def test_status_shows_each_namespace(client: Client, cluster, ns: str, capsys) -> None:  # type: ignore[no-untyped-def]
    """``stripefs status`` (and ``--json``) lists the namespace: page size, pages, segments."""
    import json

    from stripefs import cli
    from stripefs.kvcache import namespaces

    with PageStore(client, ns, PS, 64 * PS) as store:
        put(store, keys_of("s", 5))
        put(store, keys_of("t", 3))
    info = {n.name: n for n in namespaces(client)}[ns]
    assert (info.page_size, info.pages, info.segments, info.occupancy_bytes) == (PS, 8, 2, 8 * PS)
    assert cli.main(["status", "--cluster", cluster.file]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(f"kvcache {ns} ")]
    assert line and "8 pages in 2 segments" in line[0]
    assert cli.main(["status", "--cluster", cluster.file, "--json"]) == 0
    got = {n["namespace"]: n for n in json.loads(capsys.readouterr().out)["kvcache"]}
    assert got[ns]["pages"] == 8 and got[ns]["occupancy_bytes"] == 8 * PS


def test_a_get_of_segments_met_lately_asks_for_the_index_entries_only(client: Client, ns: str) -> None:
    """Segments are immutable under unique names: a get remembers them for less than
    ``(grace - read_timeout) / 2`` and then looks up only the keys' index entries."""
    with PageStore(client, ns, PS, 8 * PS, segment_bytes=2 * PS, grace=1.0, read_timeout=0.5) as store:
        keys = keys_of("a", 2) + keys_of("b", 2)  # two segments
        put(store, keys_of("a", 2))
        put(store, keys_of("b", 2))
        assert get(store, keys) == [True] * 4
        asked: list[int] = []
        real = store.client.stat_many

        def counted(paths, **kw):  # type: ignore[no-untyped-def]  # the real call, counted
            asked.append(len(paths))
            return real(paths, **kw)

        store.client.stat_many = counted  # type: ignore[method-assign]
        try:
            assert get(store, keys) == [True] * 4
            assert asked == [4]  # the index entries; both segments known
            time.sleep(0.3)  # past the 0.25 s a segment is remembered here
            asked.clear()
            assert get(store, keys) == [True] * 4
            assert asked == [4, 2]
        finally:
            del store.client.stat_many


def test_a_remembered_segment_evicted_meanwhile_is_a_miss_after_its_time(client: Client, ns: str) -> None:
    with PageStore(client, ns, PS, 4 * PS, segment_bytes=2 * PS, grace=1.0, read_timeout=0.5) as store:
        put(store, keys_of("a", 2))
        put(store, keys_of("b", 2))
        assert get(store, keys_of("a", 2)) == [True, True]  # a's segment remembered
        put(store, keys_of("c", 2))  # the store is full: a's segment is retired
        assert len(client.listdir(f"{store.ns.dir}/retired")) == 1
        time.sleep(0.3)
        assert get(store, keys_of("a", 2)) == [False, False]  # evicted: a miss, as without the memory
        assert get(store, keys_of("b", 2) + keys_of("c", 2)) == [True] * 4
