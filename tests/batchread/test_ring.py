"""The read ring against a local reference: random batches, many files, holes, EOF, bad input."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from .brhelpers import random_reads
from stripefs.fsclient import Client
from stripefs.fsclient.batchread import Completion, ReadRing, SharedBuffer, read_batch
from stripefs.wire import StripefsError

CHUNK = 256 * 1024


def expected(files: dict[str, bytes], path: str, off: int, n: int) -> bytes:
    return files[path][off : off + n]


def test_random_batches_match_reference(client: Client, files: dict[str, bytes]) -> None:
    reads = random_reads(files, 120, seed=1)
    with SharedBuffer(sum(n for _p, _o, n in reads) + 1) as buf:
        ring = ReadRing(client, entries=64, max_inflight=16)  # forces turns and window refills
        regs = {p: ring.open(p) for p in files}
        pos, plan = 0, []
        for p, o, n in reads:
            plan.append((buf.slice(pos, n), regs[p], o, n))
            pos += n
        buf.view[:] = b"\xee" * len(buf.view)  # stale bytes must be overwritten (holes too)
        counts = ring.read(plan)
        pos = 0
        for (p, o, n), got in zip(reads, counts):
            want = expected(files, p, o, n)
            assert got == len(want)
            assert buf.view[pos : pos + got] == want
            pos += n
        assert ring.in_flight == 0


def test_completions_carry_userdata_and_short_counts(client: Client, files: dict[str, bytes]) -> None:
    path = max(files, key=lambda p: len(files[p]))
    size = len(files[path])
    ring = ReadRing(client)
    f = ring.open(path)
    dest = bytearray(3 * 4096)
    ring.prepare(memoryview(dest)[:4096], f, 0, 4096, "head")
    ring.prepare(memoryview(dest)[4096:8192], f, size - 100, 4096, "tail")   # runs past EOF
    ring.prepare(memoryview(dest)[8192:], f, size + 5000, 4096, "beyond")    # starts past EOF
    assert ring.submit() == 3
    done = {c.userdata: c for c in ring.wait(3, timeout=30)}
    assert done["head"] == Completion("head", 4096, None)
    assert done["tail"].result == 100 and dest[4096:4196] == files[path][-100:]
    assert done["beyond"].result == 0
    assert ring.wait(1, timeout=0.01) == []  # nothing outstanding: returns at once


def test_holes_read_as_zeros_or_fail_when_forbidden(client: Client, files: dict[str, bytes]) -> None:
    path = next(p for p in files if p.endswith("holes.bin"))
    ring = ReadRing(client)
    f = ring.open(path)
    dest = np.full(len(files[path]), 7, dtype=np.uint8)
    assert ring.read([(dest, f, 0, len(dest))]) == [len(dest)]
    assert dest.tobytes() == files[path]

    strict = ReadRing(client, forbid_holes=True)
    with pytest.raises(StripefsError) as exc:
        strict.read([(bytearray(CHUNK), f, 0, CHUNK)])
    assert exc.value.errno == errno.ENODATA and "hole" in str(exc.value)
    # a fully written range of the same file reads fine with the flag
    data_at = 2 * CHUNK + 1000
    out = bytearray(1000)
    assert strict.read([(out, f, data_at, 1000)]) == [1000]
    assert out == files[path][data_at : data_at + 1000]


def test_numpy_and_torch_views_share_the_buffer(client: Client, files: dict[str, bytes]) -> None:
    path = next(p for p in files if len(files[p]) == 1_500_000)
    with SharedBuffer(1 << 20) as buf:
        arr, ten = buf.numpy(), buf.tensor()
        ring = ReadRing(client)
        f = ring.open(path)
        ring.read([(ten[: 1 << 19], f, 4096, 1 << 19), (arr[1 << 19 :], f, 0, 1 << 19)])
        assert arr[: 1 << 19].tobytes() == files[path][4096 : 4096 + (1 << 19)]
        assert bytes(ten[1 << 19 :].numpy()) == files[path][: 1 << 19]
        assert arr.ctypes.data == ten.data_ptr() and arr.ctypes.data % os.sysconf("SC_PAGE_SIZE") == 0
        del arr, ten


def test_read_batch_back_to_back(client: Client, files: dict[str, bytes]) -> None:
    reads = random_reads(files, 10, seed=3, max_len=50_000)
    dest, counts = read_batch(client, reads)
    pos = 0
    for (p, o, n), got in zip(reads, counts):
        assert dest[pos : pos + got] == expected(files, p, o, n)
        pos += n


def test_bad_input_gets_clear_errors(client: Client, files: dict[str, bytes], testdir: str) -> None:
    ring = ReadRing(client, entries=2)
    path = next(iter(files))
    f = ring.open(path)
    with pytest.raises(FileNotFoundError):
        ring.open(f"{testdir}/missing")
    with pytest.raises(IsADirectoryError):
        ring.open(testdir)
    with pytest.raises(StripefsError, match="read-only"):
        ring.prepare(b"abc", f, 0, 3)
    with pytest.raises(StripefsError, match="destination holds"):
        ring.prepare(bytearray(2), f, 0, 3)
    with pytest.raises(StripefsError, match="negative"):
        ring.prepare(bytearray(2), f, -1, 2)
    with pytest.raises(StripefsError, match="contiguous"):
        ring.prepare(np.zeros(8, dtype=np.uint8)[::2], f, 0, 2)
    with pytest.raises(StripefsError, match="contiguous"):
        ring.prepare(torch.zeros(4, 4, dtype=torch.uint8).t(), f, 0, 2)
    ring.prepare(bytearray(1), f, 0, 1)
    ring.prepare(bytearray(1), f, 0, 1)
    with pytest.raises(StripefsError) as exc:
        ring.prepare(bytearray(1), f, 0, 1)
    assert exc.value.errno == errno.EBUSY
    ring.submit()
    assert len(ring.wait(2, timeout=30)) == 2
    with pytest.raises(StripefsError, match="positive"):
        SharedBuffer(0)
    with SharedBuffer(4096) as buf, pytest.raises(StripefsError, match="outside"):
        buf.slice(4000, 200)


def test_ring_refuses_use_after_fork(client: Client, files: dict[str, bytes]) -> None:
    ring = ReadRing(client)
    pid = os.fork()
    if pid == 0:  # child: the parent's ring must not be driven here
        try:
            ring.submit()
            os._exit(1)
        except StripefsError:
            os._exit(0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_growing_the_zero_buffer_is_safe_from_racing_reader_threads(client: Client) -> None:
    # Reader threads zero-fill holes concurrently. Drive the worst interleaving
    # deterministically: B (small hole) checks the shared zero buffer while it is empty,
    # A (large hole) grows it, B stores its smaller one, and only then does A copy.
    import threading

    checked, a_stored, b_stored = threading.Event(), threading.Event(), threading.Event()
    reads: dict[str, int] = {}

    class Ring(ReadRing):
        @property
        def _zeros(self) -> memoryview:
            who = threading.current_thread().name
            reads[who] = reads.get(who, 0) + 1
            if who == "A" and reads[who] == 1:
                checked.wait(2)
            elif who == "A":
                b_stored.wait(2)
            elif who == "B":
                checked.set()
            return self.__dict__["zeros"]

        @_zeros.setter
        def _zeros(self, value: memoryview) -> None:
            who = threading.current_thread().name
            if who == "B":
                a_stored.wait(2)
            self.__dict__["zeros"] = value
            if who in ("A", "B"):
                (a_stored if who == "A" else b_stored).set()

    ring = Ring(client)
    big, small = bytearray(b"\x01" * (1 << 20)), bytearray(b"\x01" * (1 << 16))
    errors: list[BaseException] = []

    def fill(view: bytearray) -> None:
        try:
            ring._zero(memoryview(view))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=fill, args=(v,), name=n) for n, v in (("A", big), ("B", small))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and big == bytes(len(big)) and small == bytes(len(small))


def test_a_failure_accounting_a_piece_fails_its_read_and_never_hangs_wait(client: Client,
                                                                          files: dict[str, bytes]) -> None:
    path = next(p for p in files if p.endswith("holes.bin"))
    ring = ReadRing(client)
    f = ring.open(path)

    def broken(view: memoryview) -> None:
        raise ValueError("zero fill failed")

    ring._zero = broken  # type: ignore[method-assign]
    ring.prepare(bytearray(CHUNK), f, 0, CHUNK, userdata="hole")
    ring.submit()
    got = ring.wait(1, timeout=10)
    assert [c.userdata for c in got] == ["hole"], "wait() hangs when accounting a piece raises"
    assert got[0].error is not None and got[0].result == -errno.EIO and "zero fill failed" in str(got[0].error)
    assert ring.in_flight == 0


def test_a_batch_of_one_is_the_clients_blocking_read(client: Client, files: dict[str, bytes],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``read`` of one read within one chunk, with the ring idle, is ``Client.read_into``
    (the calling thread receives the answer); anything else goes the ring's way, and both
    give the same bytes and the same errors."""
    ring = ReadRing(client, entries=4)
    direct: list[int] = []
    read_into = client.read_into

    def counted(*args: object) -> int:
        direct.append(1)
        return read_into(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(client, "read_into", counted)
    small = next(p for p, d in files.items() if 0 < len(d) <= CHUNK)
    big = next(p for p, d in files.items() if len(d) > 2 * CHUNK)
    f, g = ring.open(small), ring.open(big)
    buf = bytearray(CHUNK + 10)
    assert ring.read([(buf, f, 0, len(files[small]) + 10)]) == [len(files[small])]  # short count past the end
    assert bytes(buf[:len(files[small])]) == files[small] and len(direct) == 1
    assert ring.read([(buf, g, CHUNK + 5, 1000)]) == [1000] and bytes(buf[:1000]) == expected(files, big, CHUNK + 5, 1000)
    assert len(direct) == 2
    assert ring.read([(buf, g, CHUNK - 100, 200)]) == [200]  # across two chunks: the ring's way
    assert bytes(buf[:200]) == expected(files, big, CHUNK - 100, 200) and len(direct) == 2
    assert ring.read([(buf, f, len(files[small]), 10)]) == [0] and len(direct) == 2  # nothing to read
    ring.prepare(bytearray(10), f, 0, 10)  # the ring is not idle: its way, in turn
    assert ring.read([(buf, g, 0, 100)]) == [100] and len(direct) == 2
    ring.submit()
    assert len(ring.wait(1, timeout=30)) == 1
    with pytest.raises(StripefsError, match="destination holds"):
        ring.read([(bytearray(2), f, 0, 3)])
    with pytest.raises(StripefsError, match="read-only"):
        ring.read([(b"abc", f, 0, 3)])
    assert ring.in_flight == 0
