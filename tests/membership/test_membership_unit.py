"""Membership driven directly by an injected clock (issue 14): failure detection, returns,
and which targets may serve a chain, as unit and property tests -- no processes, no sleeps.

The property: whatever the order of deaths, returns, resyncs and writes, a target the
routing lists as serving a chain holds every write that chain acknowledged. Writes are
modelled as chain replication does them: acknowledged only while the chain has a
serving target, and then every member in forward order (serving, then syncing) has them.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stripefs.metadata._membership import OFFLINE_AFTER, Membership
from tests.membership.test_chain_moves import Clock, _beat, _join, _token
from stripefs.wire import messages as m


def _cluster(tmp: Path, servers: int, replicas: int) -> tuple[Membership, Clock, dict[int, int]]:
    clock = Clock()
    mb = Membership(str(tmp / "servers.json"), replicas=replicas, clock=clock)
    ports = {}
    for k in range(servers):
        ports[_join(mb, 7000 + k)] = 7000 + k
    mb.freeze()
    return mb, clock, ports


def _states(mb: Membership) -> dict[int, str]:
    return {sid: s.state for sid, s in mb.servers.items()}


def test_a_silent_server_is_offline_after_the_timeout_not_before(tmp_path: Path) -> None:
    mb, clock, ports = _cluster(tmp_path, 3, 2)
    victim = min(ports)
    version = mb.routing().version
    for _ in range(int(OFFLINE_AFTER)):  # the others keep heartbeating every second
        clock.t += 1.0
        for sid, port in ports.items():
            if sid != victim:
                _beat(mb, sid, port)
        mb.sweep()
        assert _states(mb)[victim] == "serving"
    clock.t += 0.5
    mb.sweep()
    assert _states(mb)[victim] == "offline"
    routing = mb.routing()
    assert routing.version > version
    assert all(victim not in ts for ts in routing.chains.values())
    assert _beat(mb, victim, ports[victim]) == "syncing"  # its peers served meanwhile: it missed writes
    assert all(victim not in ts for ts in mb.routing().chains.values())
    mb.sync_done(victim)
    assert _states(mb)[victim] == "serving"


def test_one_replica_returns_serving(tmp_path: Path) -> None:
    mb, clock, ports = _cluster(tmp_path, 2, 1)
    victim = min(ports)
    clock.t += OFFLINE_AFTER + 1
    _beat(mb, max(ports), ports[max(ports)])
    mb.sweep()
    assert _states(mb)[victim] == "offline"
    assert _beat(mb, victim, ports[victim]) == "serving"  # nobody else holds its chains


def test_the_last_serving_target_serves_its_chain_while_it_resyncs_the_others(tmp_path: Path) -> None:
    mb, clock, ports = _cluster(tmp_path, 3, 2)
    a, b, c = sorted(ports)
    chain_ab = next(ch for ch, ts in mb.table.items() if set(ts) == {a, b})
    _die(mb, clock, ports, a)
    _beat(mb, a, ports[a])  # back, syncing: b and c served meanwhile
    assert _states(mb)[a] == "syncing"
    _die(mb, clock, ports, b, alive={a, c})  # b dies while a still syncs: chain ab is served by nobody
    assert mb.routing().chains[chain_ab] == ()
    assert _beat(mb, b, ports[b]) == "syncing"  # c kept serving b's other chains
    routing = mb.routing()
    assert routing.chains[chain_ab] == (b,)  # b alone has what chain ab acknowledged
    assert all(b not in ts for ch, ts in routing.chains.items() if ch != chain_ab and a not in mb.table[ch])
    mb.sync_done(a)  # a copies chain ab from b
    mb.sync_done(b)
    assert set(_states(mb).values()) == {"serving"} and not mb.lastsrv


def _bounce(mb: Membership, sid: int, port: int) -> str:
    """A restart faster than failure detection: the server registers again and is admitted."""
    got, _ = mb.register(m.RegisterServer(host="127.0.0.1", port=port, root=f"/srv/{port}", capacity=1 << 30, used=0,
                                          pid=999, token=_token(port % 256), server_id=sid))
    assert got == sid
    return mb.admit(sid)


def test_a_quick_restart_of_a_chains_only_serving_target_keeps_it_serving_that_chain(tmp_path: Path) -> None:
    mb, clock, ports = _cluster(tmp_path, 3, 2)
    a, b, c = sorted(ports)
    chain_ab = next(ch for ch, ts in mb.table.items() if set(ts) == {a, b})
    _die(mb, clock, ports, a)
    _beat(mb, a, ports[a])  # a resyncs: b alone serves chain ab
    assert _bounce(mb, b, ports[b]) == "syncing"  # b restarted before anyone noticed; c served its other chain
    assert mb.routing().chains[chain_ab] == (b,)  # else a and b would each wait for the other


def _die(mb: Membership, clock: Clock, ports: dict[int, int], sid: int, alive: set[int] | None = None) -> None:
    clock.t += OFFLINE_AFTER + 1
    for other in alive if alive is not None else set(ports) - {sid}:
        if mb.servers[other].state != "offline":
            _beat(mb, other, ports[other])
    mb.sweep()
    assert mb.servers[sid].state == "offline"


events = st.lists(st.tuples(st.sampled_from(["die", "return", "bounce", "sync", "write"]), st.integers(0, 100)),
                  min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(servers=st.integers(2, 4), replicas=st.integers(2, 3), steps=events)
def test_a_serving_target_holds_every_acknowledged_write(tmp_path_factory, servers: int, replicas: int,
                                                         steps: list[tuple[str, int]]) -> None:
    replicas = min(replicas, servers)
    mb, clock, ports = _cluster(tmp_path_factory.mktemp("mb"), servers, replicas)
    ids = sorted(ports)
    complete = {(ch, t) for ch, ts in mb.table.items() for t in ts}  # (chain, target) holding every ack
    dead: set[int] = set()
    for kind, pick in steps:
        sid = ids[pick % len(ids)]
        if kind == "die" and sid not in dead:
            dead.add(sid)
            clock.t += OFFLINE_AFTER + 1
            for other in set(ids) - dead:
                _beat(mb, other, ports[other])
            mb.sweep()  # it keeps what it had; it misses the writes acknowledged while it is away
        elif kind == "return" and sid in dead:
            dead.discard(sid)
            _beat(mb, sid, ports[sid])
        elif kind == "bounce" and sid not in dead:
            _bounce(mb, sid, ports[sid])  # it kept everything: a restart between two writes
        elif kind == "sync" and sid not in dead and mb.servers[sid].state == "syncing":
            routing = mb.routing()
            mine = [ch for ch, ts in mb.table.items() if sid in ts]
            # The storage server reports SyncDone only once it copied every chain from a serving peer.
            if all(routing.chains[ch] for ch in mine):
                for ch in mine:
                    assert any((ch, t) in complete for t in routing.chains[ch])
                mb.sync_done(sid)
                complete |= {(ch, sid) for ch in mine}
        elif kind == "write":
            ch = sorted(mb.table)[pick % len(mb.table)]
            routing = mb.routing()
            if routing.chains[ch]:  # acknowledged: every live member in forward order has it
                got = set(routing.forward_order(ch)) - dead
                complete = {(c, t) for c, t in complete if c != ch or t in got}
        routing = mb.routing()
        for ch, ts in routing.chains.items():
            for t in ts:
                assert (ch, t) in complete, f"target {t} serves chain {ch} without every acknowledged write"

