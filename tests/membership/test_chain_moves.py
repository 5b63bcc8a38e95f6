"""Chain moves after admission (issue 20), on :class:`metadata._membership.Membership` directly.

A fake clock drives time: with one replica a newcomer takes chain slots only
after it has heartbeated for ``admit_after`` seconds; moves are rate-limited
(one server's moves at a time, ``move_interval`` apart); no chain is ever left
without a serving target while one exists.
"""

from __future__ import annotations

from pathlib import Path

from stripefs.metadata._membership import Membership
from stripefs.wire import messages as m


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _token(sid: int) -> str:
    return f"{sid:02x}" * 32


def _join(mb: Membership, port: int) -> int:
    sid, state = mb.register(m.RegisterServer(host="127.0.0.1", port=port, root=f"/srv/{port}", capacity=1 << 30,
                                              used=0, pid=100 + port % 1000, token=_token(port % 256)))
    assert state == "pending"
    assert sid not in mb.servers and all(sid not in ts for ts in mb.table.values())
    mb.admit(sid)
    return sid


def _beat(mb: Membership, sid: int, port: int) -> str:
    return mb.heartbeat(m.Heartbeat(server_id=sid, capacity=1 << 30, used=0, chunks=0, token=_token(port % 256)))


def _serving_everywhere(mb: Membership) -> bool:
    return all(any(mb.servers[t].state == "serving" for t in ts) for ts in mb.table.values())


def test_one_replica_newcomer_waits_admit_after(tmp_path: Path) -> None:
    clock = Clock()
    mb = Membership(str(tmp_path / "servers.json"), replicas=1, admit_after=3.0, clock=clock)
    a, b = _join(mb, 9001), _join(mb, 9002)
    mb.freeze()
    table = {c: list(ts) for c, ts in mb.table.items()}
    version = mb.version
    new = _join(mb, 9003)
    assert mb.servers[new].state == "joining"
    for _ in range(2):
        clock.t += 1.0
        for sid, port in ((a, 9001), (b, 9002), (new, 9003)):
            _beat(mb, sid, port)
        mb.sweep()
        assert mb.table == table  # not yet: it has not served long enough
    clock.t += 1.5
    _beat(mb, new, 9003)
    mb.sweep()
    assert any(new in ts for ts in mb.table.values())
    assert mb.servers[new].state == "syncing"
    assert mb.version > version
    assert _serving_everywhere(mb)
    mb.sync_done(new)
    assert mb.servers[new].state == "serving"
    assert _serving_everywhere(mb)
    assert all(len(ts) == 1 for ts in mb.table.values())


def test_one_replica_newcomer_that_goes_silent_takes_nothing(tmp_path: Path) -> None:
    clock = Clock()
    mb = Membership(str(tmp_path / "servers.json"), replicas=1, admit_after=3.0, clock=clock)
    a, b = _join(mb, 9001), _join(mb, 9002)
    mb.freeze()
    table = {c: list(ts) for c, ts in mb.table.items()}
    new = _join(mb, 9003)
    for _ in range(8):  # only the old servers keep heartbeating
        clock.t += 1.0
        _beat(mb, a, 9001)
        _beat(mb, b, 9002)
        mb.sweep()
    assert mb.servers[new].state == "offline"
    assert mb.table == table


def test_moves_are_rate_limited_one_server_at_a_time(tmp_path: Path) -> None:
    clock = Clock()
    mb = Membership(str(tmp_path / "servers.json"), replicas=2, admit_after=0.0, move_interval=2.0, clock=clock)
    ports = {_join(mb, p): p for p in (9001, 9002, 9003)}
    mb.freeze()
    n1, n2 = _join(mb, 9004), _join(mb, 9005)
    ports.update({n1: 9004, n2: 9005})
    mb.sweep()
    moving = [s for s in (n1, n2) if any(s in ts for ts in mb.table.values())]
    assert len(moving) == 1, mb.table
    first = moving[0]
    second = n2 if first == n1 else n1
    assert mb.servers[second].state == "joining"
    assert _serving_everywhere(mb)
    mb.sync_done(first)
    mb.sweep()  # within move_interval of the last move: nothing yet
    assert not any(second in ts for ts in mb.table.values())
    clock.t += 2.5
    for sid, port in ports.items():
        _beat(mb, sid, port)
    mb.sweep()
    assert any(second in ts for ts in mb.table.values())
    assert _serving_everywhere(mb)


def test_pending_registrations_expire_and_are_bounded(tmp_path: Path) -> None:
    clock = Clock()
    mb = Membership(str(tmp_path / "servers.json"), replicas=1, clock=clock)
    for i in range(3):
        mb.register(m.RegisterServer(host="127.0.0.1", port=9100 + i, root="/srv/p", capacity=1, used=0, pid=1,
                                     token=_token(i)))
    assert len(mb.pending) == 3
    clock.t += 60
    mb.sweep()
    assert not mb.pending and not mb.servers


def test_tokens_and_joining_survive_a_metadata_restart(tmp_path: Path) -> None:
    import pytest

    from stripefs.wire import StripefsError

    clock = Clock()
    path = str(tmp_path / "servers.json")
    mb = Membership(path, replicas=1, admit_after=3.0, clock=clock)
    a, b = _join(mb, 9001), _join(mb, 9002)
    mb.freeze()
    new = _join(mb, 9003)
    assert mb.servers[new].state == "joining"
    mb = Membership(path, replicas=1, admit_after=3.0, clock=clock)  # the service restarted
    with pytest.raises(StripefsError) as info:  # the id stays bound to its data directory
        mb.heartbeat(m.Heartbeat(server_id=a, capacity=1, used=0, chunks=0, token="ee" * 32))
    assert info.value.errno == 1
    for _ in range(4):
        clock.t += 1.0
        for sid, port in ((a, 9001), (b, 9002), (new, 9003)):
            _beat(mb, sid, port)
        mb.sweep()
    assert any(new in ts for ts in mb.table.values())  # the wait restarted, and ended
