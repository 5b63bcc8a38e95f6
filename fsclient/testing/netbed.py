"""Many hosts on one machine: a network namespace per host, joined by a bridge, with link faults.

:class:`NetBed` makes one network namespace per host (``lo`` up, one ``eth0`` with a
private address), joined by veth pairs to a bridge in the root namespace, which holds the
subnet's ``.1`` (:attr:`NetBed.gateway`: the operator's console, from which tests reach
every host). A process runs on a host through ``nsenter --net`` (:meth:`Host.popen`), which
enters the host's network namespace only: unlike ``ip netns exec`` it keeps the mount
namespace, so files and FUSE mounts are the machine's::

    with NetBed(["meta", "stor1", "stor2", "gpu1"]) as bed:
        bed.host("meta").popen(["python", "-m", "http.server", "--bind", bed.host("meta").addr])
        bed.partition("meta", "stor1")        # both directions, silently
        bed.heal()                            # every link fault undone

Link faults (each undone by :meth:`NetBed.heal`):

* :meth:`~NetBed.drop` ``(src, dst)``: packets from ``src`` to ``dst`` vanish, the other
  direction flows (asymmetric loss). ``src`` resolves ``dst`` to a MAC address nobody has
  (a permanent neighbour entry): the bridge floods the frames and every port discards
  them, so a sender sees silence and TCP times out, as on a real network -- not the
  immediate ``EINVAL`` of a blackhole route;
* :meth:`~NetBed.partition` ``(a, b)``: :meth:`drop` both ways, between every host of
  ``a`` and every host of ``b`` (a name or a list of names);
* :meth:`~NetBed.isolate` ``(host)``: its cable pulled (the bridge's end of its veth
  down): no host, the operator included, reaches it;
* :meth:`~NetBed.limit` ``(host, rate)``: a token bucket (``tc tbf``) on both ends of its
  veth, so its sending and its receiving are limited;
* :meth:`~NetBed.delay` ``(host, ms, jitter_ms)``: ``ms`` more on every round trip of the
  host, half each way: ``tc netem`` where the kernel has it, else a user-space delay line
  (:mod:`.delayline`: the host's ``eth0`` and its bridge port become TAP devices, and a
  forwarding process of the bed's holds every frame for the one-way delay).

Names: every namespace, link and bridge of a bed starts with its tag (``sfnb`` and four
hex digits), so parallel beds do not collide; ``/run/stripefs-netbed/TAG`` records the
owner's pid, and a bed starting sweeps away what beds of dead owners left behind. The
subnet is ``10.77.K.0/24`` with the first K from 100 that no interface or route of the
root namespace uses.

Caveats:
    * Needs root, ``ip`` (iproute2) and ``nsenter`` (util-linux); :func:`unavailable` says
      why a bed cannot be made here, and tests skip with that reason.
    * Without the kernel's ``sch_netem`` (:func:`has_netem`) a delay is the delay line's, an
      emulation with limits (measured on a 2-core VM, docs/deploy.md "A delay without
      netem"): round trips come out above the setting, never below (+0.09-0.16 ms at the
      median for 0.2-1 ms settings, the veth's 0.02 included; the tail grows with the
      machine's load), and a delayed host's link carries at most ~0.6-1 GB/s with 65000-byte
      frames (``mtu=JUMBO_MTU``), ~70-100 MB/s with 1500-byte ones: give the bed a jumbo
      MTU when a delayed link carries bulk data. Its process is the bed's (stopped by
      :meth:`~NetBed.unshape`, :meth:`~NetBed.heal` and :meth:`~NetBed.close`, killed by a
      sweep, and gone when its owner dies). Undelayed links are veths: a few microseconds.
      ``delay(..., line=False)`` raises :class:`NetemUnavailable` without netem;
      ``line=True`` uses the line even with it.
    * A delay line recables its host (new devices, same address and MAC; faults in force
      carry over): connections open at that moment see a brief outage. Delay before starting
      what should run delayed.
    * Link faults act on IPv4 between bed hosts. A dropped direction also drops the
      sender's ARP, which a permanent entry replaces: a heal deletes it, and the next
      packet resolves the address again.
    * All hosts share one clock and one file system: a history's real-time order holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core._proc import pid_alive
from .delayline import DelayLine

__all__ = ["Host", "NetBed", "BedUnavailable", "NetemUnavailable", "unavailable", "has_netem", "sweep"]

PREFIX = "sfnb"  # every bed's names: sfnbXXXX-HOST (namespaces), sfnbXXXXbr, sfnbXXXXvN (links)
STATE_DIR = "/run/stripefs-netbed"  # TAG -> the owner's pid, while a bed lives
NOWHERE = "02:00:00:00:00:00"  # a locally administered MAC no port has: frames to it are dropped
DEFAULT_MTU = 1500
JUMBO_MTU = 65000  # under the TAP device's maximum (65521): 40x fewer frames through a delay line
FIRST_HOST = 10  # hosts get .10, .11, ...; the root namespace (the bridge) has .1
_TAG = re.compile(PREFIX + "[0-9a-f]{4}")  # a bed's tag; the start of each of its names


class BedUnavailable(RuntimeError):
    """A bed cannot be made on this machine (not root, no iproute2, no network namespaces)."""


class NetemUnavailable(RuntimeError):
    """The kernel has no ``sch_netem``: links cannot be given a delay or jitter here."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {p.stderr.strip()}")
    return p


def _tc(netns: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *(["-n", netns] if netns else []), *args], capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why a bed cannot be made here (None: it can). Makes and removes a namespace to find out."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, a bridge)"
    missing = [p for p in ("ip", "nsenter", "tc") if shutil.which(p) is None]
    if missing:
        return f"{', '.join(missing)} not installed (iproute2, util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


_NETEM: bool | None = None


def has_netem() -> bool:
    """Whether the kernel has ``sch_netem`` (tried once, on a veth in a scratch namespace)."""
    global _NETEM
    if _NETEM is None:
        ns = f"{PREFIX}netem{os.getpid()}"
        _ip("netns", "add", ns)
        try:
            _ip("-n", ns, "link", "add", "t0", "type", "veth", "peer", "name", "t1")
            _NETEM = _tc(ns, "qdisc", "add", "dev", "t0", "root", "netem", "delay", "1ms").returncode == 0
        finally:
            _ip("netns", "del", ns, check=False)
    return _NETEM


def _remove(tag: str) -> None:
    """Remove a bed's namespaces (killing what runs in them), links and bridge, by its tag."""
    killed: list[int] = []
    for ns in _ip("netns", "list", check=False).stdout.split():
        if ns.startswith(tag + "-"):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
            _ip("netns", "del", ns, check=False)
    # A delay line's TAP devices close with its process (killed above, in a host's namespace):
    # wait for the killed to be gone, so that no device of the bed outlives this call.
    end = time.monotonic() + 5.0
    while any(pid_alive(p) for p in killed) and time.monotonic() < end:
        time.sleep(0.01)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0] if line.count(":") >= 2 else ""
        if name.startswith(tag):
            _ip("link", "del", name, check=False)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(STATE_DIR, tag))


def sweep() -> list[str]:
    """Remove what beds of owners no longer alive left behind; returns their tags."""
    owners: dict[str, int] = {}
    for tag in os.listdir(STATE_DIR) if os.path.isdir(STATE_DIR) else []:
        if not _TAG.fullmatch(tag):
            continue  # the lock file
        try:
            with open(os.path.join(STATE_DIR, tag)) as f:
                owners[tag] = int(f.read().strip() or 0)
        except (OSError, ValueError):
            owners[tag] = 0
    names = _ip("netns", "list", check=False).stdout.split()
    names += [ln.split(":", 2)[1].strip().split("@", 1)[0] for ln in _ip("-o", "link", "show", check=False)
              .stdout.splitlines() if ln.count(":") >= 2]
    tags = {n[:len(PREFIX) + 4] for n in names if _TAG.match(n)} | set(owners)
    stale = sorted(t for t in tags if owners.get(t, 0) <= 0 or not pid_alive(owners[t]))
    for tag in stale:
        _remove(tag)
    return stale


@dataclass
class Host:
    """One host of a bed: a network namespace with one address."""

    name: str
    netns: str
    addr: str
    mac: str
    link: str  # the bridge's end of its veth (or of its delay line: a TAP device), in the root namespace

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs on this host (in its network namespace only)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--", *argv]

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` on this host (``subprocess.Popen``'s keywords)."""
        return subprocess.Popen(self.argv(argv), **kw)

    def run(self, argv: list[str], *, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to its end; text output captured unless ``kw`` says otherwise."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(argv), timeout=timeout, **kw)


@dataclass
class NetBed:
    """Hosts in network namespaces on one bridge, and the link faults between them (module docstring).

    Args:
        names: the hosts, in address order (``.10``, ``.11``, ...).
        mtu: every link's MTU (the bridge, veths, delay lines' TAP devices): up to 65521.

    Raises:
        BedUnavailable: on entry, when :func:`unavailable` names a reason.
    """

    names: list[str]
    tag: str = field(default_factory=lambda: PREFIX + secrets.token_hex(2))
    hosts: dict[str, Host] = field(default_factory=dict)
    gateway: str = ""  # the root namespace's address on the bridge
    subnet: str = ""  # 10.77.K
    _dropped: set[tuple[str, str]] = field(default_factory=set)
    _isolated: set[str] = field(default_factory=set)
    _shaped: set[str] = field(default_factory=set)
    mtu: int = DEFAULT_MTU  # every link's; a delay line wants a jumbo one (JUMBO_MTU): fewer frames
    _lines: dict[str, DelayLine] = field(default_factory=dict)  # hosts cabled through a delay line
    _limits: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # limit()'s arguments, per host

    def __enter__(self) -> NetBed:
        why = unavailable()
        if why:
            raise BedUnavailable(why)
        if len(set(self.names)) != len(self.names) or not 0 < len(self.names) <= 200:
            raise ValueError(f"host names must be unique, 1 to 200 of them: {self.names}")
        if not 68 <= self.mtu <= 65521:
            raise ValueError(f"mtu {self.mtu}: 68 to 65521 (a TAP device's maximum)")
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(os.path.join(STATE_DIR, "lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one bed at a time picks a subnet and claims it
            with open(os.path.join(STATE_DIR, self.tag), "w") as f:
                f.write(str(os.getpid()))
            try:
                sweep()
                self._make_bridge()
            except BaseException:
                self.close()
                raise
        try:
            for i, name in enumerate(self.names):
                self._make_host(i, name)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process on the bed's hosts and remove its namespaces, links and bridge."""
        for line in self._lines.values():
            line.stop()
        self._lines.clear()
        _remove(self.tag)
        self.hosts.clear()

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def leftovers(self) -> list[str]:
        """The bed's namespaces and links that exist now (after :meth:`close`: none)."""
        names = _ip("netns", "list", check=False).stdout.split()
        names += [ln.split(":", 2)[1].strip().split("@", 1)[0] for ln in _ip("-o", "link", "show", check=False)
                  .stdout.splitlines() if ln.count(":") >= 2]
        return [n for n in names if n.startswith(self.tag)]

    # -- making it ------------------------------------------------------------------------
    def _make_bridge(self) -> None:
        used = _ip("-o", "addr", "show").stdout + _ip("route", "show", "table", "all").stdout
        k = next((k for k in range(100, 255) if f"10.77.{k}." not in used), None)
        if k is None:
            raise BedUnavailable("no free 10.77.K.0/24 subnet (K 100-254) in the root namespace")
        self.subnet, self.gateway = f"10.77.{k}", f"10.77.{k}.1"
        br = f"{self.tag}br"
        _ip("link", "add", br, "mtu", str(self.mtu), "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", br)
        _ip("link", "set", br, "up")

    def _make_host(self, i: int, name: str) -> None:
        netns, addr = f"{self.tag}-{name}"[:64], f"{self.subnet}.{FIRST_HOST + i}"
        _ip("netns", "add", netns)
        _ip("-n", netns, "link", "set", "lo", "up")
        link = self._plug_veth(i, netns)
        _ip("-n", netns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        mac = _ip("-n", netns, "-br", "link", "show", "eth0").stdout.split()[2]
        self.hosts[name] = Host(name, netns, addr, mac, link)

    def _plug_veth(self, i: int, netns: str) -> str:
        """Cable host ``i`` to the bridge with a veth pair (its end named ``eth0``); returns the bridge's end."""
        link, peer = f"{self.tag}v{i}", f"{self.tag}p{i}"
        _ip("link", "add", link, "mtu", str(self.mtu), "type", "veth", "peer", "name", peer, "mtu", str(self.mtu))
        _ip("link", "set", peer, "netns", netns)
        _ip("-n", netns, "link", "set", peer, "name", "eth0")
        _ip("link", "set", link, "master", f"{self.tag}br")
        _ip("link", "set", link, "up")
        return link

    def _recable(self, name: str, line: DelayLine | None) -> None:
        """Give the host a new cable: a delay line's TAP pair (``line`` started here) or, with
        None, a veth pair again. Its address, MAC and the faults in force on it carry over."""
        h, i = self.hosts[name], self.names.index(name)
        old = self._lines.pop(name, None)
        if old is not None:
            old.stop()  # its TAP devices vanish with it: eth0 and the bridge port are gone
        else:
            _ip("link", "del", h.link)  # the veth pair: both ends, eth0 included
        if line is None:
            h.link = self._plug_veth(i, h.netns)
        else:
            self._lines[name] = line.start()
            h.link = line.bridge_tap
            _ip("-n", h.netns, "link", "set", "eth0", "address", h.mac, "mtu", str(self.mtu))
            _ip("link", "set", h.link, "mtu", str(self.mtu))
            _ip("link", "set", h.link, "master", f"{self.tag}br")
            _ip("link", "set", h.link, "up")
        _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
        _ip("-n", h.netns, "link", "set", "eth0", "up")
        for src, dst in self._dropped:  # a permanent neighbour entry lives on its device: made again
            if src == name:
                self.drop(src, dst)
        if name in self._isolated:
            self.isolate(name)
        if name in self._limits:
            self.limit(name, *self._limits[name])

    # -- link faults -------------------------------------------------------------------------
    def _group(self, hosts: str | Iterable[str]) -> list[str]:
        group = [hosts] if isinstance(hosts, str) else list(hosts)
        for h in group:
            self.hosts[h]  # noqa: B018 -- a KeyError names an unknown host
        return group

    def drop(self, src: str, dst: str) -> None:
        """Packets from ``src`` to ``dst`` vanish; ``dst`` to ``src`` still flows."""
        a, b = self.hosts[src], self.hosts[dst]
        _ip("-n", a.netns, "neigh", "replace", b.addr, "lladdr", NOWHERE, "nud", "permanent", "dev", "eth0")
        self._dropped.add((src, dst))

    def undrop(self, src: str, dst: str) -> None:
        """Undo :meth:`drop` ``(src, dst)``."""
        a, b = self.hosts[src], self.hosts[dst]
        _ip("-n", a.netns, "neigh", "del", b.addr, "dev", "eth0", check=False)
        self._dropped.discard((src, dst))

    def partition(self, a: str | Iterable[str], b: str | Iterable[str]) -> None:
        """No packet between any host of ``a`` and any of ``b``, either way (each a name or names)."""
        for x in self._group(a):
            for y in self._group(b):
                if x != y:
                    self.drop(x, y)
                    self.drop(y, x)

    def isolate(self, name: str) -> None:
        """Pull the host's cable: the bridge's end of its veth goes down."""
        _ip("link", "set", self.hosts[name].link, "down")
        self._isolated.add(name)

    def rejoin(self, name: str) -> None:
        """Undo :meth:`isolate`."""
        h = self.hosts[name]
        _ip("link", "set", h.link, "up")
        self._isolated.discard(name)
        # Addresses that failed to resolve while the cable was out answer EHOSTUNREACH until
        # the entry ages out: forget them (a dropped direction keeps its entry).
        _ip("neigh", "del", h.addr, "dev", f"{self.tag}br", check=False)
        for other in self.hosts.values():
            if other.name != name:
                if (other.name, name) not in self._dropped:
                    _ip("-n", other.netns, "neigh", "del", h.addr, "dev", "eth0", check=False)
                if (name, other.name) not in self._dropped:
                    _ip("-n", h.netns, "neigh", "del", other.addr, "dev", "eth0", check=False)
        _ip("-n", h.netns, "neigh", "del", self.gateway, "dev", "eth0", check=False)

    def limit(self, name: str, rate: str, burst: str = "64kb", latency: str = "50ms") -> None:
        """At most ``rate`` (tc's units: ``100mbit``, ``1gbit``) each way for the host (tbf)."""
        h = self.hosts[name]
        for netns, dev in ((h.netns, "eth0"), (None, h.link)):
            p = _tc(netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                    "latency", latency)
            if p.returncode != 0:
                raise RuntimeError(f"tc tbf on {name}: {p.stderr.strip()}")
        self._limits[name] = (rate, burst, latency)
        self._shaped.add(name)

    def delay(self, name: str, ms: float, jitter_ms: float = 0.0, *, line: bool | None = None) -> None:
        """Add ``ms`` (+- ``jitter_ms``) milliseconds to every round trip the host makes: half
        to what it sends, half to what it receives (two delayed hosts: the sum of both).

        Args:
            line: True: a user-space delay line (:mod:`.delayline`) even where netem exists;
                False: netem or nothing; None: netem where the kernel has it, else the line.
        Raises:
            NetemUnavailable: ``line=False`` and the kernel has no ``sch_netem``.
        """
        if line is None:
            line = not has_netem()
        if not line and not has_netem():
            raise NetemUnavailable("netem is not available in this kernel (no sch_netem): links cannot be "
                                   "given a delay or jitter on this machine")
        h = self.hosts[name]
        if line:
            tap = f"{self.tag}d{self.names.index(name)}"
            self._recable(name, DelayLine(tap, h.netns, ms / 2, jitter_ms / 2))
            self._shaped.add(name)
            return
        for netns, dev in ((h.netns, "eth0"), (None, h.link)):
            p = _tc(netns, "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{ms / 2}ms",
                    f"{jitter_ms / 2}ms")
            if p.returncode != 0:
                raise RuntimeError(f"tc netem on {name}: {p.stderr.strip()}")
        self._shaped.add(name)

    def delayed_by_line(self) -> list[str]:
        """The hosts whose link runs through a delay line now."""
        return sorted(n for n, ln in self._lines.items() if ln.alive)

    def unshape(self, name: str) -> None:
        """Undo :meth:`limit` and :meth:`delay` for the host (a delay line's host gets its veth back)."""
        h = self.hosts[name]
        self._limits.pop(name, None)
        if name in self._lines:
            self._recable(name, None)  # a new veth: no qdisc on it
        else:
            for netns, dev in ((h.netns, "eth0"), (None, h.link)):
                _tc(netns, "qdisc", "del", "dev", dev, "root")
        self._shaped.discard(name)

    def heal(self, a: str | Iterable[str] | None = None, b: str | Iterable[str] | None = None) -> None:
        """Undo link faults: between ``a`` and ``b`` (both ways), or every one when not given."""
        if a is None or b is None:
            for src, dst in sorted(self._dropped):
                self.undrop(src, dst)
            for name in sorted(self._isolated):
                self.rejoin(name)
            for name in sorted(self._shaped):
                self.unshape(name)
            return
        for x in self._group(a):
            for y in self._group(b):
                self.undrop(x, y)
                self.undrop(y, x)

    def faults(self) -> list[str]:
        """The link faults in force, as words (``drop meta->stor1``, ``isolate gpu1``)."""
        return ([f"drop {s}->{d}" for s, d in sorted(self._dropped)] + [f"isolate {n}" for n in sorted(self._isolated)]
                + [f"shaped {n}" for n in sorted(self._shaped)])
