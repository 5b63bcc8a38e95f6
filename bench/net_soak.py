"""Link-fault soak: seeded link-fault schedules on the namespace test bed until time runs out.

    python -m stripefs.bench.net_soak [--minutes 10] [--first 0] [--replicas 2,3] [--duration 20]
                                      [--kinds storage,meta-split,drop,client,slow] [--json FILE]

Each seed plays :func:`fsclient.testing.netfaults.run_link_schedule` on a fresh
:class:`~fsclient.testing.netbed.NetBed` (a metadata host, three storage hosts, two client
hosts, the roles started with the deploy walk's commands): partitions of a storage host,
of the metadata service from some storage hosts, one-way drops, a client's cable pulled, a
slow link, one at a time; two writer and two reader processes on the client hosts. The
history checker judges each run (nothing acknowledged lost, no stale read, no bytes never
written, no failure outside a fault that explains it), every chunk's replicas must agree,
and no split brain may be seen. Seeds alternate over ``--replicas``; a new seed starts
while time is left. Prints one verdict per seed and the failed seeds at the end (exit
status 1 if any); a failed seed's directory is kept for its logs.

Caveats:
    * Needs root and network namespaces (the bed's); exits 2 saying why when there are none.
    * A seed takes ``--duration`` plus start-up and healing (~40-90 s on 2 cores); the last
      seed may end after ``--minutes``.
    * No link delay: the schedules cut, drop and slow links, none is delayed (docs/deploy.md).
    * Replay a failure with ``python -m stripefs.fsclient.testing.netfaults --seed N --replicas R``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import traceback

from stripefs.bench._report import write_json
from stripefs.fsclient.testing import netbed
from stripefs.fsclient.testing.netfaults import KINDS, run_link_schedule


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.net_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="start seeds until this much time has passed")
    p.add_argument("--first", type=int, default=0, help="the first seed")
    p.add_argument("--replicas", default="2,3", help="replication factors, used in turn")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of faults per seed")
    p.add_argument("--kinds", default=",".join(KINDS), help="the link faults to draw from")
    p.add_argument("--json", default=None, help="write every seed's outcome here")
    args = p.parse_args(argv)
    why = netbed.unavailable()
    if why:
        print(f"net_soak: no network test bed here: {why}", file=sys.stderr)
        return 2
    factors = [int(r) for r in args.replicas.split(",")]
    kinds = tuple(args.kinds.split(","))
    failed: list[tuple[int, int]] = []
    records = []
    end = time.monotonic() + args.minutes * 60
    k = 0
    while time.monotonic() < end:
        seed, replicas = args.first + k, factors[k % len(factors)]
        k += 1
        t0 = time.monotonic()
        try:
            outcome = run_link_schedule(seed, replicas=replicas, duration=args.duration, kinds=kinds)
        except Exception:  # noqa: BLE001 - a harness failure is a failed seed too
            print(f"seed {seed} R={replicas}: harness error\n{traceback.format_exc()}", flush=True)
            failed.append((seed, replicas))
            records.append({"seed": seed, "replicas": replicas, "ok": False, "error": traceback.format_exc()})
            continue
        took = time.monotonic() - t0
        print(f"R={replicas} {outcome.report()}  ({took:.0f}s)", flush=True)
        records.append({"seed": seed, "replicas": replicas, "ok": outcome.ok, "seconds": round(took, 1),
                        "schedule": outcome.schedule, "summary": outcome.verdict.summary(),
                        "violations": outcome.verdict.violations[:20], "replicas_differ": outcome.replicas_differ[:20],
                        "split_brain": outcome.split_brain[:20], "tolerated_failures": outcome.tolerated,
                        "root": outcome.root if not outcome.ok else None})
        if outcome.ok:
            shutil.rmtree(outcome.root, ignore_errors=True)
        else:
            failed.append((seed, replicas))
    if args.json:
        write_json({"seeds": records, "netem": netbed.has_netem()}, args.json)
    print(f"{k - len(failed)}/{k} seeds passed in {args.minutes:g} minutes")
    if failed:
        print("failed seeds: " + " ".join(f"{s}(R={r})" for s, r in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
