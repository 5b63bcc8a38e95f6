"""The runner's validity check: a networked figure above the run's socket floor is a cache.

Synthetic records (the logic), then the exit status a report with an invalid record gets.
"""

from __future__ import annotations

from typing import Any

import pytest

from stripefs.bench._validity import NETWORKED, check_validity
from stripefs.bench.cli import exit_status


def rec(path: str, workload: str, gbps: float, clients: int = 2, servers: int = 4,
        **extra: Any) -> dict[str, Any]:
    return {"workload": workload, "path": path, "clients": clients, "servers": servers,
            "bytes": int(gbps * 1e9), "seconds": 1.0, "gbps": gbps, **extra}


def floor(gbps: float, clients: int = 2, servers: int = 4) -> dict[str, Any]:
    return rec("floor_socket", "transfer", gbps, clients, servers)


@pytest.mark.parametrize("path", sorted(NETWORKED))
def test_networked_route_above_the_floor_is_invalid(path: str) -> None:
    results = [floor(2.5), rec(path, "rand_read_1m", 3.0), rec(path, "seq_read", 2.4)]
    problems = check_validity(results)
    assert len(problems) == 1
    bad = results[1]
    assert bad["invalid"] == problems[0]["reason"]
    assert "floor_socket" in bad["invalid"] and "2.5" in bad["invalid"] and path in bad["invalid"]
    assert "invalid" not in results[2]


def test_local_disk_memcpy_and_cached_workloads_are_not_checked() -> None:
    results = [floor(2.5), rec("local_disk", "rand_read_4k", 9.0),
               rec("floor_memcpy", "transfer", 9.0), rec("native", "seq_read_cached", 7.0),
               rec("fuse", "rand_read_4k_cached", 8.0)]
    assert check_validity(results) == []
    assert not any("invalid" in r for r in results)


def test_the_floor_of_the_same_client_count_is_used() -> None:
    # c=1 has a low floor, c=4 a high one: a c=1 record above its own floor is invalid even
    # though it is under the c=4 floor; a c=4 record is judged by the c=4 floor.
    results = [floor(1.5, clients=1), floor(3.5, clients=4),
               rec("native", "seq_read", 2.0, clients=1), rec("native", "seq_read", 3.0, clients=4)]
    problems = check_validity(results)
    assert [p["clients"] for p in problems] == [1]


def test_peers_with_their_own_server_count_use_the_best_floor_of_their_client_count() -> None:
    results = [floor(2.0, servers=1), floor(2.8, servers=4),
               rec("glusterfs", "rand_read_64k", 2.5, servers=1),
               rec("moosefs", "rand_read_64k", 2.9, servers=2)]
    problems = check_validity(results)
    assert [p["path"] for p in problems] == ["moosefs"]


def test_records_without_bytes_are_not_checked() -> None:
    results = [floor(2.5), {**rec("native", "meta_create", 0.0), "bytes": 0, "ops_per_s": 9e9}]
    assert check_validity(results) == []


def test_no_floor_means_unchecked_not_valid() -> None:
    with pytest.raises(LookupError):
        check_validity([rec("native", "seq_read", 99.0)])


def test_exit_status() -> None:
    ok: dict[str, Any] = {"errors": [], "invalid": []}
    assert exit_status(ok) == 0
    assert exit_status({**ok, "errors": [{"path": "native"}]}) == 1
    assert exit_status({**ok, "invalid": [{"path": "native", "reason": "cache"}]}) == 3
