"""A user-space delay line: one host's link through two TAP devices and a forwarding process.

Where the kernel has no ``sch_netem``, :meth:`.netbed.NetBed.delay` falls back to this. The
host's ``eth0`` becomes a TAP device in its namespace and its bridge port another TAP device
in the root namespace; one process (:func:`forward`, run as ``python delayline.py ...``, its
own subprocess) holds the file descriptors of both and copies every frame from one to the
other after the one-way delay::

    host's stack -> eth0 (TAP) -> [forwarder: hold d +- j] -> TAPbr -> bridge -> other hosts
    host's stack <- eth0 (TAP) <- [forwarder: hold d +- j] <- TAPbr <- bridge <- other hosts

One ``read`` and one ``write`` per frame; each direction is a deque of ``(deadline, frame)``
in arrival order (a deadline never precedes the one before it, so jitter never reorders a
direction -- netem's jitter does reorder, unless it is given a rate); the loop sleeps in ``select``
until the next deadline or the next frame (timer slack set to 1 ns, no busy loop). The
devices are not persistent: they vanish with the process, so stopping it (or killing it,
as a bed's sweep kills every process in its namespaces) removes them. The process also
ends when its standard input closes: a bed's owner that dies takes its delay lines along.

Caveats:
    * An emulation with a throughput cap: every frame crosses Python once, so a delayed
      host's link moves at most what one core copies through ``read``/``write`` per
      frame -- measured in docs/deploy.md ("A delay without netem"): ~0.6-1 GB/s with
      65000-byte frames, ~70-100 MB/s with 1500-byte ones on a 2-core VM. Give the bed a
      jumbo MTU (``NetBed(mtu=JUMBO_MTU)``) when a delayed link carries bulk data.
    * Accuracy: a frame leaves within the wake-up latency of ``select`` after its deadline
      (tens of microseconds on an idle machine; more when the CPUs are busy, which is
      what a benchmark makes them): measured round trips sit 0.09-0.16 ms above the
      setting at the median, never below it, and their p99 follows the machine's load.
    * At most :data:`QUEUE_LIMIT` frames wait per direction (netem's default limit); more
      are dropped, as a full queue drops them.
    * Needs ``/dev/net/tun`` and root; setns(2) through ctypes (Python 3.11 has no ``os.setns``).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import select
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

__all__ = ["DelayLine", "forward", "QUEUE_LIMIT"]

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
CLONE_NEWNET = 0x40000000
PR_SET_TIMERSLACK = 29
QUEUE_LIMIT = 1000  # frames waiting per direction (netem's default ``limit``)
FRAME_MAX = 65536 + 64  # the largest TAP MTU (65521) plus an Ethernet header, rounded up
BURST = 64  # frames read from one device per wake-up before the deadlines are looked at again
READY_WITHIN = 10.0  # seconds for the forwarder to make its devices


def _open_tap(name: str) -> int:
    """Open (creating it, not persistent) the TAP device ``name`` in this process's network namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _setns(path: str) -> None:
    """Move this process into the network namespace at ``path`` (e.g. ``/run/netns/NAME``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def forward(a: int, b: int, one_way: float, jitter: float, control: int, seed: int = 0,
            limit: int = QUEUE_LIMIT) -> None:
    """Copy frames between ``a`` and ``b``, each held ``one_way`` +- ``jitter`` seconds, until
    ``control`` reads end-of-file.

    Args:
        a, b: non-blocking TAP file descriptors (one frame per read and per write).
        control: a descriptor whose end-of-file (the owner gone) ends the loop.
        limit: frames that may wait per direction; a frame arriving at a full queue is dropped.
    """
    rng = random.Random(seed)
    queues: dict[int, deque[tuple[float, bytes]]] = {a: deque(), b: deque()}
    last = {a: 0.0, b: 0.0}  # the latest deadline per direction: FIFO under jitter
    other = {a: b, b: a}
    watched = [a, b, control]
    clock = time.monotonic
    while True:
        now = clock()
        due = None
        for src, q in queues.items():
            dst = other[src]
            while q and q[0][0] <= now:
                try:
                    os.write(dst, q.popleft()[1])
                except OSError:
                    pass  # the far device is down (a pulled cable): the frame is lost, as on a wire
            if q and (due is None or q[0][0] < due):
                due = q[0][0]
        ready, _, _ = select.select(watched, [], [], None if due is None else max(0.0, due - now))
        if not ready:
            continue
        now = clock()
        for fd in ready:
            if fd == control:
                if not os.read(control, 4096):
                    return
                continue
            q = queues[fd]
            for _ in range(BURST):
                try:
                    frame = os.read(fd, FRAME_MAX)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break  # the device went down under us: nothing to read until it is up again
                if len(q) >= limit:
                    continue  # a full queue drops the frame
                hold = one_way + (rng.uniform(-jitter, jitter) if jitter else 0.0)
                last[fd] = at = max(now + max(0.0, hold), last[fd])
                q.append((at, frame))


@dataclass
class DelayLine:
    """The forwarding process for one host: makes ``bridge_tap`` (root namespace) and ``eth0``
    (in ``netns``), then delays both directions (module docstring).

    Args:
        bridge_tap: the name of the bridge's end (the caller enslaves it to the bridge).
        netns: the host's network namespace (``ip netns`` name).
        one_way_ms, jitter_ms: the delay each way and its spread (uniform), in milliseconds.
    """

    bridge_tap: str
    netns: str
    one_way_ms: float
    jitter_ms: float = 0.0
    host_tap: str = "eth0"
    proc: subprocess.Popen[str] | None = field(default=None, repr=False)

    def start(self) -> DelayLine:
        """Start the forwarder and wait until both devices exist.

        Raises:
            RuntimeError: the forwarder failed to make its devices (its error in the message).
        """
        argv = [sys.executable, "-I", os.path.abspath(__file__), self.bridge_tap, f"/run/netns/{self.netns}",
                self.host_tap, str(self.one_way_ms / 1000), str(self.jitter_ms / 1000)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_WITHIN)
        line = self.proc.stdout.readline().strip() if ready else ""
        if line != "ready":
            self.stop()
            err = self.proc.stderr.read().strip() if self.proc.stderr else ""
            raise RuntimeError(f"delay line {self.bridge_tap}: the forwarder did not start: {err or 'no answer'}")
        return self

    def stop(self) -> None:
        """End the forwarder and wait for it: its devices are gone when this returns."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        _wait_gone(self.bridge_tap)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _wait_gone(link: str, within: float = 5.0) -> None:
    """Wait until the root namespace has no device ``link`` (a closed TAP is removed asynchronously)."""
    end = time.monotonic() + within
    while os.path.exists(f"/sys/class/net/{link}") and time.monotonic() < end:
        time.sleep(0.005)


def _main(argv: list[str]) -> int:
    bridge_tap, netns_path, host_tap, one_way, jitter = argv
    _libc().prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake at the deadline, not up to 50 us after it
    a = _open_tap(bridge_tap)  # in the root namespace, where this process starts
    _setns(netns_path)
    b = _open_tap(host_tap)  # in the host's: a bed's sweep finds (and kills) this process there
    print("ready", flush=True)
    forward(b, a, float(one_way), float(jitter), sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
