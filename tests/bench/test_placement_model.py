"""The placement model (bench/placement_model.py) on 30 servers, R=3, racks of 5: no sockets.

Today's table and drain come from the metadata service's own Membership; the model's
recovery plans must restore every touched chain from survivors only, copy each chain's
data once per missing replica, and the balanced table must spread the load at least as
well as today's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from stripefs.bench.placement_model import (
    Recovery,
    _least_max,
    balanced_table,
    check_recovery,
    drain,
    racks,
    spread,
    summary,
    table_stats,
    today_membership,
)

N, R, RACK, SIZE, BW = 30, 3, 5, 1 << 30, 1e9


@pytest.fixture(scope="module")
def setup() -> tuple[Any, ...]:
    healthy = today_membership(N, R)
    today = {c: list(ts) for c, ts in healthy.table.items()}
    rack_of = racks(N, RACK, "contiguous")
    balanced = balanced_table(list(range(1, N + 1)), R, len(today), rack_of, seed=1)
    return healthy, today, balanced, rack_of


def _recoveries(setup: tuple[Any, ...], failed: list[int]) -> dict[str, Recovery]:
    healthy, today, balanced, rack_of = setup
    return {"today": drain(healthy, failed), "today+spread": spread(today, failed, R, rack_of),
            "balanced": spread(balanced, failed, R, rack_of)}


def test_every_chain_has_r_distinct_servers_and_equal_loads(setup: tuple[Any, ...]) -> None:
    _, today, balanced, rack_of = setup
    for table in (today, balanced):
        assert len(table) == 4 * N
        assert all(len(ts) == R and len(set(ts)) == R and set(ts) <= set(range(1, N + 1)) for ts in table.values())
        assert set(Counter(t for ts in table.values() for t in ts).values()) == {4 * R}
    # Today's table is the service's: chain i = servers i..i+R-1 (mod N), racks unknown to it.
    assert today[1] == [1, 2, 3] and today[N] == [N, 1, 2]
    stats = table_stats(balanced, list(range(1, N + 1)), rack_of)
    assert stats["chains_with_rack_twice"] == 0
    assert stats["peers_per_server"]["min"] > table_stats(today, list(range(1, N + 1)))["peers_per_server"]["max"]


def test_one_failure_is_restored_from_survivors_with_each_chain_copied_once(setup: tuple[Any, ...]) -> None:
    victim = 12
    for design, rec in _recoveries(setup, [victim]).items():
        assert check_recovery(rec, R) == [], design
        touched = [c for c, ts in rec.before.items() if victim in ts]
        assert rec.affected == touched and len(touched) == 4 * R and not rec.lost
        for c in touched:
            assert len(set(rec.after[c])) == R and victim not in rec.after[c], (design, c)
        copies = rec.copies
        assert sorted(cp.chain for cp in copies) == touched  # one new replica per touched chain
        assert all(cp.source in rec.before[cp.chain] and cp.source != victim for cp in copies)
        fig = summary(rec, R, SIZE, BW)
        assert fig["copied_bytes"] == len(touched) * SIZE
        # Every copied byte is sent by one survivor and received by another: the load sums to twice that.
        assert fig["load_mean_bytes"] * (N - 1) == pytest.approx(2 * len(touched) * SIZE)
        assert fig["chains_degraded_after"] == 0 and fig["chains_lost"] == 0


def test_todays_drain_moves_one_receiving_server_at_a_time(setup: tuple[Any, ...]) -> None:
    rec = _recoveries(setup, [12])["today"]
    assert rec.steps and all(len({cp.target for cp in step}) == 1 for step in rec.steps)
    # The receiver is syncing for all its chains meanwhile: more chains run below R than were hit.
    assert rec.peak_degraded > len(rec.affected)


def test_balanced_spreads_recovery_at_least_as_well_as_today(setup: tuple[Any, ...]) -> None:
    figs = {d: summary(rec, R, SIZE, BW) for d, rec in _recoveries(setup, [12]).items()}
    for key in ("load_max_over_mean", "load_max_bytes", "seconds_to_full_redundancy"):
        assert figs["balanced"][key] <= figs["today+spread"][key] <= figs["today"][key], key
    assert figs["balanced"]["servers_receiving"] == 4 * R  # every touched chain to its own receiver


def test_a_rack_in_id_order_loses_todays_chains_not_the_balanced_ones(setup: tuple[Any, ...]) -> None:
    rack = [s for s in range(1, N + 1) if setup[3][s] == 2]
    recs = _recoveries(setup, rack)
    today = summary(recs["today"], R, SIZE, BW)
    assert today["chains_lost"] > 0 and today["remove_refused"] == len(rack)
    assert today["seconds_to_full_redundancy"] == float("inf")  # its other chains stay degraded
    balanced = summary(recs["balanced"], R, SIZE, BW)
    assert balanced["chains_lost"] == 0 and balanced["chains_degraded_after"] == 0
    assert check_recovery(recs["balanced"], R) == [] and check_recovery(recs["today+spread"], R) == []


def test_sources_minimise_the_most_one_server_sends() -> None:
    # Greedy in order would give 1 two copies (it is first for both); the least maximum is 1.
    assert sorted(_least_max([[1, 2], [1, 3], [2]])) == [1, 2, 3]
    assert Counter(_least_max([[1], [1], [1, 2]])) == Counter({1: 2, 2: 1})
