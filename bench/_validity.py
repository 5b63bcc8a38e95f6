"""Is a figure a measurement of the data path, or of a cache?

Every byte a networked route delivers crosses a loopback socket at least once, so no such
route can move bytes faster than the loopback socket floor measured in the same run
(``floor_socket``). A record above it was served from a cache somewhere (the kernel page
cache of a mount, a client readahead window, a peer's client-side cache), and a comparison
built on it points the wrong way. The runner marks such a record ``invalid`` with the reason
and the run exits non-zero.

Not checked: ``local_disk`` (no network), the floors themselves, records without bytes
(metadata), and workloads named ``*_cached``, where a warm cache is the point.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NETWORKED", "check_validity", "is_cached"]

NETWORKED = frozenset({"native", "fsspec", "fuse", "zerocopy", "glusterfs", "moosefs", "s3fs"})


def is_cached(workload: str) -> bool:
    """A workload that measures a warm cache on purpose."""
    return workload.endswith("_cached")


def _floors(results: list[dict[str, Any]]) -> dict[int, float]:
    """The best socket floor of the run for each client count."""
    best: dict[int, float] = {}
    for r in results:
        if r["path"] == "floor_socket":
            best[r["clients"]] = max(best.get(r["clients"], 0.0), r["gbps"])
    return best


def check_validity(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark every networked record faster than its socket floor; returns the problems.

    A record is judged against the floor measured with the same number of client processes
    (``pool_clients``, else ``clients``), the best one over the run's server counts (peers
    have server counts of their own); without a floor for its client count, against the
    best floor of the run.

    Returns:
        ``[{"path", "workload", "clients", "servers", "gbps", "floor_gbps", "reason"}]``;
        each such record also gets ``invalid = reason``.

    Raises:
        LookupError: the results hold no ``floor_socket`` (nothing to judge by: the run is
            unchecked, not valid).
    """
    floors = _floors(results)
    if not floors:
        raise LookupError("no floor_socket in these results: validity cannot be checked")
    problems = []
    for r in results:
        if r["path"] not in NETWORKED or not r.get("bytes") or is_cached(r["workload"]):
            continue
        n = r.get("pool_clients", r["clients"])
        limit = floors.get(n, max(floors.values()))
        if r["gbps"] > limit:
            reason = (f"{r['path']} {r['workload']} c={r['clients']}: {r['gbps']:.3f} GB/s is "
                      f"above the loopback floor_socket of this run ({limit:.3f} GB/s, "
                      f"{n} clients): served from a cache, not the data path")
            r["invalid"] = reason
            problems.append({"path": r["path"], "workload": r["workload"],
                             "clients": r["clients"], "servers": r["servers"],
                             "gbps": r["gbps"], "floor_gbps": limit, "reason": reason})
    return problems
