"""A history of reads and writes under faults, and the checker that judges it.

The workload of :mod:`.faults` cuts every file into *regions*: byte ranges
bounded by its slot grid and by chunk boundaries, so that a write replaces a
region atomically on each replica (a write of several chunks is not atomic as a
whole: a racing read may see some of its pieces). Writes and reads cover whole
slots; every operation becomes one JSON line per region it touched::

    {"k": "w"|"r", "who": "w0", "f": 0, "s": 5, "crc": 123, "t0": 10.0, "t1": 10.2, "ok": true, "err": null}

``s`` is the region's index in the file, ``t0``/``t1`` are ``time.monotonic()``
at the call and its return (one clock for every process on the machine); ``crc``
is the CRC32C of the region's bytes (for a failed read, None). Every write's
bytes are unique, so a CRC names the write that produced them -- except zeros:

* ``"t"``: a truncate and the extend after it, one op per region past the cut: a
  write of zeros, acknowledged once the extend is and the cut was committed (even
  if the truncate itself answered EIO: a cut's bytes must never come back). Many
  truncates write the same CRC; a read or the final bytes are credited to the one
  of them that explains it best (the latest to end among those begun in time);
* ``"n"``: a rename, a write of the file's *name register* (region ``-1``), whose
  value is the CRC of the file's name; readers read it from listings.

The checker treats each region as a register and verifies:

* **no phantom bytes**: a read returns the initial bytes or the bytes of a write
  that had started before the read returned;
* **no stale read**: never bytes older than a write that was acknowledged before
  the read began (older: that write started after the returned one had ended);
* **nothing acknowledged lost**: the final bytes come from the initial content
  or from a write (acknowledged or not) that no acknowledged write followed
  in real time;
* **no errors** when the schedule promised none (one fault at a time).

Caveats:
    * Real time from one monotonic clock is a sound order here because every
      process runs on this machine; across machines it would need bounds.
    * A write that failed may or may not have landed, and may have landed on
      part of its regions: each region is judged on its own.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Op", "Verdict", "check", "load"]

Slot = tuple[int, int]  # (file, region); region -1: the file's name
WRITES = ("w", "t", "n", "i")


@dataclass(frozen=True)
class Op:
    """One operation on one region (``slot``: ``(file, region)``)."""

    kind: str  # "w" (write), "t" (truncate + extend: zeros), "n" (rename), "r" (read), "i" (the initial content)
    who: str
    slot: Slot
    crc: int | None
    t0: float
    t1: float
    ok: bool
    err: str | None = None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Op:
        return cls(raw["k"], str(raw["who"]), (int(raw["f"]), int(raw["s"])),
                   None if raw.get("crc") is None else int(raw["crc"]), float(raw["t0"]), float(raw["t1"]),
                   bool(raw["ok"]), raw.get("err"))

    def to_json(self) -> str:
        return json.dumps({"k": self.kind, "who": self.who, "f": self.slot[0], "s": self.slot[1], "crc": self.crc,
                           "t0": self.t0, "t1": self.t1, "ok": self.ok, "err": self.err})


@dataclass
class Verdict:
    """What the checker found: empty lists mean the history is good."""

    ops: int = 0
    acked_writes: int = 0
    failed_writes: int = 0
    reads: int = 0
    truncates: int = 0  # region ops of truncate + extend ("t")
    renames: int = 0
    errors: list[str] = field(default_factory=list)  # operations that failed (as the application saw them)
    violations: list[str] = field(default_factory=list)  # broken guarantees

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        return (f"{self.ops} ops: {self.acked_writes} acked writes ({self.truncates} truncated regions, "
                f"{self.renames} renames), {self.failed_writes} failed, {self.reads} reads; "
                f"{len(self.errors)} errors, {len(self.violations)} violations")


def load(paths: Iterable[str]) -> list[Op]:
    """Every operation in the given JSON-lines files (a torn last line is skipped)."""
    ops: list[Op] = []
    for path in paths:
        with open(path) as f:
            for line in f:
                try:
                    ops.append(Op.from_json(json.loads(line)))
                except (ValueError, KeyError):
                    continue  # a line cut short by a killed writer
    return ops


def check(ops: list[Op], final: dict[Slot, int], *, expect_no_errors: bool = False) -> Verdict:
    """Judge a history; ``final`` maps each slot to the CRC read once the cluster is healthy.

    Every slot needs an ``"i"`` op (its initial content, acknowledged before the run).
    """
    v = Verdict(ops=len(ops))
    writes: dict[Slot, list[Op]] = defaultdict(list)
    reads: dict[Slot, list[Op]] = defaultdict(list)
    for op in ops:
        if op.kind in WRITES:
            writes[op.slot].append(op)
            if op.kind != "i":
                v.acked_writes += op.ok
                v.failed_writes += not op.ok
                v.truncates += op.kind == "t"
                v.renames += op.kind == "n" and op.ok
        else:
            reads[op.slot].append(op)
            v.reads += 1
        if not op.ok:
            v.errors.append(f"{op.who} {op.kind} slot {op.slot} at {op.t0:.3f}: {op.err}")
    if expect_no_errors and v.errors:
        v.violations.append(f"{len(v.errors)} operations failed although faults came one at a time: {v.errors[:3]}")
    for slot, ws in writes.items():
        by_crc: dict[int, list[Op]] = defaultdict(list)
        for w in ws:
            if w.crc is not None:
                by_crc[w.crc].append(w)
        acked = sorted((w for w in ws if w.ok), key=lambda w: w.t1)
        for r in reads[slot]:
            if not r.ok or r.crc is None:
                continue
            src = _source(by_crc.get(r.crc, []), r.t1)
            if src is None:
                v.violations.append(f"{r.who} read slot {slot} at {r.t0:.3f}-{r.t1:.3f}: bytes no write had produced "
                                    f"(crc {r.crc:#x})")
                continue
            newer = _acked_after(acked, src, before=r.t0)
            if newer is not None:
                v.violations.append(f"{r.who} read slot {slot} at {r.t0:.3f}: stale bytes of {src.who} "
                                    f"(ended {src.t1:.3f}); {newer.who}'s write was acknowledged at {newer.t1:.3f}")
        crc = final.get(slot)
        src = _source(by_crc.get(crc, []), float("inf")) if crc is not None else None
        if src is None:
            v.violations.append(f"slot {slot}: final bytes no write had produced (crc {crc})")
            continue
        newer = _acked_after(acked, src, before=float("inf"))
        if newer is not None:
            v.violations.append(f"slot {slot}: acknowledged write of {newer.who} at {newer.t0:.3f}-{newer.t1:.3f} lost; "
                                f"the slot holds {src.who}'s bytes (ended {src.t1:.3f})")
    missing = set(final) - set(writes)
    if missing:
        v.violations.append(f"slots without initial content in the history: {sorted(missing)[:5]}")
    return v


def _source(candidates: list[Op], by: float) -> Op | None:
    """The write that best explains bytes seen at ``by``: of those begun by then, the
    last to end (unique bytes have one candidate; zeros have every truncate)."""
    begun = [w for w in candidates if w.t0 <= by]
    return max(begun, key=lambda w: w.t1) if begun else None


def _acked_after(acked: list[Op], src: Op, before: float) -> Op | None:
    """An acknowledged write that began after ``src`` ended and ended before ``before``."""
    for w in acked:
        if w.t1 >= before:
            break
        if w.t0 > src.t1:
            return w
    return None
