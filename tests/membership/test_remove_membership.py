"""``Membership.remove`` (stripefs remove-server) on the sans-IO membership, with a fake clock.

Draining moves the server's slots one receiving server at a time through the
add-server machinery (syncing newcomer, SyncDone, the donor leaves); every chain
keeps a serving target at every step; the end state survives a restart of the
service; a removed server never comes back. Without replicas the loss is refused
unless forced.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stripefs.metadata._membership import OFFLINE_AFTER, Membership
from stripefs.wire import ErrorCode, StripefsError
from stripefs.wire import messages as m

from .test_chain_moves import Clock, _beat, _join, _serving_everywhere, _token


def _cluster(tmp_path: Path, n: int, replicas: int) -> tuple[Membership, Clock, dict[int, int]]:
    clock = Clock()
    mb = Membership(str(tmp_path / "servers.json"), replicas=replicas, move_interval=1.0, clock=clock)
    ports = {}
    for i in range(n):
        port = 9001 + i
        ports[_join(mb, port)] = port
    mb.freeze()
    return mb, clock, ports


def _tick(mb: Membership, clock: Clock, ports: dict[int, int], silent: set[int] = frozenset()) -> None:
    clock.t += 1.1
    for sid, port in ports.items():
        if sid not in silent and mb.servers[sid].state != "removed":
            _beat(mb, sid, port)
    mb.sweep()


def test_drain_moves_every_slot_and_keeps_a_serving_target_throughout(tmp_path: Path) -> None:
    mb, clock, ports = _cluster(tmp_path, 4, replicas=2)
    victim = 1
    chains = sorted(c for c, ts in mb.table.items() if victim in ts)
    state, listed, lost = mb.remove(victim)
    assert (state, listed, lost) == ("draining", chains, [])
    for _ in range(40):
        _tick(mb, clock, ports)
        assert _serving_everywhere(mb)
        syncing = [s for s, i in mb.servers.items() if i.state == "syncing"]
        assert len(syncing) <= 1  # one receiving server at a time
        for sid in syncing:
            mb.sync_done(sid)
        if mb.servers[victim].state == "removed":
            break
    assert mb.servers[victim].state == "removed"
    assert not any(victim in ts for ts in mb.table.values())
    assert all(len(ts) == 2 and len(set(ts)) == 2 for ts in mb.table.values())
    assert {c for sid, c in mb.drops if sid == victim} == set(chains)  # its copies are dropped
    # A restarted metadata service knows it is removed; it never takes a slot or registers again.
    again = Membership(str(tmp_path / "servers.json"), replicas=2, clock=clock)
    assert again.servers[victim].state == "removed" and not again.draining
    assert _beat(again, victim, ports[victim]) == "removed"
    clock.t += 10 * OFFLINE_AFTER
    again.sweep()
    assert again.servers[victim].state == "removed"
    with pytest.raises(StripefsError) as info:
        again.register(m.RegisterServer(host="127.0.0.1", port=ports[victim], root=f"/srv/{ports[victim]}",
                                        pid=1, token=_token(ports[victim] % 256)))
    assert info.value.code == ErrorCode.PERMISSION and "removed" in info.value.message
    assert again.remove(victim) == ("removed", [], [])


def test_drain_of_an_offline_server_copies_from_the_other_replicas(tmp_path: Path) -> None:
    # Four servers: a receiving server is syncing (for all its chains) until SyncDone, so one
    # that shares no chain with the offline victim must exist (with three there is none:
    # those chains then keep one replica fewer, see test_two_servers_...).
    mb, clock, ports = _cluster(tmp_path, 4, replicas=2)
    victim = 2
    clock.t += OFFLINE_AFTER + 1
    for sid, port in ports.items():
        if sid != victim:
            _beat(mb, sid, port)
    mb.sweep()
    assert mb.servers[victim].state == "offline"
    assert mb.remove(victim)[0] == "draining"
    for _ in range(40):
        _tick(mb, clock, ports, silent={victim})
        assert all(any(mb.servers[t].state == "serving" for t in ts) for ts in mb.table.values())
        for sid in [s for s, i in mb.servers.items() if i.state == "syncing"]:
            mb.sync_done(sid)
        if mb.servers[victim].state == "removed":
            break
    assert mb.servers[victim].state == "removed"
    assert all(victim not in ts and len(ts) == 2 for ts in mb.table.values())


def test_two_servers_two_replicas_drain_shrinks_chains(tmp_path: Path) -> None:
    mb, clock, ports = _cluster(tmp_path, 2, replicas=2)
    assert mb.remove(1)[0] == "draining"
    for _ in range(5):
        _tick(mb, clock, ports)
    assert mb.servers[1].state == "removed"
    assert all(ts == [2] for ts in mb.table.values())


def test_single_replica_refused_unless_forced(tmp_path: Path) -> None:
    mb, _clock, _ports = _cluster(tmp_path, 2, replicas=1)
    chains = sorted(c for c, ts in mb.table.items() if 2 in ts)
    table, version = {c: list(ts) for c, ts in mb.table.items()}, mb.version
    with pytest.raises(StripefsError) as info:
        mb.remove(2)
    assert info.value.code == ErrorCode.PERMISSION
    assert ", ".join(map(str, chains)) in info.value.message
    assert mb.table == table and mb.version == version and not mb.draining
    state, listed, lost = mb.remove(2, force=True)
    assert (state, listed, lost) == ("removed", chains, chains)
    assert all(mb.table[c] == [] for c in chains)
    with pytest.raises(StripefsError) as info:
        mb.remove(7)
    assert info.value.code == ErrorCode.NOT_FOUND


def test_before_the_first_file_removal_is_immediate(tmp_path: Path) -> None:
    clock = Clock()
    mb = Membership(str(tmp_path / "servers.json"), replicas=1, clock=clock)
    a, b = _join(mb, 9001), _join(mb, 9002)
    chains = sorted(c for c, ts in mb.table.items() if b in ts)
    assert mb.remove(b) == ("removed", chains, [])
    assert all(ts == [a] for ts in mb.table.values())
