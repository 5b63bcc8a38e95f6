"""The checkpoint kill sweep, larger than ``make test`` runs it: every fault point × hit count.

    python -m stripefs.bench.ckpt_sweep [--files 8] [--pieces 6] [--who mover,trainer,trainer0] [--cluster C]
    python -m stripefs.bench.ckpt_sweep --ranks 4 [--api save,dcp] [--cluster C]

For a checkpoint of ``--files`` data files of ``--pieces`` upload pieces each, kills
``stripefs mover`` (``mover``), a trainer saving with a local copy (``trainer``) and one saving
with ``keep_local=0`` (``trainer0``) at every fault point and hit count of a traced run,
resumes with the mover, and checks after each that ``latest()`` names only a step that loads
and equals what was saved and that nothing partial is visible (``staging._sweep``). Prints
the number of kill points and the time each sweep took; exits 1 at the first failure.
Starts a private 4-server cluster (256 KiB chunks) unless ``--cluster`` is given.

``--ranks N`` runs the multi-rank sweep instead (``staging._sweep_ranks``): N processes save
one step together, through ``staging.save(rank=, world_size=)`` (``save``) and through
``dcp.save`` with ``StagedStorageWriter`` over gloo (``dcp``); every rank is killed at every
fault point and hit count it passes, and after each kill the step is either absent or holds
every rank's files, and ``latest()`` loads with every rank's keys. ``make test`` runs a sample.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from stripefs.fsclient import Client, testing
from stripefs.staging._sweep import sweep_mover, sweep_trainer
from stripefs.staging._sweep_ranks import sweep_ranks

WHO = ("mover", "trainer", "trainer0")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ckpt_sweep")
    ap.add_argument("--files", type=int, default=8, help="data files in the checkpoint (plus one small file)")
    ap.add_argument("--pieces", type=int, default=6, help="upload pieces per data file")
    ap.add_argument("--who", default=",".join(WHO), help="comma-separated: " + " ".join(WHO))
    ap.add_argument("--cluster")
    ap.add_argument("--ranks", type=int, help="run the multi-rank sweep with this many ranks")
    ap.add_argument("--api", default="save,dcp", help="with --ranks, comma-separated: save dcp")
    args = ap.parse_args(argv)
    if args.ranks is not None:
        apis = args.api.split(",")
        if args.ranks < 2 or set(apis) - {"save", "dcp"}:
            ap.error("--ranks takes 2 or more; --api takes save, dcp")
        who = apis
    else:
        who = args.who.split(",")
    if args.ranks is None and (set(who) - set(WHO) or args.files < 1 or args.pieces < 1):
        ap.error("--who takes mover, trainer, trainer0; --files and --pieces must be >= 1")
    scratch = tempfile.mkdtemp(prefix="ckpt-sweep-")
    root = None
    if args.cluster is None:
        root = os.path.join(scratch, "cluster")
        testing.up(root, servers=4, chunk_size=256 << 10)
        args.cluster = os.path.join(root, "cluster.json")
    client = Client(args.cluster)
    failed = False
    try:
        for name in who:
            prefix = f"/sweep/{name}-{os.getpid()}-{time.time_ns()}"
            client.makedirs(prefix)
            work = os.path.join(scratch, name)
            os.makedirs(work)
            try:
                if args.ranks is not None:
                    count, seconds = sweep_ranks(name, args.ranks, args.cluster, client, prefix, work)
                    print(f"{name:4s} {args.ranks} ranks: {count} kills (every rank at every fault point), each "
                          f"checked, in {seconds:.1f} s ({seconds / count:.2f} s each)", flush=True)
                    continue
                if name == "mover":
                    count, seconds = sweep_mover(args.cluster, client, prefix, work, args.files, args.pieces)
                else:
                    count, seconds = sweep_trainer(args.cluster, client, prefix, work, args.files, args.pieces,
                                                   keep_local=0 if name == "trainer0" else 1)
            except AssertionError as exc:
                print(f"{name}: FAILED: {exc}", flush=True)
                failed = True
                break
            print(f"{name:9s} {args.files} files x {args.pieces} pieces: {count} kill points, all resumed and "
                  f"checked, in {seconds:.1f} s ({seconds / count:.2f} s each)", flush=True)
    finally:
        client.close()
        if root:
            testing.down(root)
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
