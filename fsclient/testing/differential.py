"""A differential exerciser for the write path, in the spirit of fsx.

A seeded random sequence of file operations -- open in several modes, write at
the current position (1 byte up to past the write-behind window), seek and
pwrite anywhere (back over ranges still in flight included), read, truncate,
flush, fsync, close and reopen -- is applied at once to a file on a local disk
(the oracle) and to the same file through a stripefs route (the native client,
the FUSE mount). After every ``fsync`` and every ``close`` the whole stripefs
file is read back through a fresh handle and compared byte for byte with the
oracle; every ``read`` through the open handles is compared too.

The operations are chosen from the seed and the oracle's state only, so a seed
replays exactly. A divergence fails with the seed, the operation number and the
operation list (``replay`` runs such a list again). ``STRIPEFS_DIFF_SEEDS``
(``"17"``, ``"0-499"``, ``"3,8,20-30"``) overrides the seeds a test runs: a
single seed to replay, or many for a soak. ``python -m stripefs.bench.soak`` runs it for
minutes over every route.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from ..core import Client

__all__ = ["Route", "LocalRoute", "NativeRoute", "MountRoute", "Divergence", "parse_seeds", "run_seed", "replay"]

Op = tuple[Any, ...]

#: Modes a file is reopened with (``wb`` truncates: rarer).
REOPEN_MODES = ("r+b", "r+b", "r+b", "ab", "a+b", "rb", "wb", "w+b")


class Route(Protocol):
    """One way to reach a file: open it, drive a handle, read the file back whole."""

    name: str

    def open(self, path: str, mode: str, who: int) -> Any:
        """Open ``path`` with ``mode``; ``who`` picks one of the route's clients (0 or 1)."""

    def pwrite(self, handle: Any, data: bytes, offset: int) -> None:
        """Write at ``offset`` without moving the handle's position."""

    def fsync(self, handle: Any) -> None:
        """Make the handle's writes durable and visible to new opens."""

    def write(self, handle: Any, data: bytes) -> None:
        """Write all of ``data`` at the handle's position."""

    def read(self, handle: Any, n: int) -> bytes:
        """Read up to ``n`` bytes at the handle's position (short only at the end)."""

    def contents(self, path: str) -> list[tuple[str, bytes]]:
        """The file's bytes as seen through fresh opens: ``[(how, data), ...]``."""


class LocalRoute:
    """A directory on a local (or FUSE-mounted) file system, through Python's ``open``.

    Args:
        root: the directory files live in.
        name: the route's name in failure reports.
    """

    def __init__(self, root: str, name: str = "local"):
        self.root = root
        self.name = name

    def open(self, path: str, mode: str, who: int) -> Any:
        # Unbuffered: every operation is one system call, and tell() is exact. (A buffered
        # append-mode object reports the position from before a truncate plus what it
        # buffers, and its buffer size follows st_blksize, which differs between the
        # local disk and the mount.)
        return open(os.path.join(self.root, path), mode, buffering=0)  # noqa: SIM115 - the exerciser closes it

    def pwrite(self, handle: Any, data: bytes, offset: int) -> None:
        _write_all(lambda view, at: os.pwrite(handle.fileno(), view, at), data, offset)

    def fsync(self, handle: Any) -> None:
        os.fsync(handle.fileno())

    def write(self, handle: Any, data: bytes) -> None:
        """Write at the handle's position (a raw file may write less than asked: loop)."""
        _write_all(lambda view, _at: handle.write(view), data, 0)

    def read(self, handle: Any, n: int) -> bytes:
        """Read up to ``n`` bytes, short only at the end of the file."""
        parts: list[bytes] = []
        while n > 0:
            got = handle.read(n)
            if not got:
                break
            parts.append(got)
            n -= len(got)
        return b"".join(parts)

    def contents(self, path: str) -> list[tuple[str, bytes]]:
        with open(os.path.join(self.root, path), "rb") as f:
            return [(self.name, f.read())]


class NativeRoute:
    """Files under ``root`` of a cluster through two native clients (close-to-open hand-offs)."""

    name = "native"

    def __init__(self, clients: "tuple[Client, Client]", root: str):
        self.clients, self.root = clients, root

    def open(self, path: str, mode: str, who: int) -> Any:
        return self.clients[who].open(f"{self.root}/{path}", mode)

    def pwrite(self, handle: Any, data: bytes, offset: int) -> None:
        handle.pwrite(data, offset)

    def fsync(self, handle: Any) -> None:
        handle.fsync()

    def write(self, handle: Any, data: bytes) -> None:
        assert handle.write(data) == len(data)

    def read(self, handle: Any, n: int) -> bytes:
        return handle.read(n)

    def contents(self, path: str) -> list[tuple[str, bytes]]:
        return [(f"client {i}", c.read_bytes(f"{self.root}/{path}")) for i, c in enumerate(self.clients)]


class MountRoute(LocalRoute):
    """Files in a directory of a FUSE mount; read back through the mount and a native client."""

    def __init__(self, mdir: str, client: "Client", cluster_dir: str):
        super().__init__(mdir, "fuse")
        self.client, self.cluster_dir = client, cluster_dir

    def contents(self, path: str) -> list[tuple[str, bytes]]:
        return [*super().contents(path), ("native client", self.client.read_bytes(f"{self.cluster_dir}/{path}"))]


def _write_all(write: Callable[[memoryview, int], int], data: bytes, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += write(view[done:], offset + done)


@dataclass
class Divergence(AssertionError):
    """The stripefs file and the oracle differ."""

    report: str

    def __str__(self) -> str:
        return self.report


def parse_seeds(default: range | list[int]) -> list[int]:
    """The seeds to run: ``STRIPEFS_DIFF_SEEDS`` when set (``"5"``, ``"0-99"``, ``"1,4-6"``), else ``default``.

    Args:
        default: seeds used when the variable is not set.

    Returns:
        The seed list.
    """
    spec = os.environ.get("STRIPEFS_DIFF_SEEDS", "").strip()
    if not spec:
        return list(default)
    seeds: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def payload(n: int, dseed: int) -> bytes:
    """The bytes of one write: distinct per write, so a lost or reordered write shows."""
    return random.Random(dseed).randbytes(n)


class Generator:
    """Chooses the next operation from the seed and the oracle's current state.

    Args:
        seed: the sequence's seed.
        chunk: the file's chunk size (sizes and positions cluster around its multiples).
        window: the client's write-behind window (some writes are larger).
        max_size: positions and writes stay below this many bytes.
        reopen_modes: the modes a file is reopened with (what the route can open).
        kinds: the operations the route can express (default: all).
    """

    def __init__(self, seed: int, chunk: int, window: int, max_size: int,
                 reopen_modes: tuple[str, ...] = REOPEN_MODES, kinds: frozenset[str] | None = None):
        self.rng = random.Random(seed)
        self.chunk, self.window, self.max_size = chunk, window, max_size
        self.reopen_modes, self.kinds = reopen_modes, kinds
        self.last: tuple[int, int] = (0, 0)  # the most recent write's range: seeks like to go back into it

    def size(self) -> int:
        r, c = self.rng, self.chunk
        kind = r.random()
        if kind < 0.35:
            return r.randint(1, 4096)
        if kind < 0.55:
            return r.randint(4096, c)
        if kind < 0.75:
            return r.randint(c, 3 * c)  # more than one chunk: sent from a background thread
        if kind < 0.85:
            return r.randint(self.window, self.window + c)  # more than the write-behind window
        return max(1, r.choice((c - 1, c, c + 1, self.window - 1, self.window, 100)))

    def position(self, length: int) -> int:
        r = self.rng
        kind = r.random()
        lo, hi = self.last
        if kind < 0.35 and hi > lo:
            pos = r.randrange(lo, hi)  # back over bytes just written (maybe still in flight)
        elif kind < 0.5:
            pos = 0
        elif kind < 0.7:
            pos = r.randint(0, length)
        elif kind < 0.8:
            pos = length
        elif kind < 0.9:
            pos = length + r.randint(1, self.chunk)  # past the end: a hole
        else:
            pos = max(0, r.randint(0, length) // self.chunk * self.chunk + r.randint(-3, 3))
        return min(pos, self.max_size - 1)

    def next(self, mode: str, pos: int, length: int) -> Op:
        """The next operation for a handle opened with ``mode`` at ``pos`` in a file of ``length``."""
        r = self.rng
        writable = mode != "rb"
        readable = "r" in mode or "+" in mode
        append = "a" in mode
        choices: list[tuple[str, float]] = [("seek", 18), ("close", 6)]
        if writable:
            choices += [("write", 38), ("truncate", 4), ("flush", 4), ("fsync", 5)]
            if not append:  # pwrite on an O_APPEND file appends on Linux: not comparable
                choices.append(("pwrite", 12))
        if readable:
            choices.append(("read", 6))
        if self.kinds is not None:
            choices = [c for c in choices if c[0] in self.kinds]
        kind = r.choices([c[0] for c in choices], [c[1] for c in choices])[0]
        if kind == "write":
            at = length if append else pos
            n = min(self.size(), self.max_size - at)
            if n <= 0:
                return ("seek", self.position(length) // 2)
            self.last = (at, at + n)
            return ("write", n, r.getrandbits(32))
        if kind == "pwrite":
            at = self.position(length)
            n = max(1, min(self.size(), self.max_size - at))
            self.last = (at, at + n)
            return ("pwrite", at, n, r.getrandbits(32))
        if kind == "seek":
            return ("seek", self.position(length))
        if kind == "read":
            return ("read", r.choice((1, 100, 4096, self.chunk + 7, self.window)))
        if kind == "truncate":
            return ("truncate", r.choice((0, r.randint(0, length), length + r.randint(1, self.chunk))))
        if kind == "close":
            return ("close", r.choice(self.reopen_modes), r.randint(0, 1))
        return (kind,)


class Exerciser:
    """Applies operations to the oracle and to a route, comparing as it goes.

    Args:
        route: the stripefs route under test.
        oracle: the local reference.
        path: the file's path, relative to both routes' roots.
        seed: the seed (named in reports only).
        first_mode: the mode the file is opened with first.
    """

    def __init__(self, route: Route, oracle: LocalRoute, path: str, seed: int | None, first_mode: str = "w+b"):
        self.route, self.oracle, self.path, self.seed = route, oracle, path, seed
        self.ops: list[Op] = []
        self.first_mode = first_mode
        self.mode = first_mode
        self.handles: tuple[Any, Any] | None = None
        self.bytes_compared = 0

    # -- state ------------------------------------------------------------------------------
    def oracle_state(self) -> tuple[int, int]:
        """``(position, length)`` of the oracle's open handle."""
        assert self.handles is not None
        h = self.handles[1]
        h.flush()
        return h.tell(), os.fstat(h.fileno()).st_size

    # -- running ----------------------------------------------------------------------------
    def open(self, mode: str, who: int = 0) -> None:
        self.mode = mode
        self.handles = (self.route.open(self.path, mode, who), self.oracle.open(self.path, mode, who))

    def apply(self, op: Op) -> None:
        """Apply one operation to both files; raise :class:`Divergence` on any difference."""
        self.ops.append(op)
        assert self.handles is not None
        theirs, ours = self.handles
        kind = op[0]
        if kind == "write":
            data = payload(op[1], op[2])
            self.oracle.write(ours, data)
            self.route.write(theirs, data)
        elif kind == "pwrite":
            data = payload(op[2], op[3])
            self.oracle.pwrite(ours, data, op[1])
            self.route.pwrite(theirs, data, op[1])
        elif kind == "seek":
            ours.seek(op[1])
            theirs.seek(op[1])
        elif kind == "read":
            want = self.oracle.read(ours, op[1])
            got = self.route.read(theirs, op[1])
            self._compare("read", got, want, base=ours.tell() - len(want))
        elif kind == "truncate":
            ours.truncate(op[1])
            theirs.truncate(op[1])
        elif kind == "flush":
            ours.flush()
            theirs.flush()
        elif kind == "fsync":
            self.oracle.fsync(ours)
            self.route.fsync(theirs)
            self.check()
        elif kind == "close":
            ours.close()
            theirs.close()
            self.handles = None
            self.check()
            self.open(op[1], op[2])
        else:
            raise ValueError(f"unknown operation {op!r}")
        if kind in ("write", "pwrite", "seek", "read", "truncate") and theirs.tell() != ours.tell():
            self._fail(f"position {theirs.tell()} after the operation, the oracle is at {ours.tell()}")

    def finish(self) -> None:
        """Close both handles and compare the files a last time."""
        if self.handles is not None:
            self.ops.append(("close", None, 0))
            theirs, ours = self.handles
            ours.close()
            theirs.close()
            self.handles = None
            self.check()

    def check(self) -> None:
        """Compare the whole file, read back through fresh opens, with the oracle."""
        want = self.oracle.contents(self.path)[0][1]
        for how, got in self.route.contents(self.path):
            self._compare(f"file read back ({how})", got, want)

    # -- reporting --------------------------------------------------------------------------
    def _compare(self, what: str, got: bytes, want: bytes, base: int = 0) -> None:
        self.bytes_compared += len(want)
        if got == want:
            return
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        self._fail(f"{what}: {len(got)} bytes, the oracle has {len(want)}; first difference at "
                   f"offset {base + first} (got {got[first:first + 8].hex() or 'EOF'}, "
                   f"want {want[first:first + 8].hex() or 'EOF'})")

    def _fail(self, why: str) -> None:
        n = len(self.ops)
        listing = "\n".join(f"  {i:4d} {op!r}," for i, op in enumerate(self.ops))
        raise Divergence(
            f"route {self.route.name}, seed {self.seed}, operation {n - 1} {self.ops[-1]!r}: {why}\n"
            f"replay: STRIPEFS_DIFF_SEEDS={self.seed} (or differential.replay with these operations)\n"
            f"operations (the file was opened {self.first_mode!r} first):\n[\n{listing}\n]")


def run_seed(route: Route, oracle: LocalRoute, path: str, seed: int, *, ops: int, chunk: int, window: int,
             max_size: int, first_mode: str = "w+b", reopen_modes: tuple[str, ...] = REOPEN_MODES,
             kinds: frozenset[str] | None = None) -> Exerciser:
    """Run one seeded sequence of ``ops`` operations on ``path``; raise :class:`Divergence` on a difference.

    Args:
        route: the stripefs route under test.
        oracle: the local reference.
        path: the file's path relative to both roots (created; truncated if it exists).
        seed: the sequence's seed.
        ops: how many operations.
        chunk: the file's chunk size.
        window: the client's write-behind window.
        max_size: the file stays below this size.
        first_mode: the mode the file is created with.
        reopen_modes: the modes it is reopened with.
        kinds: the operations the route can express (default: all).

    Returns:
        The exerciser (its ``ops`` and ``bytes_compared``).

    Raises:
        Divergence: the route and the oracle differ (the message lists the operations).
    """
    gen = Generator(seed, chunk, window, max_size, reopen_modes, kinds)
    ex = Exerciser(route, oracle, path, seed, first_mode)
    ex.open(first_mode)
    try:
        for _ in range(ops):
            pos, length = ex.oracle_state()
            ex.apply(gen.next(ex.mode, pos, length))
        ex.finish()
    finally:
        _close_quietly(ex)
    return ex


def replay(route: Route, oracle: LocalRoute, path: str, ops: list[Op], first_mode: str = "w+b") -> Exerciser:
    """Run a printed operation list again (the file is opened with ``first_mode`` first)."""
    ex = Exerciser(route, oracle, path, None, first_mode)
    ex.open(first_mode)
    try:
        for op in ops:
            if op[0] == "close" and op[1] is None:
                ex.finish()
                break
            ex.apply(op)
        ex.finish()
    finally:
        _close_quietly(ex)
    return ex


def _close_quietly(ex: Exerciser) -> None:
    if ex.handles is not None:
        for h in ex.handles:
            try:
                h.close()
            except Exception:  # noqa: BLE001 - the divergence being reported matters more
                pass
        ex.handles = None
