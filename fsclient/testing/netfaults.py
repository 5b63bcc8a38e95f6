"""Link-fault schedules against a cluster whose roles run on hosts of a :class:`~.netbed.NetBed`.

:class:`BedCluster` walks docs/deploy.md on the bed: ``stripefs serve metadata`` on host
``meta``, ``stripefs token``, ``stripefs serve storage --join`` on ``stor1..N``, ``stripefs
client-config`` on ``gpu1..M`` -- the real commands, each in its host's network namespace,
on the hosts' own addresses. The root namespace is the operator's console (it reaches
every host over the bridge and is never cut off, except from a host whose cable is pulled).

:func:`run_link_schedule` writes the initial files, starts writer and reader processes
on the client hosts (:mod:`.faults`' workers, each with its host's cluster.json), and plays
a seeded :class:`LinkSchedule`, one link fault at a time:

* ``storage``: one storage host partitioned from every other host;
* ``meta-split``: the metadata service partitioned from some storage hosts, not the others
  (those still reach each other and the clients);
* ``drop``: one direction between two hosts, at least one a server (asymmetric loss);
* ``client``: a client host's cable pulled, briefly;
* ``slow``: a storage host's link limited to 20 mbit/s (``tc tbf``) -- a slow link.

Cuts last less than the failure timeout (nobody declares anything) or longer. Afterwards
every link heals, the cluster heals, and the history is judged by :func:`.history.check`
(nothing acknowledged lost, no stale read, no bytes never written), every chunk's replicas
must agree, and no split brain was seen (:func:`split_brain`: before each heal and after it,
no storage server answers reads for a chain the table no longer gives it, and no chain
lists a server twice).

Operations may fail only where the cluster cannot route around a fault: those of a client
while its cable is out, and any overlapping an asymmetric ``drop`` (membership sees every
heartbeat and keeps the chain as it is; the writes through the cut link wait for the heal
and may time out). Any other failure is a violation, as under :mod:`.faults`.

``STRIPEFS_FAULTS_INJECT=cut-lost`` is the checker's self-test here too (stale reads).

Run one: ``python -m stripefs.fsclient.testing.netfaults --seed 3``; many:
``python -m stripefs.bench.net_soak --minutes 10``.

Caveats:
    * Needs what :class:`~.netbed.NetBed` needs (root, iproute2, network namespaces).
    * The schedules add no delay: the links are veths, a few microseconds each (a delay,
      ``NetBed.delay``, is netem or, without it, the bed's user-space delay line, which
      caps a host's bandwidth; see docs/deploy.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from stripefs.wire import ErrorCode, StripefsError
from stripefs.wire import messages as m

from ..core import Client
from .faults import (OFFLINE_AFTER, REPORT, Outcome, _spawn_worker, final_content, replica_mismatches, wait_healthy,
                     wait_workers, write_initial)
from .history import Op, check, load
from .netbed import NetBed

__all__ = ["BedCluster", "LinkEvent", "LinkSchedule", "KINDS", "NetOutcome", "run_link_schedule", "split_brain"]

KINDS = ("storage", "meta-split", "drop", "client", "slow")
META_PORT, STORAGE_PORT = 7300, 7400
READY_WITHIN = 60.0  # seconds for a role to start (interpreter start-up on a loaded machine included)
SLOW_RATE = "20mbit"
ERROR_GRACE = 3.0  # seconds after a heal during which an operation begun in the cut may still fail
PROBE_TIMEOUT = 2.0  # seconds a split-brain probe waits for a storage server's answer


def _stripefs(*args: str) -> list[str]:
    return [sys.executable, "-m", "stripefs", *args]


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@dataclass
class BedCluster:
    """The roles of a cluster on a bed's hosts, started with the deploy walk's commands."""

    bed: NetBed
    root: str
    storage: list[str]  # host names
    clients: list[str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    file: str = ""  # the operator's cluster.json (client credential)
    server_file: str = ""  # the operator's servers' file (the secret: ListChunks for the checker)

    @property
    def meta_addr(self) -> str:
        return f"{self.bed.host('meta').addr}:{META_PORT}"

    def client_file(self, host: str) -> str:
        """The cluster.json ``stripefs client-config`` wrote on client host ``host``."""
        return os.path.join(self.root, host, "cluster.json")

    @classmethod
    def start(cls, bed: NetBed, root: str, *, replicas: int = 2, chunk_size: int = 256 * 1024,
              gc_grace: float = 2.0) -> BedCluster:
        """Start the roles on ``bed``: hosts ``meta``, ``stor*`` and ``gpu*`` (by name).

        Raises:
            StripefsError: a role did not start, or a command of the walk failed (its output in the message).
        """
        names = list(bed.hosts)
        self = cls(bed, os.path.abspath(root), [n for n in names if n.startswith("stor")],
                   [n for n in names if n.startswith("gpu")])
        os.makedirs(os.path.join(self.root, "logs"), exist_ok=True)
        try:
            self._walk(replicas, chunk_size, gc_grace)
        except BaseException:
            self.stop()
            raise
        return self

    def _walk(self, replicas: int, chunk_size: int, gc_grace: float) -> None:
        meta, state = self.bed.host("meta"), os.path.join(self.root, "meta")
        self._serve("meta", ["serve", "metadata", "--state", state, "--listen", self.meta_addr, "--replicas",
                             str(replicas), "--chunk-size", str(chunk_size), "--gc-grace", str(gc_grace),
                             "--admit-after", "0"], os.path.join(self.root, "meta.ready"))
        join, client = os.path.join(self.root, "join.token"), os.path.join(self.root, "client.token")
        _write_private(join, self._run(meta.run(_stripefs("token", "--state", state))))
        _write_private(client, self._run(meta.run(_stripefs("token", "--client", "--state", state))))
        for name in self.storage:
            disk = os.path.join(self.root, name, "disk0")
            os.makedirs(disk, exist_ok=True)
            self._serve(name, ["serve", "storage", "--join", self.meta_addr, "--token-file", join, "--root", disk,
                               "--listen", f"{self.bed.host(name).addr}:{STORAGE_PORT}"],
                        os.path.join(disk, "ready"), wait=False)
        for name in self.storage:
            self._ready(name, os.path.join(self.root, name, "disk0", "ready"))
        for name in self.clients:
            os.makedirs(os.path.join(self.root, name), exist_ok=True)
            self._run(self.bed.host(name).run(_stripefs("client-config", self.meta_addr, "--token-file", client,
                                                        "-o", self.client_file(name))))
        self.file = os.path.join(self.root, "cluster.json")  # the operator's, made from the root namespace
        self._run(subprocess.run(_stripefs("client-config", self.meta_addr, "--token-file", client, "-o", self.file),
                                 capture_output=True, text=True, timeout=60))
        with open(os.path.join(state, "server.json")) as f:  # the operator holds the secret, as meta's host does
            secret = json.load(f)
        host, port = self.meta_addr.rsplit(":", 1)
        self.server_file = os.path.join(self.root, "server.json")
        _write_private(self.server_file, json.dumps({**secret, "role": "server",
                                                     "metadata": {"host": host, "port": int(port)}}))

    @staticmethod
    def _run(p: subprocess.CompletedProcess) -> str:
        if p.returncode != 0:
            raise StripefsError(ErrorCode.IO, f"`{' '.join(map(str, p.args))}` failed: {p.stderr.strip()}")
        return str(p.stdout)

    def _serve(self, host: str, args: list[str], ready: str, wait: bool = True) -> None:
        with open(os.path.join(self.root, "logs", f"{host}.log"), "ab") as log:
            self.procs[host] = self.bed.host(host).popen(_stripefs(*args, "--ready", ready), stdin=subprocess.DEVNULL,
                                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self._ready(host, ready)

    def _ready(self, host: str, ready: str) -> None:
        proc, deadline = self.procs[host], time.monotonic() + READY_WITHIN
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(self.root, "logs", f"{host}.log"), errors="replace") as f:
                    tail = f.read()[-1500:]
                raise StripefsError(ErrorCode.IO, f"{host}: the role did not start (status {proc.poll()}):\n{tail}")
            time.sleep(0.05)

    def client(self) -> Client:
        """A client on the operator's console."""
        return Client(self.file)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)


# -- schedules -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkEvent:
    at: float  # seconds after the traffic started
    action: str  # "cut" or "heal"
    kind: str  # one of KINDS
    pick: int  # chooses the hosts (LinkSchedule.victims)


@dataclass
class LinkSchedule:
    """A seeded list of link faults, one at a time, for ``storage`` storage and ``clients`` client hosts."""

    seed: int
    storage: int
    clients: int
    events: list[LinkEvent] = field(default_factory=list)

    @classmethod
    def generate(cls, seed: int, storage: int = 3, clients: int = 2, duration: float = 20.0,
                 kinds: tuple[str, ...] = KINDS) -> LinkSchedule:
        rng = random.Random(seed)
        events: list[LinkEvent] = []
        t = rng.uniform(0.5, 2.0)
        while t < duration:
            kind, pick = rng.choice(kinds), rng.randrange(1 << 16)
            if kind == "client":  # briefly: its own operations fail meanwhile
                down = rng.uniform(0.5, 2.5)
            else:  # healed before anyone noticed, or after the failure timeout
                down = rng.choice([rng.uniform(0.5, 3.0), rng.uniform(OFFLINE_AFTER + 1.0, OFFLINE_AFTER + 4.0)])
            events += [LinkEvent(t, "cut", kind, pick), LinkEvent(t + down, "heal", kind, pick)]
            t += down + rng.uniform(0.5, 3.0)
        return cls(seed, storage, clients, events)

    def victims(self, e: LinkEvent) -> tuple[list[tuple[str, str]], str | None, str | None]:
        """What the event cuts: (directions dropped ``(src, dst)``, the host whose cable is pulled,
        the host whose link is slowed)."""
        stor = [f"stor{i + 1}" for i in range(self.storage)]
        gpus = [f"gpu{i + 1}" for i in range(self.clients)]
        everyone = ["meta", *stor, *gpus]
        rng = random.Random(e.pick)
        if e.kind == "storage":
            v = stor[e.pick % len(stor)]
            return [(a, b) for x in everyone if x != v for a, b in ((v, x), (x, v))], None, None
        if e.kind == "meta-split":  # some storage hosts, never all of them (unless there is one)
            some = rng.sample(stor, 1 + e.pick % max(1, len(stor) - 1))
            return [(a, b) for x in some for a, b in (("meta", x), (x, "meta"))], None, None
        if e.kind == "drop":
            pairs = [(a, b) for a in everyone for b in everyone if a != b and not (a in gpus and b in gpus)]
            return [rng.choice(pairs)], None, None
        if e.kind == "client":
            return [], gpus[e.pick % len(gpus)], None
        if e.kind == "slow":
            return [], None, stor[e.pick % len(stor)]
        raise ValueError(f"unknown link fault {e.kind!r}")

    def describe(self) -> str:
        out = []
        for e in self.events:
            drops, cable, slow = self.victims(e)
            what = (f"{cable} cable" if cable else f"{slow} {SLOW_RATE}" if slow else
                    drops[0][0] + ("->" + drops[0][1] if e.kind == "drop" else
                                   " from all" if e.kind == "storage" else
                                   " from " + "+".join(sorted({b for _, b in drops if b != 'meta'}))))
            out.append(f"{e.at:.1f}s {e.action} {e.kind}({what})")
        return ", ".join(out)


# -- checks ----------------------------------------------------------------------------------
def split_brain(c: Client, ino: int, pairs: list[tuple[int, int]] | None = None, *, fresh: bool = True,
                timeout: float = 4.0) -> list[str]:
    """Signs of two minds about a chain: a chain listing a server twice or a server that is not
    serving, and a storage server answering a read of a chain the table does not give it.

    Args:
        ino: a file's inode (its chunk 0 is what the probes read).
        pairs: the ``(server, chain)`` probes to make (None: every server outside every chain).
        fresh: the probes carry the table's version, so a server behind it refreshes first
            (after a heal: has it converged?); else version 0 (during a cut: does a cut-off
            server still act on the table it had?).
    Returns:
        One line per problem (empty: none seen). A server that cannot be reached, or gives
        up waiting for the metadata service, refused: it did not act.
    """
    problems = []
    st, routing = c.status(), c.routing(refresh=True)
    for ch in st.chains:
        if len(set(ch["targets"])) != len(ch["targets"]):
            problems.append(f"chain {ch['chain_id']} lists a server twice: {ch['targets']}")
    for cid, serving in routing.chains.items():
        states = dict(routing.members.get(cid, ()))
        if len(set(serving)) != len(serving) or any(states.get(s) != "serving" for s in serving):
            problems.append(f"chain {cid}: serving targets {serving} disagree with its members {states}")
    if pairs is None:
        pairs = [(sid, cid) for sid in routing.servers for cid, serving in routing.chains.items() if sid not in serving]
    silent: set[int] = set()  # servers that let a probe time out: waiting for the metadata service
    for sid, cid in pairs:
        serving = routing.chains.get(cid, ())
        if sid in serving or sid in silent:
            continue
        probe = m.ReadChunk(ino=ino, index=0, offset=0, length=1, chain=cid,
                            routing_version=routing.version if fresh else 0)
        try:
            c.call_storage(sid, probe, timeout=timeout)
        except (StripefsError, OSError) as exc:
            if isinstance(exc, TimeoutError):  # its other chains would wait as long: the heal is due
                silent.add(sid)
            continue  # refused (STALE_ROUTING), unreachable, or could not confirm its table
        problems.append(f"server {sid} answered a read of chain {cid}, whose serving targets are {list(serving)} "
                        f"(table v{routing.version}, {'fresh' if fresh else 'version-0'} probe)")
    return problems


@dataclass
class NetOutcome(Outcome):
    split_brain: list[str] = field(default_factory=list)
    tolerated: int = 0  # operations that failed where a fault allowed them to (module docstring)
    cuts: list[str] = field(default_factory=list)  # each fault's kind and time.monotonic() span, as the logs' t0/t1

    @property
    def ok(self) -> bool:
        return super().ok and not self.split_brain

    def report(self, limit: int | None = 10) -> str:
        lines = [super().report(limit)]  # its verdict line says ``self.ok``: split brain counted
        lines += [f"  split brain: {x}" for x in self.split_brain[:limit]]
        lines.append(f"  {self.tolerated} operations failed where a fault allowed it; cuts at {', '.join(self.cuts)}")
        return "\n".join(lines)


@dataclass
class _Window:
    start: float
    end: float
    kind: str
    who: frozenset[str]  # the client hosts whose failures it explains ("drop": all)


def _unexplained(ops: list[Op], windows: list[_Window], host_of: dict[str, str]) -> tuple[list[Op], int]:
    bad, tolerated = [], 0
    for op in ops:
        if op.ok or op.kind == "i":
            continue
        if any(op.t0 < w.end + ERROR_GRACE and op.t1 > w.start and (w.kind == "drop" or host_of.get(op.who) in w.who)
               for w in windows):
            tolerated += 1
        else:
            bad.append(op)
    return bad, tolerated


# -- a run -----------------------------------------------------------------------------------
def _play(bed: NetBed, h: BedCluster, schedule: LinkSchedule, inos: list[int], windows: list[_Window],
          seen: list[str], duration: float) -> None:
    """Play the events (traffic runs meanwhile, for ``duration`` seconds at least).

    The split-brain probes take time (a cut-off server may let one wait ``PROBE_TIMEOUT``):
    the events after them move later by as much, so each cut still lasts as scheduled at least.
    """
    start, lag = time.monotonic(), 0.0
    cut_at: dict[int, float] = {}
    with h.client() as c:
        before = c.routing(refresh=True)
        for e in schedule.events:
            time.sleep(max(0.0, start + lag + e.at - time.monotonic()))
            drops, cable, slow = schedule.victims(e)
            if e.action == "cut":
                before = c.routing(refresh=True)
                for src, dst in drops:
                    bed.drop(src, dst)
                if cable:
                    bed.isolate(cable)
                if slow:
                    bed.limit(slow, SLOW_RATE)
                cut_at[e.pick] = time.monotonic()
                continue
            # Before the heal: does a server the table dropped still act on its old chains?
            probing = time.monotonic()
            now = c.routing(refresh=True)
            gone = [(sid, cid) for cid, ms in before.chains.items() for sid in ms if sid not in now.chains.get(cid, ())]
            seen += split_brain(c, inos[0], gone, fresh=False, timeout=PROBE_TIMEOUT)
            bed.heal()
            windows.append(_Window(cut_at.pop(e.pick), time.monotonic(), e.kind,
                                   frozenset([cable] if cable else [])))
            seen += split_brain(c, inos[0], fresh=True, timeout=PROBE_TIMEOUT)
            lag += time.monotonic() - probing
    time.sleep(max(0.0, start + duration - time.monotonic()))


def run_link_schedule(seed: int, *, storage: int = 3, clients: int = 2, replicas: int = 2, duration: float = 20.0,
                      writers: int = 2, readers: int = 2, root: str | None = None, kinds: tuple[str, ...] = KINDS,
                      namespace: bool = True, schedule: LinkSchedule | None = None) -> NetOutcome:
    """Play one seeded link-fault schedule on a fresh bed and judge it (see the module docstring).

    ``schedule``: play this one instead of a generated one (its ``storage`` and ``clients`` counts win).

    Raises:
        netbed.BedUnavailable: no bed can be made here.
    """
    schedule = schedule or LinkSchedule.generate(seed, storage, clients, duration, kinds)
    storage, clients = schedule.storage, schedule.clients
    root = root or tempfile.mkdtemp(prefix=f"stripefs-netfaults-{seed}-")
    hosts = ["meta", *[f"stor{i + 1}" for i in range(storage)], *[f"gpu{i + 1}" for i in range(clients)]]
    with NetBed(hosts) as bed:
        h = BedCluster.start(bed, os.path.join(root, "cluster"), replicas=replicas)
        procs: list[subprocess.Popen] = []
        try:
            with h.client() as c:
                paths, inos, init = write_initial(c, seed)
            stop, logs, host_of = os.path.join(root, "stop"), [], {}
            for k in range(writers + readers):
                role = "writer" if k < writers else "reader"
                who, gpu = f"{role[0]}{k}", h.clients[k % len(h.clients)]
                logs.append(os.path.join(root, f"{role}{k}.jsonl"))
                host_of[who] = gpu
                spec = {"who": who, "role": role, "seed": f"net-{seed}-{k}", "cluster": h.client_file(gpu),
                        "paths": paths, "inos": inos, "log": logs[-1], "stop": stop,
                        "namespace": namespace and k == 0, "max_seconds": duration + 120}
                procs.append(_spawn_worker(spec, tuple(bed.host(gpu).argv([]))))
            windows: list[_Window] = []
            seen: list[str] = []
            _play(bed, h, schedule, inos, windows, seen, duration)
            bed.heal()
            with open(stop, "w"):
                pass
            crashed = wait_workers(procs, logs)
            with h.client() as c:
                wait_healthy(c, storage)
                final = final_content(c, len(paths))
                seen += split_brain(c, inos[0], fresh=True)
            with Client(h.server_file) as sc:  # ListChunks is for servers only
                differ = replica_mismatches(sc)
            ops = init + load(logs)
            verdict = check(ops, final)
            bad, tolerated = _unexplained(ops, windows, host_of)
            if bad:
                verdict.violations.insert(0, f"{len(bad)} operations failed outside any fault that explains it: "
                                             + "; ".join(f"{o.who} {o.kind} {o.slot} at {o.t0:.3f}: {o.err}"
                                                         for o in bad[:3]))
            outcome = NetOutcome(seed, schedule.describe(), verdict, differ, root, crashed, seen, tolerated,
                                 [f"{w.kind} {w.start:.1f}-{w.end:.1f}" for w in windows])
            with open(os.path.join(root, REPORT), "w") as f:
                f.write(outcome.report(limit=None) + "\n")
            return outcome
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            h.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.fsclient.testing.netfaults",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--storage", type=int, default=3)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"link faults to draw from ({','.join(KINDS)})")
    args = p.parse_args(argv)
    outcome = run_link_schedule(args.seed, storage=args.storage, clients=args.clients, replicas=args.replicas,
                                duration=args.duration, kinds=tuple(args.kinds.split(",")))
    print(outcome.report())
    print(f"  logs: {outcome.root} (the whole report: {os.path.join(outcome.root, REPORT)})")
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
