"""What a commit was durable on: the replicas each chain of the store had serving at the commit.

A step is committed once every file is acknowledged by every *serving* target of its chains. A
chain that lost a target (a dead storage server, not yet back and resynced) acknowledges with
fewer copies than the cluster's replica count, and the step is as durable as its weakest chain.
The commit asks the metadata service once (``ClusterStatus``: one request, no data) and
records the answer in the manifest, the journal and the handle.

Caveats:
    The count is the cluster's at the commit, over every chain, not the history of each chunk
    the step wrote: a server that died during the upload and came back serving before the
    commit, or a chain the step's files do not use, is not told apart.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Durability", "durability_of"]

log = logging.getLogger("stripefs.staging")


@dataclass(frozen=True)
class Durability:
    """The store's replication when a step committed.

    Attributes:
        replicas: the cluster's replica count (targets per chain).
        serving: the fewest serving targets of any chain: every chunk of the step was acknowledged
            by at least this many copies (``replicas`` unless a chain was degraded).
        chains: chains in the cluster.
        degraded: chains with fewer serving targets than ``replicas``.
    """

    replicas: int
    serving: int
    chains: int
    degraded: int

    @property
    def full(self) -> bool:
        """Every chain had all its replicas serving."""
        return self.degraded == 0

    def record(self) -> dict[str, int]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.record(), separators=(",", ":"))

    @classmethod
    def from_record(cls, rec: Any) -> "Durability | None":
        """From a manifest's ``durability`` or the journal's JSON; None when absent or malformed
        (a step committed before this was recorded)."""
        if isinstance(rec, str):
            try:
                rec = json.loads(rec)
            except ValueError:
                return None
        if not isinstance(rec, dict):
            return None
        try:
            vals = {k: rec[k] for k in ("replicas", "serving", "chains", "degraded")}
        except KeyError:
            return None
        if not all(type(v) is int and v >= 0 for v in vals.values()):
            return None
        return cls(**vals)

    def __str__(self) -> str:
        if self.full:
            return f"{self.replicas}/{self.replicas} replicas"
        return f"{self.serving}/{self.replicas} replicas ({self.degraded} of {self.chains} chains degraded)"


def durability_of(client: Any) -> Durability | None:
    """The store's replication now (one ``ClusterStatus`` request); None when it cannot be asked."""
    try:
        st = client.status()
    except OSError as exc:  # the commit does not depend on it: an unknown count is recorded as such
        log.warning("could not ask the cluster for its replica count: %s", exc)
        return None
    replicas = int(st.replicas)
    serving = [sum(1 for s in c.get("states", ()) if s == "serving") for c in st.chains]
    return Durability(replicas=replicas, serving=min(serving, default=replicas), chains=len(serving),
                      degraded=sum(1 for n in serving if n < replicas))
