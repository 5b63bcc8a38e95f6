"""Chain placement and recovery at scale, on paper: 1,000 storage servers, no socket.

    python -m stripefs.bench.placement_model [--servers 1000] [--replicas 3] [--rack-size 20]
        [--chain-size 1TiB] [--bandwidth 1.25] [--chains-per-server 4] [--seed 0] [--json FILE]

Three designs, each hit by two failures that start from a healthy cluster: one server,
then (separately) a whole rack of ``--rack-size`` servers.

* ``today``: the metadata service's own code. The servers register and are admitted into a
  real :class:`~stripefs.metadata._membership.Membership` (its chain table: chain ``i`` =
  servers ``i..i+R-1`` in id order, ``CHAINS_PER_SERVER`` chains per server), the failed
  ones are taken offline and removed (``remove-server``), and ``place``/``sync_done`` drive
  the drain on a model clock: each step moves the slots of one failed server to one
  receiving server, one step at a time. Each chain is copied from its first serving member,
  as a resyncing storage server picks its source.
* ``today+spread``: today's chain table, recovered by this model's parallel plan
  (:func:`spread`): every affected chain at once, each to the least loaded survivor in
  another rack than the chain's other members, from its least loaded surviving member.
* ``balanced``: a rack-aware, pairwise-balanced table built here (:func:`balanced_table`,
  local search towards a balanced incomplete block design: every server in the same
  number of chains, no two servers share more chains than the design needs, no chain has
  two members in one rack), recovered by the same parallel plan.

The chain table does not know racks, so where a rack sits in the id order decides what a
rack failure does to it: both layouts are modelled, ``contiguous`` (ids 1-20 in rack 0, as
when servers are added rack by rack) and ``striped`` (id ``i`` in rack ``i mod racks``).

Reported per failure and design: chains touched and lost (no replica left), bytes sent and
received per surviving server, time to full redundancy at ``--bandwidth`` GB/s per server
(each step lasts as long as its busiest server; today's steps add up), chains per server
after the recovery; and per table: chains per server, distinct peers per server and the
most chains two servers share.

Caveats:
    * Every server sends and receives ``--bandwidth`` at once (full duplex); disks, CPU,
      the network core and client traffic are not modelled, nor failure detection (5 s)
      or the operator's reaction: times start at ``remove-server``.
    * Every chain holds ``--chain-size`` bytes; ``--chains-per-server`` other than
      today's (4) resizes the balanced design's chains so that a server holds as much.
    * Today nothing re-replicates on its own: a failed server's chains run on R-1
      replicas until it returns (then it resyncs) or is removed. ``remove-server`` is
      refused for a server whose chains would be lost; the model leaves such servers
      (and their chains) as they are and reports the chains left degraded.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import random
import statistics
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from stripefs.bench._report import write_json
from stripefs.bench.floors import parse_size
from stripefs.metadata._membership import CHAINS_PER_SERVER, MOVE_INTERVAL, Membership
from stripefs.wire import StripefsError
from stripefs.wire import messages as m

__all__ = ["Copy", "Recovery", "racks", "today_membership", "drain", "spread",
           "balanced_table", "table_stats", "summary", "check_recovery", "run", "main"]

Table = dict[int, list[int]]


@dataclass(frozen=True)
class Copy:
    """One chain's data copied from ``source`` (a surviving member) to ``target``."""

    chain: int
    source: int
    target: int


@dataclass
class Recovery:
    """What a failure did to a table and how redundancy came back.

    ``steps`` run one after the other (today's drain); the copies of one step run at once.
    ``after`` is the table once the plan ran; ``lost`` the chains with no replica left;
    ``refused`` the failed servers ``remove-server`` refused (their chains would be lost);
    ``peak_degraded`` the most chains with fewer than R serving replicas at one time.
    """

    design: str
    failed: list[int]
    before: Table
    after: Table
    steps: list[list[Copy]] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    peak_degraded: int = 0

    @property
    def copies(self) -> list[Copy]:
        return [c for step in self.steps for c in step]

    @property
    def affected(self) -> list[int]:
        failed = set(self.failed)
        return sorted(c for c, ts in self.before.items() if failed & set(ts))


def racks(n: int, rack_size: int, layout: str) -> dict[int, int]:
    """Server id (1..n) -> rack: ``contiguous`` fills racks in id order, ``striped`` deals ids out."""
    count = -(-n // rack_size)
    if layout == "contiguous":
        return {s: (s - 1) // rack_size for s in range(1, n + 1)}
    if layout == "striped":
        return {s: (s - 1) % count for s in range(1, n + 1)}
    raise ValueError(f"unknown rack layout {layout!r}")


# -- today: the metadata service's membership, driven on a model clock ----------------------

class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def today_membership(n: int, replicas: int) -> Membership:
    """``n`` servers registered and admitted into a real Membership (ids 1..n), table frozen."""
    mb = Membership(None, replicas=replicas, clock=_Clock())
    for i in range(n):
        sid, _ = mb.register(m.RegisterServer(host="10.0.0.1", port=1024 + i, root=f"/srv/{i}", capacity=1 << 40,
                                              used=0, pid=1, token=f"{i + 1:064x}"))
        mb.admit(sid)
    mb.freeze()
    return mb


def drain(healthy: Membership, failed: list[int]) -> Recovery:
    """Take ``failed`` offline and ``remove-server`` them, on a copy of ``healthy``.

    Runs the service's own drain (``place``, ``sync_done``) until it stops moving.
    A step's copies: the chains its receiving server joined, each from the chain's
    first serving member. Chains below R serving replicas are counted on the service's
    own routing (a receiving server is ``syncing`` for all its chains, not only the new).
    """
    mb = copy.deepcopy(healthy)
    clock = mb.clock
    assert isinstance(clock, _Clock)
    before = {c: list(ts) for c, ts in mb.table.items()}
    rec = Recovery("today", sorted(failed), before, before)
    for sid in failed:
        mb.take_offline(sid)
    replicas = mb.replicas

    def degraded() -> int:
        return sum(len(ts) < replicas for ts in mb.routing().chains.values())

    rec.peak_degraded = degraded()
    down = set(failed)
    rec.lost = [c for c, ts in before.items() if set(ts) <= down]
    for sid in failed:
        try:
            mb.remove(sid)
        except StripefsError:  # chains would be lost: refused without --force
            rec.refused.append(sid)
    while True:
        clock.t += MOVE_INTERVAL
        moved = mb.place()  # starts nothing while a move is in flight: each step ends with sync_done
        if moved is None:
            break
        members = mb.routing().members
        # The receiver joined each moved chain at its end; the source is the first serving member.
        step = [Copy(c, next(t for t, st in members[c] if st == "serving" and t != ts[-1]), ts[-1])
                for c, ts in mb.table.items() if c in mb.leaving]
        if step:
            rec.steps.append(step)
            rec.peak_degraded = max(rec.peak_degraded, degraded())
            mb.sync_done(moved)
    rec.after = {c: list(ts) for c, ts in mb.table.items()}
    return rec


# -- the model's parallel recovery plan ------------------------------------------------------

def spread(table: Table, failed: list[int], replicas: int, rack_of: dict[int, int],
           design: str = "spread") -> Recovery:
    """Restore every chain ``failed`` touched, all at once, load spread over the survivors.

    Chains with fewest survivors go first. Each new replica goes to the survivor with
    the fewest chains to receive (then the fewest chain slots) among those outside the
    chain and, where one exists, outside its members' racks (then :func:`_level_targets`). Sources are then chosen among
    each chain's surviving members so that the most any server sends is least
    (:func:`_least_max`). A chain with no survivor is lost.
    """
    down = set(failed)
    servers = sorted({t for ts in table.values() for t in ts} - down)
    recv: Counter[int] = Counter()
    slots: Counter[int] = Counter(t for ts in table.values() for t in ts if t not in down)
    after = {c: [t for t in ts if t not in down] for c, ts in table.items()}
    rec = Recovery(design, sorted(failed), {c: list(ts) for c, ts in table.items()}, after)
    touched = [c for c, ts in table.items() if down & set(ts)]
    rec.peak_degraded = len(touched)  # a receiver keeps serving its other chains (per-chain sync)
    wanted: list[tuple[int, int]] = []  # (chain, target)
    holders: list[list[int]] = []
    for c in sorted(touched, key=lambda c: (len(after[c]), c)):
        held = list(after[c])
        if not held:
            rec.lost.append(c)
            continue
        while len(after[c]) < min(replicas, len(servers)):
            used = {rack_of.get(t) for t in after[c]}
            outside = [s for s in servers if s not in after[c]]
            pool = [s for s in outside if rack_of.get(s) not in used] or outside
            target = min(pool, key=lambda s: (recv[s], slots[s], s))
            recv[target] += 1
            slots[target] += 1
            after[c].append(target)
            wanted.append((c, target))
            holders.append(held)
    _level_targets(wanted, after, servers, rack_of, recv)
    sources = _least_max(holders)
    step = [Copy(c, src, target) for (c, target), src in zip(wanted, sources)]
    rec.steps = [step] if step else []
    return rec


def _level_targets(wanted: list[tuple[int, int]], after: Table, servers: list[int], rack_of: dict[int, int],
                   recv: Counter[int]) -> None:
    """Move new replicas off the busiest receivers while one with two chains fewer can take
    them (outside the chain and its members' racks): the greedy order can leave a receiver
    one chain above what the rack rule allows elsewhere."""
    moved = True
    while moved:
        moved = False
        top = max(recv.values(), default=0)
        for k, (c, target) in enumerate(wanted):
            if recv[target] < top:
                continue
            others = [t for t in after[c] if t != target]
            used = {rack_of.get(t) for t in others}
            free = [s for s in servers if recv[s] <= top - 2 and s not in after[c] and rack_of.get(s) not in used]
            if free:
                new = min(free, key=lambda s: (recv[s], s))
                after[c][after[c].index(target)] = new
                recv[target] -= 1
                recv[new] += 1
                wanted[k] = (c, new)
                moved = True
                break


def _least_max(options: list[list[int]]) -> list[int]:
    """One of ``options[i]`` for each ``i``, so that the most times one is chosen is least.

    The smallest bound for which every copy finds a source (augmenting paths, as in
    bipartite matching with capacities), from the mean upwards.
    """
    distinct = len({h for o in options for h in o})
    bound = max(1, -(-len(options) // max(1, distinct)))
    while True:
        got = _within(options, bound)
        if got is not None:
            return got
        bound += 1


def _within(options: list[list[int]], bound: int) -> list[int] | None:
    """Sources with no server chosen more than ``bound`` times, or None if there are none."""
    chosen: list[int | None] = [None] * len(options)
    owned: dict[int, set[int]] = {}
    for i in range(len(options)):
        parent: dict[int, int] = {}  # source -> the copy that would move to it
        queue, seen, found = deque([i]), {i}, None
        while queue and found is None:
            c = queue.popleft()
            for h in options[c]:
                if h in parent or h == chosen[c]:
                    continue
                parent[h] = c
                if len(owned.setdefault(h, set())) < bound:
                    found = h
                    break
                for c2 in sorted(owned[h] - seen):
                    seen.add(c2)
                    queue.append(c2)
        if found is None:
            return None
        h = found
        while True:  # shift each copy on the path to the source that reached it
            c = parent[h]
            old = chosen[c]
            chosen[c] = h
            owned[h].add(c)
            if old is None:
                break
            owned[old].discard(c)
            h = old
    return [h for h in chosen if h is not None]


# -- the balanced alternative ---------------------------------------------------------------

def balanced_table(servers: list[int], replicas: int, count: int, rack_of: dict[int, int],
                   seed: int = 0) -> Table:
    """``count`` chains of ``replicas`` servers: equal loads, pairs and racks spread evenly.

    Starts from every server dealt ``count * replicas / len(servers)`` slots at random
    (so chains per server differ by one at most, and stay so), then swaps members
    between chains while that lowers the cost: the sum over server pairs of the square
    of the chains they share (least when every pair shares the mean, ``lambda``, or the
    integers next to it: a balanced incomplete block design where one exists), plus a
    penalty per chain with two members in one rack or one server twice. It stops when
    no chain has a server twice, two members in one rack, or a pair above ``ceil(lambda)``,
    or after a bounded number of tries (then some such chains remain: :func:`table_stats`
    shows them).
    """
    rng = random.Random(seed)
    n, r = len(servers), min(replicas, len(servers))
    slots = [servers[i % n] for i in range(count * r)]
    rng.shuffle(slots)
    chains = [slots[i * r:(i + 1) * r] for i in range(count)]
    cap = max(1, math.ceil(count * r * (r - 1) / max(1, n * (n - 1))))
    pairs: Counter[tuple[int, int]] = Counter()
    for ts in chains:
        for a, b in combinations(ts, 2):
            pairs[(min(a, b), max(a, b))] += 1

    def rule(a: int, b: int) -> int:  # what a pair costs besides the square of its count
        return 10_000 if a == b else 100 if rack_of.get(a) == rack_of.get(b) else 0

    def move(x: int, y: int, rest: list[int]) -> int:
        """Replace ``x`` by ``y`` beside ``rest``; returns the change of cost."""
        delta = 0
        for t in rest:
            kx, ky = (min(x, t), max(x, t)), (min(y, t), max(y, t))
            delta += rule(y, t) - rule(x, t) + 1 - 2 * pairs[kx]
            pairs[kx] -= 1
            delta += 2 * pairs[ky] + 1
            pairs[ky] += 1
        return delta

    def bad(ts: list[int]) -> bool:
        return any(rule(a, b) or pairs[(min(a, b), max(a, b))] > cap for a, b in combinations(ts, 2))

    tries = 0
    todo = [i for i, ts in enumerate(chains) if bad(ts)]
    while todo and tries < 200 * count:
        for c in todo:
            for _ in range(50):
                tries += 1
                d, i, j = rng.randrange(count), rng.randrange(r), rng.randrange(r)
                ts, us = chains[c], chains[d]
                x, y = ts[i], us[j]
                if d == c or x == y:
                    continue
                rest_c, rest_d = ts[:i] + ts[i + 1:], us[:j] + us[j + 1:]
                delta = move(x, y, rest_c) + move(y, x, rest_d)
                if delta < 0 or (delta == 0 and rng.random() < 0.3):
                    ts[i], us[j] = y, x
                    if not bad(ts):
                        break
                else:
                    move(x, y, rest_d)  # undo, in reverse order
                    move(y, x, rest_c)
        todo = [i for i, ts in enumerate(chains) if bad(ts)]
    return {i + 1: ts for i, ts in enumerate(chains)}


# -- figures ---------------------------------------------------------------------------------

def _spread_of(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "mean": statistics.fmean(values), "max": max(values),
            "stddev": statistics.pstdev(values)}


def table_stats(table: Table, servers: list[int], rack_of: dict[int, int] | None = None) -> dict[str, Any]:
    """Chains per server, distinct peers per server, most chains one pair shares."""
    per = Counter(t for ts in table.values() for t in ts)
    peers: dict[int, set[int]] = {s: set() for s in servers}
    pairs: Counter[tuple[int, int]] = Counter()
    for ts in table.values():
        for a, b in combinations(ts, 2):
            peers[a].add(b)
            peers[b].add(a)
            pairs[(min(a, b), max(a, b))] += 1
    out = {"chains": len(table), "chains_per_server": _spread_of([float(per[s]) for s in servers]),
           "peers_per_server": _spread_of([float(len(peers[s])) for s in servers]),
           "max_pair_chains": max(pairs.values(), default=0)}
    if rack_of is not None:
        out["chains_with_rack_twice"] = sum(len({rack_of[t] for t in ts}) < len(ts) for ts in table.values())
    return out


def summary(rec: Recovery, replicas: int, chain_size: int, bandwidth: float) -> dict[str, Any]:
    """The figures of one recovery: bytes per surviving server, time, balance after.

    Args:
        chain_size: bytes per chain.
        bandwidth: bytes per second each server can send, and receive, at once.
    """
    down = set(rec.failed)
    survivors = sorted({t for ts in rec.before.values() for t in ts} - down)
    sent: Counter[int] = Counter()
    recv: Counter[int] = Counter()
    seconds = 0.0
    for step in rec.steps:
        s_sent = Counter(c.source for c in step)
        s_recv = Counter(c.target for c in step)
        busiest = max(max(s_sent.values()), max(s_recv.values()))
        seconds += busiest * chain_size / bandwidth  # (today's steps are also >= 1 s apart: negligible)
        sent.update(s_sent)
        recv.update(s_recv)
    load = [float(sent[s] + recv[s]) * chain_size for s in survivors]
    per = Counter(t for ts in rec.after.values() for t in ts if t not in down)
    degraded = [c for c, ts in rec.after.items()
                if c not in rec.lost and len([t for t in ts if t not in down]) < replicas]
    mean = statistics.fmean(load) if load else 0.0
    return {
        "failed": len(rec.failed), "chains_touched": len(rec.affected), "chains_lost": len(rec.lost),
        "chains_degraded_after": len(degraded), "remove_refused": len(rec.refused),
        "copied_bytes": len(rec.copies) * chain_size, "steps": len(rec.steps),
        "servers_sending": len(sent), "servers_receiving": len(recv),
        "max_sent_bytes": max(sent.values(), default=0) * chain_size,
        "max_received_bytes": max(recv.values(), default=0) * chain_size,
        "load_mean_bytes": mean, "load_max_bytes": max(load, default=0.0),
        "load_max_over_mean": max(load) / mean if mean else 0.0,
        "seconds_to_full_redundancy": seconds if not degraded else math.inf,
        "chains_below_r_peak": rec.peak_degraded,
        "chains_per_server_after": _spread_of([float(per[s]) for s in survivors]),
    }


def check_recovery(rec: Recovery, replicas: int) -> list[str]:
    """What is wrong with a recovery (empty when it is right).

    Every touched chain that kept a replica and is not left degraded has ``replicas``
    distinct members afterwards, all survivors; each copy goes from a survivor that
    held the chain before to a survivor that did not; no chain outside the failure moves.
    """
    down = set(rec.failed)
    servers = {t for ts in rec.before.values() for t in ts}
    want = min(replicas, len(servers - down))
    bad = []
    for c in rec.affected:
        ts = rec.after[c]
        if c in rec.lost or any(s in rec.refused for s in rec.before[c]):
            continue
        if len(ts) != want or len(set(ts)) != len(ts) or down & set(ts):
            bad.append(f"chain {c}: {rec.before[c]} -> {ts}")
    for cp in rec.copies:
        if cp.source in down or cp.target in down or cp.source not in rec.before[cp.chain] \
                or cp.target in rec.before[cp.chain]:
            bad.append(f"copy {cp}")
    bad += [f"chain {c} moved" for c, ts in rec.before.items() if not down & set(ts) and rec.after[c] != ts]
    return bad


# -- the run ---------------------------------------------------------------------------------

DESIGNS = ("today", "today+spread", "balanced")


def run(n: int, replicas: int, rack_size: int = 20, chain_size: int = 1 << 40, bandwidth: float = 1.25e9,
        chains_per_server: int = CHAINS_PER_SERVER, seed: int = 0) -> dict[str, Any]:
    """Every design under every failure: ``{"config", "tables", "failures"}`` (see the module doc)."""
    healthy = today_membership(n, replicas)
    today = {c: list(ts) for c, ts in healthy.table.items()}
    servers = list(range(1, n + 1))
    sizes = {"today": chain_size, "today+spread": chain_size,
             "balanced": chain_size * CHAINS_PER_SERVER // chains_per_server}
    victim = (n + 1) // 2
    report: dict[str, Any] = {
        "config": {"servers": n, "replicas": replicas, "rack_size": rack_size, "chain_size": chain_size,
                   "bandwidth": bandwidth, "chains_per_server": chains_per_server, "seed": seed,
                   "balanced_chain_size": sizes["balanced"]},
        "tables": {}, "failures": {}}
    for layout in ("contiguous", "striped"):
        rack_of = racks(n, rack_size, layout)
        balanced = balanced_table(servers, replicas, n * chains_per_server, rack_of, seed)
        tables = {"today": today, "today+spread": today, "balanced": balanced}
        if layout == "contiguous":
            report["tables"] = {d: table_stats(tables[d], servers, rack_of) for d in ("today", "balanced")}
        else:
            report["tables"]["today"]["chains_with_rack_twice_striped"] = \
                table_stats(today, servers, rack_of)["chains_with_rack_twice"]
            report["tables"]["balanced"]["chains_with_rack_twice_striped"] = \
                table_stats(balanced, servers, rack_of)["chains_with_rack_twice"]
        scenarios = {f"rack ({layout})": sorted(s for s in servers if rack_of[s] == rack_of[victim])}
        if layout == "contiguous":
            scenarios = {"one server": [victim], **scenarios}
        for name, failed in scenarios.items():
            recs = {"today": drain(healthy, failed),
                    "today+spread": spread(today, failed, replicas, rack_of, "today+spread"),
                    "balanced": spread(balanced, failed, replicas, rack_of, "balanced")}
            report["failures"][name] = {d: summary(recs[d], replicas, sizes[d], bandwidth) for d in DESIGNS}
    return report


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(s: float) -> str:
    if math.isinf(s):
        return "never"
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def _dist(d: dict[str, float]) -> str:
    return f"{d['min']:.0f} / {d['mean']:.1f} / {d['max']:.0f} / {d['stddev']:.2f}"


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables: the healthy tables, then one table per failure."""
    cfg = report["config"]
    out = [f"{cfg['servers']} servers, R={cfg['replicas']}, racks of {cfg['rack_size']}, "
           f"chain {_human(cfg['chain_size'])} (balanced: {_human(cfg['balanced_chain_size'])}), "
           f"{cfg['bandwidth'] / 1e9:g} GB/s per server each way", "",
           "| table | today | balanced |", "|---|---|---|"]
    t, b = report["tables"]["today"], report["tables"]["balanced"]
    rows = [("chains", "chains", str), ("chains per server min / mean / max / stddev", "chains_per_server", _dist),
            ("distinct peers per server min / mean / max / stddev", "peers_per_server", _dist),
            ("most chains two servers share", "max_pair_chains", str),
            ("chains with two members in one rack (contiguous)", "chains_with_rack_twice", str),
            ("chains with two members in one rack (striped)", "chains_with_rack_twice_striped", str)]
    out += [f"| {label} | {fmt(t[key])} | {fmt(b[key])} |" for label, key, fmt in rows]
    frows = [("chains touched", "chains_touched", str), ("chains lost (no replica left)", "chains_lost", str),
             ("remove-server refused", "remove_refused", str), ("copy steps, one after the other", "steps", str),
             ("bytes copied", "copied_bytes", _human), ("servers sending / receiving", None, None),
             ("most sent by one server", "max_sent_bytes", _human),
             ("most received by one server", "max_received_bytes", _human),
             ("recovery load per survivor: mean", "load_mean_bytes", _human),
             ("recovery load per survivor: max (max/mean)", None, None),
             ("time to full redundancy", "seconds_to_full_redundancy", _duration),
             ("chains below R serving replicas, most at once", "chains_below_r_peak", str),
             ("chains left degraded", "chains_degraded_after", str),
             ("chains per server after min / mean / max / stddev", "chains_per_server_after", _dist)]
    for name, res in report["failures"].items():
        out += ["", f"**{name} fails** ({res['today']['failed']} server{'s' if res['today']['failed'] > 1 else ''})",
                "", "| | " + " | ".join(DESIGNS) + " |", "|---|" + "---|" * len(DESIGNS)]
        for label, key, fmt in frows:
            if label.startswith("servers sending"):
                cells = [f"{r['servers_sending']} / {r['servers_receiving']}" for r in res.values()]
            elif key is None:
                cells = [f"{_human(r['load_max_bytes'])} ({r['load_max_over_mean']:.1f})" for r in res.values()]
            else:
                cells = [fmt(res[d][key]) for d in DESIGNS]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.placement_model",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--servers", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--rack-size", type=int, default=20, help="servers per rack (default 20)")
    p.add_argument("--chain-size", type=parse_size, default=1 << 40, help="bytes per chain (default 1TiB)")
    p.add_argument("--bandwidth", type=float, default=1.25,
                   help="GB/s each server can send and receive for recovery (default 1.25, 10 Gbit/s)")
    p.add_argument("--chains-per-server", type=int, default=CHAINS_PER_SERVER,
                   help=f"chains per server of the balanced design (today: {CHAINS_PER_SERVER})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    a = p.parse_args(argv)
    # The membership logs every server it takes offline and every chain it moves: thousands here.
    logging.getLogger("stripefs.metadata._membership").setLevel(logging.ERROR)
    if a.replicas < 1 or a.servers < a.replicas or a.rack_size < 1 or a.bandwidth <= 0 or a.chains_per_server < 1:
        p.error("need servers >= replicas >= 1, rack size >= 1, bandwidth > 0, chains per server >= 1")
    report = run(a.servers, a.replicas, a.rack_size, a.chain_size, a.bandwidth * 1e9, a.chains_per_server, a.seed)
    report["config"]["command"] = ["python", "-m", "stripefs.bench.placement_model", *(argv or sys.argv[1:])]
    print(markdown(report))
    if a.json:
        write_json(report, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
