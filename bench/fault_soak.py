"""Fault soak: many seeded fault schedules, each judged by the history checker.

    python -m stripefs.bench.fault_soak [--seeds 50] [--first 0] [--replicas 2,3] [--duration 20] [--json FILE]

Each seed plays :func:`fsclient.testing.faults.run_schedule` (kill -9, SIGSTOP
pauses past the failure timeout, restarts, slow fsyncs of a storage server or of
the metadata log, one ``add-server``; faults one at a time, the next possibly
while a returned server still resyncs) with two writer and two reader processes
(overwrites, truncate + extend, renames, reads and listings), then checks the
history, the final bytes and that all replicas of every chunk agree. Seeds alternate over ``--replicas``. Prints one
line per seed and, at the end, the seeds that failed (exit status 1 if any); a
failed seed's cluster directory is kept for its logs.

Caveats:
    * Each seed takes ``--duration`` plus the time to heal (~30-60 s in all on
      2 cores); 50 seeds take about half an hour.
    * Replay a failure with ``python -m stripefs.fsclient.testing.faults --seed N --replicas R``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import traceback

from stripefs.bench._report import write_json
from stripefs.fsclient.testing.faults import run_schedule


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.fault_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=50, help="how many seeds")
    p.add_argument("--first", type=int, default=0, help="the first seed")
    p.add_argument("--replicas", default="2,3", help="replication factors, used in turn")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of faults per seed")
    p.add_argument("--json", default=None, help="write every seed's outcome here")
    args = p.parse_args(argv)
    factors = [int(r) for r in args.replicas.split(",")]
    failed: list[tuple[int, int]] = []
    records = []
    for k in range(args.seeds):
        seed = args.first + k
        replicas = factors[k % len(factors)]
        t0 = time.monotonic()
        try:
            outcome = run_schedule(seed, replicas=replicas, duration=args.duration)
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
                        "root": outcome.root if not outcome.ok else None})
        if outcome.ok:
            shutil.rmtree(outcome.root, ignore_errors=True)
        else:
            failed.append((seed, replicas))
    if args.json:
        write_json({"seeds": records}, args.json)
    print(f"{args.seeds - len(failed)}/{args.seeds} seeds passed")
    if failed:
        print("failed seeds: " + " ".join(f"{s}(R={r})" for s, r in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
