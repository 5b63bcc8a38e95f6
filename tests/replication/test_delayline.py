"""The user-space delay line (issue #34): a host's link through two TAP devices and a forwarder
that holds every frame for the one-way delay -- the bed's delay where the kernel has no netem.

The forwarding loop is checked on its own with datagram socket pairs (a frame per read, as a
TAP device gives): the delay, FIFO order under jitter, the queue limit. On a bed: the round
trip is the setting (never less), bytes pass intact both ways, faults in force carry over,
unshape gives the veth back, and nothing is left behind. Bed tests skip, with the reason,
where a bed cannot be made.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from stripefs.bench.net_bench import PROBE, PROBE_PORT, measure_link
from stripefs.fsclient.core._proc import pid_alive
from stripefs.fsclient.testing import netbed
from stripefs.fsclient.testing.delayline import QUEUE_LIMIT, forward
from stripefs.fsclient.testing.netbed import NetBed

WHY = netbed.unavailable()
needs_bed = pytest.mark.skipif(WHY is not None, reason=f"no network test bed here: {WHY}")


# -- the forwarding loop alone ----------------------------------------------------------------------
_KEEP: list[object] = []
Line = tuple[socket.socket, socket.socket, int, threading.Thread]


def _line(one_way: float, jitter: float, limit: int = QUEUE_LIMIT) -> Line:
    """A forwarder between two datagram socket pairs: returns (left end, right end, control fd, thread)."""
    left, a = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    right, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    b.setblocking(False)
    r, w = os.pipe()
    t = threading.Thread(target=forward, args=(a.fileno(), b.fileno(), one_way, jitter, r, 0, limit), daemon=True)
    t.start()
    _KEEP.append((a, b, r))  # the forwarder's ends stay open while it runs
    return left, right, w, t


def test_every_frame_is_held_for_the_delay_and_jitter_never_reorders() -> None:
    left, right, stop, t = _line(0.004, 0.003)
    right.settimeout(5)
    got: list[tuple[int, float, bytes]] = []

    def receive() -> None:  # as a TAP device's reader, at once (a socket pair's buffer is small)
        for _ in range(200):
            frame = right.recv(1 << 16)
            got.append((int.from_bytes(frame[:4], "big"), time.monotonic(), frame))

    reader = threading.Thread(target=receive)
    reader.start()
    sent = {}
    for k in range(200):
        sent[k] = time.monotonic()
        left.send(k.to_bytes(4, "big") * 100)
        time.sleep(0.0002)
    reader.join(10)
    assert len(got) == 200
    held = [at - sent[k] for k, at, _ in got]
    assert [k for k, _, _ in got] == list(range(200))  # FIFO under +-3 ms of jitter
    assert all(f == k.to_bytes(4, "big") * 100 for k, _, f in got)
    assert min(held) >= 0.001 and max(held) > 0.005  # 4 +- 3 ms: jitter was applied, never below 1 ms
    right.send(b"back")  # the other direction too
    left.settimeout(5)
    assert left.recv(100) == b"back"
    os.close(stop)
    t.join(5)
    assert not t.is_alive()  # the control descriptor's end-of-file ends the loop


def test_a_full_queue_drops_frames_as_a_full_link_would() -> None:
    left, right, stop, t = _line(0.3, 0.0, limit=50)  # small: a socket pair's buffer holds them all
    got = [0]

    def receive() -> None:
        right.settimeout(1.0)
        try:
            while True:
                right.recv(100)
                got[0] += 1
        except TimeoutError:
            pass

    reader = threading.Thread(target=receive)
    reader.start()
    for _ in range(80):  # all within the 300 ms the first one waits
        left.send(b"x" * 64)
    reader.join(10)
    assert got[0] == 50
    os.close(stop)
    t.join(5)


# -- on a bed -------------------------------------------------------------------------------------
ECHO = r"""
import hashlib, random, socket, sys, threading
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = b"p" + random.Random(7).randbytes(n - 1)  # b"p": the probe server echoes this connection
c = socket.create_connection((addr, port), timeout=20)
threading.Thread(target=c.sendall, args=(data,), daemon=True).start()
back = bytearray()
while len(back) < n:
    back += c.recv(1 << 20)
print("same" if hashlib.sha256(back).digest() == hashlib.sha256(data).digest() else f"differ {len(back)}")
"""


@pytest.fixture
def bed() -> Iterator[NetBed]:
    if WHY is not None:
        pytest.skip(f"no network test bed here: {WHY}")
    with NetBed(["a", "b"], mtu=netbed.JUMBO_MTU) as b:
        yield b


def _serve(bed: NetBed, name: str) -> subprocess.Popen:
    h = bed.host(name)
    proc = h.popen([sys.executable, "-c", PROBE, "serve", h.addr, str(PROBE_PORT)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@needs_bed
def test_the_round_trip_is_the_setting_and_bytes_pass_intact_both_ways(bed: NetBed) -> None:
    bare = measure_link(bed, "a", "b", pings=100, bulk=8 << 20)
    assert bare["rtt_p50_ms"] < 0.5
    bed.delay("a", 4.0, line=True)  # 2 ms each way
    assert bed.delayed_by_line() == ["a"] and bed.faults() == ["shaped a"]
    got = measure_link(bed, "a", "b", pings=100, bulk=8 << 20)
    assert 4.0 <= got["rtt_min_ms"] and got["rtt_p50_ms"] < 4.0 + 1.5, got  # never less; a little more
    server = _serve(bed, "b")
    echoed = bed.host("a").run([sys.executable, "-c", ECHO, bed.host("b").addr, str(PROBE_PORT), str(6 << 20)])
    server.kill()
    server.wait()
    assert echoed.stdout.strip() == "same", echoed.stderr
    bed.heal()  # undoes the delay as every other fault
    assert bed.delayed_by_line() == [] and bed.faults() == []
    assert measure_link(bed, "a", "b", pings=100, bulk=8 << 20)["rtt_p50_ms"] < 0.5
    assert os.path.exists(f"/sys/class/net/{bed.tag}v0") and not os.path.exists(f"/sys/class/net/{bed.tag}d0")


@needs_bed
def test_faults_in_force_carry_over_to_the_delay_line(bed: NetBed) -> None:
    b = bed.host("b")
    _serve(bed, "b")
    program = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).close(); print('ok')"
    connect = [sys.executable, "-c", program, b.addr, str(PROBE_PORT)]
    bed.drop("a", "b")
    bed.delay("a", 1.0, line=True)
    assert bed.host("a").run(connect).stdout.strip() != "ok"  # the drop survived the new cable
    bed.undrop("a", "b")
    assert bed.host("a").run(connect).stdout.strip() == "ok"
    bed.isolate("a")
    assert bed.host("a").run(connect).stdout.strip() != "ok"
    bed.rejoin("a")
    assert bed.host("a").run(connect).stdout.strip() == "ok"


@needs_bed
def test_a_delay_line_leaves_nothing_behind() -> None:
    with NetBed(["a", "b"]) as b:
        b.delay("a", 1.0, line=True)
        forwarder = b._lines["a"].proc
        assert forwarder is not None and f"{b.tag}d0" in b.leftovers()
    assert b.leftovers() == [] and forwarder.poll() is not None
    assert not os.path.exists(f"/sys/class/net/{b.tag}d0")


@needs_bed
def test_a_forwarder_whose_owner_died_is_swept() -> None:
    owner = subprocess.Popen([sys.executable, "-c", """
import sys, time
from stripefs.fsclient.testing.netbed import NetBed
b = NetBed(["a"]).__enter__()
b.delay("a", 1.0, line=True)
print(b.tag, b._lines["a"].proc.pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    tag, pid = owner.stdout.readline().split()
    owner.kill()
    owner.wait()
    assert tag in netbed.sweep()  # it may have ended by itself already: its standard input closed

    def gone() -> bool:
        return not os.path.exists(f"/sys/class/net/{tag}d0") and not pid_alive(int(pid))

    end = time.monotonic() + 3.0  # an exiting process closes its devices a moment after it leaves the namespace
    while not gone() and time.monotonic() < end:
        time.sleep(0.01)
    assert gone()
