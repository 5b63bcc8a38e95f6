"""The coherence history checker on PostgreSQL with three metadata services: every client,
the mounts' included, sends each request to the next service in turn, so leases are
granted by one service and broken by changes through another (``metadata/_leasebus.py``).
Seeded runs must stay inside the documented windows -- and the checker must catch services
that ignore each other's publications (injected into the services only).

Longer runs: ``python -m stripefs.bench.coherence_soak --minutes 10 --metadata-store
postgresql --metadata-services 3``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from stripefs.fsclient.testing import postgres_bin
from stripefs.fsclient.testing.coherence import Rig, Workload, check, run_history

from .fuse_helpers import assert_inside_windows

pytestmark = [pytest.mark.fuse,
              pytest.mark.skipif(postgres_bin("initdb") is None,
                                 reason="PostgreSQL server binaries are not installed (apt-get install postgresql)")]

SERVICES = 3
SECONDS = 4.0
# Leases matter where a holder reads what another client changed: mostly stats and reads
# of names a recent change touched, changes that keep the names (no window for a name).
LEASED = Workload(mutate=0.15, observe={"stat": 4, "read": 2, "listdir": 1},
                  mutations={"rewrite": 2, "utime": 1, "truncate": 1}, recent=0.8)

# A service that hears the other services' publications and drops their keys: what it
# granted stays until its TTL whatever changed elsewhere. Loaded into every process the
# cluster starts (a sitecustomize on PYTHONPATH); this test's own process is not one.
IGNORE_OTHERS = """
try:
    import stripefs.metadata._leasebus as _lb
except ImportError:
    pass
else:
    _invalidate = _lb.LeaseBus._invalidate
    def _own_only(self, origin, msg):
        return _invalidate(self, origin, msg if origin == self.id else dict(msg, g=[]))
    _lb.LeaseBus._invalidate = _own_only
"""


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with Rig(str(tmp_path_factory.mktemp("coherence-pg")), lease_ttl=30.0, store="postgresql",
             services=SERVICES) as r:
        yield r


@pytest.mark.parametrize("seed", [1, 2])
def test_a_random_history_over_three_services_stays_inside_the_windows(rig: Rig, seed: int) -> None:
    assert_inside_windows(rig, seed, SECONDS)


def test_leased_reads_over_three_services_stay_inside_the_windows(rig: Rig) -> None:
    h = run_history(rig, 7, SECONDS, LEASED)
    violations = check(h)
    assert not h.crashes, h.crashes
    assert not violations, "\n".join([*(str(v) for v in violations[:20]), h.context(violations[0])])


def test_the_checker_catches_services_that_ignore_each_others_changes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(IGNORE_OTHERS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    violations = []
    with Rig(str(tmp_path / "rig"), lease_ttl=30.0, mounts=0, store="postgresql", services=SERVICES) as rig:
        for seed in range(4):  # each round finds it nearly always; stop at the first that does
            h = run_history(rig, 200 + seed, SECONDS, LEASED)
            assert not h.crashes, h.crashes
            violations = check(h)
            if violations:
                break
    assert violations, "four rounds of changes through other services found no stale observation"
    # What leased clients kept past a change, however it shows (an older state, a rewrite's
    # truncated middle kept from a stat during it, old bytes): observations, never a change
    # that failed, and only leases can show it (no mounts here).
    assert all(v.record.op in LEASED.observe and not v.record.mount for v in violations), \
        "\n".join(str(v) for v in violations[:10])
