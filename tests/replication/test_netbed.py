"""The multi-host test bed (issue #34): network namespaces on one bridge, link faults between
them, and a cluster whose roles run on its hosts, judged under a partition by the history checker.

The bed's own tests use tiny probes (a TCP listener, UDP datagrams, a bulk send) run on its
hosts with ``nsenter --net``; the schedules start the real role commands on the hosts.
Everything skips, with the reason, where a bed cannot be made (not root, no namespaces).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from stripefs.fsclient.testing import netbed
from stripefs.fsclient.testing.netbed import NetBed, NetemUnavailable
from stripefs.fsclient.testing.netfaults import LinkEvent, LinkSchedule, run_link_schedule

WHY = netbed.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network test bed here: {WHY}")

# One probe program for every check: run on a host, it listens, connects, sends or receives.
PROBE = r"""
import socket, sys, time
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "listen":  # accept TCP connections and drain them, until killed
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen()
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        while c.recv(1 << 16):
            pass
        c.close()
elif mode == "connect":  # one TCP connection within 1.5 s: "ok" or the error
    try:
        socket.create_connection((addr, port), timeout=1.5).close(); print("ok")
    except OSError as exc:
        print(type(exc).__name__)
elif mode == "send":  # N bytes over TCP; prints the seconds it took
    n = int(sys.argv[4]); t = time.monotonic()
    with socket.create_connection((addr, port), timeout=10) as c:
        c.sendall(bytes(n)); c.shutdown(socket.SHUT_WR); c.recv(1)
    print(f"{time.monotonic() - t:.3f}")
elif mode == "udp-send":
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(5):
        u.sendto(sys.argv[4].encode(), (addr, port)); time.sleep(0.02)
elif mode == "udp-recv":  # every datagram received within the seconds given
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((addr, port)); u.settimeout(float(sys.argv[4]))
    print("ready", flush=True)
    got = set()
    try:
        while True:
            got.add(u.recv(100).decode())
    except TimeoutError:
        pass
    print(" ".join(sorted(got)))
"""
PORT = 7555


def _probe(host: netbed.Host, *args: object) -> str:
    return host.run([sys.executable, "-c", PROBE, *map(str, args)], timeout=30).stdout.strip()


def _start(host: netbed.Host, *args: object) -> subprocess.Popen:
    proc = host.popen([sys.executable, "-c", PROBE, *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def bed() -> Iterator[NetBed]:
    with NetBed(["a", "b", "c"]) as b:
        yield b


def test_hosts_reach_each_other_and_a_partition_cuts_until_healed(bed: NetBed) -> None:
    a, b, c = bed.host("a"), bed.host("b"), bed.host("c")
    assert len({a.addr, b.addr, c.addr, bed.gateway}) == 4 and a.addr.startswith(bed.subnet + ".")
    _start(b, "listen", b.addr, PORT)
    assert _probe(a, "connect", b.addr, PORT) == "ok"
    bed.partition("a", "b")
    began = time.monotonic()
    assert _probe(a, "connect", b.addr, PORT) == "TimeoutError"  # silence, as on a real network: no error at once
    assert time.monotonic() - began >= 1.4
    assert _probe(c, "connect", b.addr, PORT) == "ok"  # only a and b are cut
    bed.heal()
    assert bed.faults() == []
    assert _probe(a, "connect", b.addr, PORT) == "ok"


def test_a_dropped_direction_drops_that_direction_only(bed: NetBed) -> None:
    a, b = bed.host("a"), bed.host("b")
    bed.drop("a", "b")
    at_b, at_a = _start(b, "udp-recv", b.addr, PORT, 1.5), _start(a, "udp-recv", a.addr, PORT, 1.5)
    _probe(a, "udp-send", b.addr, PORT, "from-a")
    _probe(b, "udp-send", a.addr, PORT, "from-b")
    assert at_b.communicate(timeout=10)[0].strip() == ""  # a -> b dropped
    assert at_a.communicate(timeout=10)[0].strip() == "from-b"  # b -> a flows
    _start(b, "listen", b.addr, PORT)
    assert _probe(a, "connect", b.addr, PORT) == "TimeoutError"  # the SYN is lost
    bed.heal("a", "b")
    assert _probe(a, "connect", b.addr, PORT) == "ok"


def test_an_isolated_host_is_cut_from_every_host_and_the_operator(bed: NetBed) -> None:
    b = bed.host("b")
    _start(b, "listen", b.addr, PORT)
    bed.isolate("b")
    assert _probe(bed.host("a"), "connect", b.addr, PORT) == "TimeoutError"
    with pytest.raises(OSError):
        socket.create_connection((b.addr, PORT), timeout=1.5).close()
    bed.heal()
    assert _probe(bed.host("a"), "connect", b.addr, PORT) == "ok"
    socket.create_connection((b.addr, PORT), timeout=1.5).close()


def test_a_limited_link_is_slow(bed: NetBed) -> None:
    a, b = bed.host("a"), bed.host("b")
    _start(b, "listen", b.addr, PORT)
    assert float(_probe(a, "send", b.addr, PORT, 1 << 20)) < 0.5
    bed.limit("a", "8mbit", burst="16kb")
    assert float(_probe(a, "send", b.addr, PORT, 1 << 20)) >= 0.8  # 8 Mbit: 1 MiB in ~1 s
    bed.heal()
    assert float(_probe(a, "send", b.addr, PORT, 1 << 20)) < 0.5


def test_a_delay_is_netem_where_the_kernel_has_it_else_the_delay_line(bed: NetBed) -> None:
    a, b = bed.host("a"), bed.host("b")
    _start(b, "listen", b.addr, PORT)
    if netbed.has_netem():
        bed.delay("a", 200, line=False)
    else:
        with pytest.raises(NetemUnavailable, match="netem is not available in this kernel"):
            bed.delay("a", 1.0, 0.5, line=False)
        bed.delay("a", 200)  # the default falls back to the user-space delay line (test_delayline.py)
        assert bed.delayed_by_line() == ["a"]
    began = time.monotonic()
    assert _probe(a, "connect", b.addr, PORT) == "ok"
    assert time.monotonic() - began >= 0.2


def _exists(names: list[str]) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [n for n in names if n in netns.split() or f": {n}:" in links or f": {n}@" in links]


def test_a_bed_leaves_nothing_behind_even_after_an_error() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with NetBed(["x", "y"]) as b:
            _start(b.host("x"), "listen", b.host("x").addr, PORT)  # a process on a host: killed too
            made = [h.netns for h in b.hosts.values()] + [h.link for h in b.hosts.values()] + [f"{b.tag}br"]
            assert _exists(made) == made
            raise RuntimeError("boom")
    assert b.leftovers() == [] and _exists(made) == []
    assert not os.path.exists(os.path.join(netbed.STATE_DIR, b.tag))


def test_a_new_bed_sweeps_what_a_dead_one_left() -> None:
    stale = f"{netbed.PREFIX}dead"  # a tag whose owner is gone (pid 0)
    os.makedirs(netbed.STATE_DIR, exist_ok=True)
    with open(os.path.join(netbed.STATE_DIR, stale), "w") as f:
        f.write("0")
    subprocess.run(["ip", "netns", "add", f"{stale}-h"], check=True)
    subprocess.run(["ip", "link", "add", f"{stale}v0", "type", "veth", "peer", "name", f"{stale}p0"], check=True)
    with NetBed(["a"]):
        assert _exists([f"{stale}-h", f"{stale}v0", f"{stale}p0"]) == []
    assert os.path.exists(os.path.join(netbed.STATE_DIR, "lock"))  # the sweep's own lock is no leftover


# -- a cluster on the bed ----------------------------------------------------------------------
SHORT = LinkSchedule(seed=0, storage=3, clients=2, events=[
    # One storage host cut from every other host for less than the failure timeout (requests
    # to it wait for the heal; TCP's retransmissions back off, so well under it), a slow
    # link, a client's cable pulled for a moment. (A cut past the failure timeout, or of the
    # metadata service from a storage host, fails reads today: docs/deploy.md.)
    LinkEvent(1.0, "cut", "storage", 1), LinkEvent(3.0, "heal", "storage", 1),
    LinkEvent(5.0, "cut", "slow", 0), LinkEvent(7.0, "heal", "slow", 0),
    LinkEvent(8.0, "cut", "client", 0), LinkEvent(9.5, "heal", "client", 0),
])


@pytest.mark.slow
def test_a_short_partition_schedule_across_hosts_checks_clean(tmp_path) -> None:
    began = time.monotonic()
    outcome = run_link_schedule(0, root=str(tmp_path), schedule=SHORT, duration=11.0)
    assert "storage(stor2 from all)" in outcome.schedule and "client(gpu1 cable)" in outcome.schedule
    assert outcome.verdict.reads > 0 and outcome.verdict.acked_writes > 0 and outcome.verdict.truncates > 0
    assert outcome.ok, outcome.report()
    assert time.monotonic() - began < 120, "the short schedule is meant to take well under a minute"


@pytest.mark.slow
def test_the_checker_still_bites_on_the_bed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Writer 0's truncates leave their bytes in place (faults.py's self-test): stale reads.
    monkeypatch.setenv("STRIPEFS_FAULTS_INJECT", "cut-lost")
    quick = LinkSchedule(seed=0, storage=3, clients=2, events=[LinkEvent(1.0, "cut", "storage", 2),
                                                               LinkEvent(2.5, "heal", "storage", 2)])
    outcome = run_link_schedule(0, root=str(tmp_path), schedule=quick, duration=8.0, readers=3)
    assert not outcome.ok
    assert any("stale bytes" in v for v in outcome.verdict.violations), outcome.report()


def test_link_schedules_are_seeded_one_fault_at_a_time_and_cut_what_they_say() -> None:
    a, b = LinkSchedule.generate(5, duration=60.0), LinkSchedule.generate(5, duration=60.0)
    assert a == b and a != LinkSchedule.generate(6, duration=60.0)
    cut = None
    for e in a.events:
        assert (e.action == "cut") == (cut is None), a.describe()
        cut = e if e.action == "cut" else None
    many = [e for s in range(20) for e in LinkSchedule.generate(s, duration=60.0).events]
    assert {e.kind for e in many} == {"storage", "meta-split", "drop", "client", "slow"}
    sched = LinkSchedule(0, storage=3, clients=2)
    for e in many:
        drops, cable, slow = sched.victims(LinkEvent(0, "cut", e.kind, e.pick))
        if e.kind == "storage":
            (v,) = set.intersection(*({s, d} for s, d in drops))  # the one host in every cut direction
            assert v.startswith("stor") and len(set(drops)) == 2 * 5  # both ways, with each of the five others
        elif e.kind == "meta-split":
            cut_off = {d for s, d in drops if s == "meta"}
            assert 1 <= len(cut_off) <= 2 and all("meta" in (s, d) for s, d in drops)  # some, never all three
        elif e.kind == "drop":
            assert len(drops) == 1 and drops[0][0] != drops[0][1]
        elif e.kind == "client":
            assert cable in ("gpu1", "gpu2") and not drops
        else:
            assert slow and slow.startswith("stor")
