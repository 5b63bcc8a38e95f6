"""Chain replication under failures: real processes, kill -9, restart, corruption, scrub.

Bounded in time: a dead server is taken out of its chains after ~5 s of silence.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from stripefs.fsclient import Client
from stripefs.storage import HEADER_SIZE, chunk_files
from tests.conftest import TEST_CHUNK


def wait_all_serving(c: Client, n: int, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = c.status()
        if len(st.servers) == n and all(s.state == "serving" for s in st.servers):
            return
        time.sleep(0.2)
    raise AssertionError(f"servers did not all come back serving: {c.status().servers}")


def server_pid(h, sid: int) -> int:
    with h.client() as c:
        return next(s.pid for s in c.status().servers if s.server_id == sid)


class Workload:
    """Writers and readers in threads; records what was acknowledged."""

    def __init__(self, h, prefix: str, writers: int = 3):
        self.h, self.prefix = h, prefix
        self.acked: dict[str, bytes] = {}
        self.errors: list[BaseException] = []
        self.reads = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._write, args=(i,)) for i in range(writers)]
        self.threads.append(threading.Thread(target=self._read))

    def _write(self, i: int) -> None:
        with self.h.client() as c:
            n = 0
            while not self.stop.is_set():
                path = f"{self.prefix}/w{i}-{n}"
                data = os.urandom(TEST_CHUNK * 2 + 1000 * i + n)
                try:
                    c.write_bytes(path, data)
                    self.acked[path] = data
                except OSError as exc:  # in-flight writes may fail, but clearly
                    assert exc.errno is not None
                n += 1

    def _read(self) -> None:
        with self.h.client() as c:
            while not self.stop.is_set():
                for path, data in list(self.acked.items())[-5:]:
                    try:
                        if c.read_bytes(path) != data:
                            self.errors.append(AssertionError(f"wrong bytes in {path}"))
                        self.reads += 1
                    except BaseException as exc:  # noqa: BLE001
                        self.errors.append(exc)
                time.sleep(0.01)

    def __enter__(self) -> "Workload":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def verify(self) -> None:
        assert not self.errors, self.errors[:3]
        with self.h.client() as c:
            for path, data in self.acked.items():
                assert c.read_bytes(path) == data, path


@pytest.mark.parametrize("replicas", [2, 3])
def test_kill_a_server_during_traffic_then_resync(make_cluster, replicas: int) -> None:
    h = make_cluster(servers=3, replicas=replicas)
    with h.client() as c:
        c.mkdir("/w")
        c.write_bytes("/w/before", b"b" * (TEST_CHUNK * 3))
    victim = 2
    with Workload(h, "/w") as load:
        time.sleep(1.0)
        os.kill(server_pid(h, victim), signal.SIGKILL)
        time.sleep(7.0)  # detection (~5 s) and writes continuing on the shortened chains
        reads_during_outage = load.reads
    load.verify()
    assert load.acked and reads_during_outage > 0
    h.up()  # restarts just the dead server
    with h.client() as c:
        wait_all_serving(c, 3)
        # The returning server caught up: kill the others in its chains and read through it.
        others = [s.server_id for s in c.status().servers if s.server_id != victim]
    for sid in others[: replicas - 1]:
        os.kill(server_pid(h, sid), signal.SIGKILL)
    time.sleep(6.0)
    with h.client() as c:
        for path in ["/w/before", *list(load.acked)[:20]]:
            data = load.acked.get(path, b"b" * (TEST_CHUNK * 3))
            assert c.read_bytes(path) == data, path


def test_corrupt_replica_is_read_around_and_scrub_repairs(make_cluster) -> None:
    h = make_cluster(servers=3, replicas=2)
    data = os.urandom(TEST_CHUNK * 6)
    with h.client() as c:
        c.write_bytes("/f", data)
        ino = c.stat("/f").ino
    # Flip a byte in every copy held by one server.
    root = h.data["servers"][0]["root"]
    flipped = 0
    for name in chunk_files(root, ino):
        with open(name, "r+b") as f:
            f.seek(HEADER_SIZE + 100)
            b = f.read(1)
            f.seek(HEADER_SIZE + 100)
            f.write(bytes([b[0] ^ 0xFF]))
            flipped += 1
    assert flipped
    with h.client() as c:
        for _ in range(3):  # reads spread over replicas: every one must still be right
            assert c.read_bytes("/f") == data
    from stripefs.cli import main

    assert main(["scrub", "--cluster", h.file]) == 0  # found and repaired
    with h.client() as c:
        sid = next(s.server_id for s in c.status().servers if s.port == h.data["servers"][0]["port"])
        from stripefs.wire import messages as m

        again = c.call_storage(sid, m.Scrub(repair=False))
        assert again.bad == [] and again.checked >= flipped


def test_kill_head_middle_tail_and_two_of_three(make_cluster) -> None:
    h = make_cluster(servers=3, replicas=3)
    with h.client() as c:
        c.mkdir("/d")
        c.set_layout("/d", stripe=1)
        c.write_bytes("/d/probe", b"p")
        chain = c.stat("/d/probe").layout.chains[0]
        order = list(c.routing(refresh=True).chains[chain])
    assert len(order) == 3
    head, middle, tail = order
    with Workload(h, "/d", writers=2) as load:
        time.sleep(0.5)
        os.kill(server_pid(h, middle), signal.SIGKILL)
        time.sleep(6.5)
        os.kill(server_pid(h, head), signal.SIGKILL)  # two of three gone: the tail serves alone
        time.sleep(6.5)
    load.verify()
    with h.client() as c:
        assert [s.state for s in c.status().servers if s.server_id == tail] == ["serving"]
        c.write_bytes("/d/after", b"still writable")
        assert c.read_bytes("/d/after") == b"still writable"


def test_metadata_restart_during_traffic(make_cluster) -> None:
    h = make_cluster(servers=3, replicas=2)
    with h.client() as c:
        c.mkdir("/m")
    with Workload(h, "/m", writers=2) as load:
        time.sleep(0.5)
        os.kill(h.data["metadata"]["pid"], signal.SIGKILL)
        time.sleep(0.5)
        h.up()  # restarts the metadata service only
        time.sleep(2.0)
    load.verify()
    assert len(load.acked) > 2


@pytest.mark.parametrize("replicas", [1, 2])
def test_add_server_rebalances_without_downtime(make_cluster, replicas: int) -> None:
    h = make_cluster(servers=3, replicas=replicas)
    files = {f"/r/f{i}": os.urandom(TEST_CHUNK * 5 + i) for i in range(6)}
    with h.client() as c:
        c.mkdir("/r")
        for p, d in files.items():
            c.write_bytes(p, d)
    with Workload(h, "/r", writers=1) as load:
        h.add_server()
        with h.client() as c:
            wait_all_serving(c, 4, timeout=180)  # chains move one at a time (rate-limited) while a writer runs
            st = c.status()
        time.sleep(0.5)
    load.verify()
    new_sid = max(s.server_id for s in st.servers)
    slots = [t for ch in st.chains for t in ch["targets"]]
    assert slots.count(new_sid) >= 1  # the newcomer holds a fair share of chain slots
    assert all(len(ch["targets"]) == replicas for ch in st.chains)
    new_root = h.data["servers"][-1]["root"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # its chunks are on its disk; the donors dropped theirs
        held = sum(len(fs) for _, _, fs in os.walk(os.path.join(new_root, "chunks")))
        if held:
            break
        time.sleep(0.2)
    assert held > 0
    with h.client() as c:
        for p, d in {**files, **load.acked}.items():
            assert c.read_bytes(p) == d, p
        total_chunks = sum(s.used for s in c.status().servers)
    expect = sum(len(d) for d in {**files, **load.acked}.values()) * replicas
    deadline = time.monotonic() + 30
    while total_chunks > expect and time.monotonic() < deadline:  # donors' copies are dropped
        time.sleep(0.5)
        with h.client() as c:
            total_chunks = sum(s.used for s in c.status().servers)
    assert total_chunks == expect


def test_one_chunk_reads_check_and_fail_over(make_cluster) -> None:
    """A read inside one chunk (a dataloader's sample) takes the blocking fast path: its
    bytes are still checked, a bad copy sends it to the other replica, and a dead server
    to the one still serving."""
    h = make_cluster(servers=2, replicas=2)
    data = os.urandom(TEST_CHUNK * 4)
    with h.client() as c:
        c.write_bytes("/one", data)
        ino = c.stat("/one").ino
    for name in chunk_files(h.data["servers"][0]["root"], ino):  # every copy on server 0 goes bad at byte 100
        with open(name, "r+b") as f:
            f.seek(HEADER_SIZE + 100)
            b = f.read(1)
            f.seek(HEADER_SIZE + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    with h.client() as c, c.open("/one", "rb") as f:
        buf = memoryview(bytearray(4096))
        for k in range(4):  # each chunk, whichever replica its spread picks first
            off = k * TEST_CHUNK + 64
            assert c.read_into(f.ino, f.layout, f.size, off, buf) == 4096
            assert bytes(buf) == data[off : off + 4096]
    os.kill(h.data["servers"][1]["pid"], signal.SIGKILL)  # the good copies' server: reads now fail closed
    with h.client(retry_for=2) as c, c.open("/one", "rb") as f, pytest.raises(OSError) as err:
        c.read_into(f.ino, f.layout, f.size, 64, memoryview(bytearray(4096)))
    assert err.value.errno is not None


def test_one_chunk_reads_go_on_when_the_server_answering_them_is_killed(make_cluster) -> None:
    """A server killed while it answers one-chunk reads (32 MiB answers: almost surely
    halfway through one): the read being answered fails over to the other replica like
    any other, and reads go on succeeding, with the right bytes, within a bound."""
    chunk = 32 << 20
    h = make_cluster(servers=3, replicas=2, chunk_size=chunk)
    data = os.urandom(chunk)
    log: list[tuple[float, bool]] = []  # (end, right bytes) of every read
    errors: list[BaseException] = []
    stop = threading.Event()
    with h.client() as c:
        c.write_bytes("/big", data)
        attr = c.stat("/big")
        pl = c.placement("/big")[0]
        victim = pl["replicas"][attr.ino % len(pl["replicas"])]  # the replica reads of chunk 0 go to first

    def read() -> None:
        buf = memoryview(bytearray(chunk))
        with h.client(retry_for=20) as rc:
            while not stop.is_set():
                try:
                    n = rc.read_into(attr.ino, attr.layout, attr.size, 0, buf)
                    log.append((time.monotonic(), n == chunk and buf == data))
                except BaseException as exc:  # noqa: BLE001 -- anything a read raises fails the test
                    errors.append(exc)
                    return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 20
        while len(log) < 5 and time.monotonic() < deadline and reader.is_alive():
            time.sleep(0.01)
        os.kill(server_pid(h, victim), signal.SIGKILL)
        t_kill = time.monotonic()
        while time.monotonic() < t_kill + 20 and reader.is_alive() and sum(e > t_kill for e, _ in log) < 5:
            time.sleep(0.05)
    finally:
        stop.set()
        reader.join(60)
    assert not reader.is_alive() and errors == []
    after = [e for e, _ in log if e > t_kill]
    assert len(after) >= 5, f"{len(after)} reads succeeded in the 20 s after the kill"
    assert after[0] - t_kill < 12 and all(ok for _, ok in log)
