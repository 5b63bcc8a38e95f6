"""Checkpoint staging benchmark: staging.save/load and the DCP bridge against floors and peers, one run.

    python -m stripefs.bench.staging_bench [--size-gb 2] [--json FILE] [--cluster C] [--only durable,load]
    python -m stripefs.bench.staging_bench --only restore [--restore-size 2G] [--restore-tensors 16,1000]
    python -m stripefs.bench.staging_bench --overlap [--overlap-size 256M] [--overlap-bandwidth 50e6] [--json F]

Starts a private 4-server cluster unless ``--cluster`` is given. Every figure
is a median of ``--repeat`` runs and is reported with the floor or peer
measured in the same run (the machines are noisy: compare ratios).

Sections (``--only`` picks some): ``blocking`` (save's blocking time vs a copy of
the tensors, and vs ``torch.save`` to the store), ``durable`` (time from ``save()``
to globally durable with ``keep_local=0`` and with a local copy, against a native
client write of the same bytes, interleaved so that each ratio compares
neighbours), ``load`` (vs the loopback socket floor and ``torch.load``), ``restore``
(a state of ``--restore-size`` bytes cut into equal tensors, loaded from the store and from
the local staged copy into fresh tensors and, ``store_into``/``local_into``, into a state held
in memory as a restarted job's model is, and, ``dcp_store``/``dcp_local``, ``dcp.load`` of the
same state saved through ``StagedStorageWriter`` into that held state, each round next to the
socket floor), ``overlap`` (the blocking of a
save made right after the previous one returned, while that one is still being written
locally and uploaded, capped at ``--overlap-bandwidth`` and uncapped, against a plain copy of
the same tensors into already-touched memory; ``--overlap`` runs this section alone), ``dcp``
and ``train``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch

from stripefs import staging
from stripefs.bench._report import write_json
from stripefs.bench.floors import parse_size
from stripefs.fsclient import Client, testing

SECTIONS = ("blocking", "durable", "load", "restore", "overlap", "dcp", "train")


def make_state(total: int) -> dict[str, Any]:
    """Mixed sizes: a few big matrices, many medium ones, lots of small biases, plus plain values."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {}
    big, med, i = int(total * 0.6), int(total * 0.35), 0
    while big >= 4:
        n = min(big, 128 << 20) // 4
        sd[f"big{i}"] = torch.randn(n, generator=g)
        big -= n * 4
        i += 1
    while med >= 2:
        n = min(med, 4 << 20) // 2
        sd[f"med{i}"] = torch.randn(n, generator=g).to(torch.bfloat16)
        med -= n * 2
        i += 1
    for j in range(max(1, int(total * 0.05) // (64 << 10))):
        sd[f"small{j}"] = torch.randn(16 << 10, generator=g)
    sd["step"], sd["rng"] = 1000, torch.get_rng_state()
    return sd


def nbytes(sd: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))


def median(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="staging_bench")
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cluster")
    ap.add_argument("--json")
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--restore-size", type=parse_size, default=parse_size("512M"),
                    help="bytes of the restore section's state (512M; 2G on a machine with the memory)")
    ap.add_argument("--restore-tensors", default="16,1000", help="restore: tensor counts to cut the state into")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + " ".join(SECTIONS))
    ap.add_argument("--overlap", action="store_true", help="run the overlap section alone (--only overlap)")
    ap.add_argument("--overlap-size", type=parse_size, default=parse_size("256M"),
                    help="overlap: bytes of the state saved twice in a row (256M)")
    ap.add_argument("--overlap-bandwidth", type=float, default=50e6,
                    help="overlap: the capped variant's upload cap in bytes/s (50e6; the uncapped one runs too)")
    args = ap.parse_args(argv)
    only = {"overlap"} if args.overlap else set(args.only.split(","))
    if only - set(SECTIONS):
        ap.error(f"unknown section(s): {', '.join(sorted(only - set(SECTIONS)))}")
    scratch = tempfile.mkdtemp(prefix="staging-bench-")
    root = None
    if args.cluster is None:
        root = os.path.join(scratch, "cluster")
        testing.up(root, servers=4)
        args.cluster = os.path.join(root, "cluster.json")
    client = Client(args.cluster)
    sdir = os.path.join(scratch, "staging")
    results: list[dict[str, Any]] = []
    sd = make_state(int(args.size_gb * (1 << 30))) if only - {"restore", "overlap"} else {}
    size = nbytes(sd)

    def rec(workload: str, path: str, seconds: float, b: int = size) -> None:
        results.append({"workload": workload, "path": path, "clients": 1, "servers": 4, "bytes": b,
                        "seconds": round(seconds, 4), "gbps": round(b / seconds / 1e9, 3)})
        print(f"{workload:24s} {path:28s} {seconds:8.3f} s  {b / seconds / 1e9:6.2f} GB/s", flush=True)

    try:
        client.makedirs("/bench/ckpt")
        steps = iter(range(100_000))

        def url() -> str:
            return f"stripefs://bench/ckpt/step-{next(steps):06d}"

        last = None
        if "blocking" in only:
            last = blocking_bench(sd, args, client, sdir, url, rec)
        if "durable" in only:
            last = durable_bench(sd, args, client, sdir, url, rec)
        if "load" in only:
            if last is None:
                last = url()
                staging.save(sd, last, staging_dir=sdir, cluster=args.cluster, keep_local=1, keep_remote=1,
                             background_mover=False).wait()
            load_bench(sd, args, client, sdir, scratch, last, rec)
        if "restore" in only:
            for count in (int(c) for c in args.restore_tensors.split(",")):
                restore_bench(args, sdir, scratch, url, count, results)
        if "overlap" in only:
            overlap_bench(args, sdir, url, results)
        if "dcp" in only:
            dcp_bench(sd, args, scratch, sdir, rec)
        if "train" in only:
            train_bench(args, sdir, rec)
    finally:
        if args.json:
            write_json({"results": results, "note": "shared 2-core VM; compare ratios within the run"}, args.json)
        client.close()
        if root:
            testing.down(root)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def blocking_bench(sd: dict[str, Any], args: Any, client: Client, sdir: str, url: Callable[[], str],
                   rec: Callable[..., None]) -> str:
    """save()'s blocking time vs a plain copy of the tensors (the floor) and vs torch.save to the store."""
    tensors = [v for v in sd.values() if isinstance(v, torch.Tensor)]
    rec("save_blocking", "floor_memcpy", median(lambda: timed(lambda: [t.clone() for t in tensors]), args.repeat))
    touched = TouchedCopy(tensors)
    rec("save_blocking", "floor_touched_copy", median(touched, args.repeat))
    del touched
    last = ""

    def one_save() -> float:
        nonlocal last
        last = url()
        t = time.perf_counter()
        h = staging.save(sd, last, staging_dir=sdir, cluster=args.cluster, keep_local=1, keep_remote=1,
                         background_mover=False)
        blocking = time.perf_counter() - t
        h.wait()
        return blocking

    one_save()  # warm-up: the first save allocates and faults in the host buffer
    rec("save_blocking", "staging", median(one_save, args.repeat))

    def torch_save_remote() -> float:
        try:
            import fsspec

            opener = lambda: fsspec.open("stripefs:///bench/torch.pt", "wb", cluster=args.cluster).open()  # noqa: E731
            opener().close()
            label = "fsspec"
        except Exception:  # fsspec route missing: the native file object is the closest peer
            opener, label = (lambda: client.open("/bench/torch.pt", "wb")), "native_file"
        t = time.perf_counter()
        with opener() as f:
            torch.save(sd, f)
        torch_save_remote.label = label  # type: ignore[attr-defined]
        return time.perf_counter() - t
    rec("save_blocking", "torch_save_remote", median(torch_save_remote, args.repeat))
    return last


class TouchedCopy:
    """The floor of a snapshot: the tensors' bytes copied into one buffer made and touched beforehand,
    each at its own offset (what ``save`` does into its pooled buffer). Calling it times one copy."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.srcs = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        self.dst = torch.empty(max(1, sum(s.numel() for s in self.srcs)), dtype=torch.uint8)
        self.dst.fill_(0)  # touched: every page faulted in before any copy is timed

    def __call__(self) -> float:
        t, off = time.perf_counter(), 0
        for s in self.srcs:
            self.dst[off : off + s.numel()].copy_(s)
            off += s.numel()
        return time.perf_counter() - t


def overlap_bench(args: Any, sdir: str, url: Callable[[], str], results: list[dict[str, Any]]) -> None:
    """The blocking of a save made while the previous save is still being written and uploaded.

    Each round measures, at the same point — right after a save #1 returned, its serialize,
    local write and upload all still ahead — once save #2 (timed), and, in a run of its own,
    a plain copy of the same tensors into touched memory (the floor, :class:`TouchedCopy`);
    and the floor with nothing in flight. Two variants: the upload capped at
    ``--overlap-bandwidth`` bytes/s, and uncapped. Ratios are medians of per-round ratios.
    Before the rounds one pair of back-to-back saves makes (and faults in) the second snapshot
    buffer; its blocking is reported as ``first_overlap``. The output says in how many rounds
    save #1 was indeed still uploading when save #2 returned.
    """
    sd = make_state(args.overlap_size)
    size = nbytes(sd)
    floor = TouchedCopy([v for v in sd.values() if isinstance(v, torch.Tensor)])
    floor()  # warm: the copy's own first pass

    def save(opts: staging.MoverOptions) -> tuple[staging.SaveHandle, float]:
        t = time.perf_counter()
        h = staging.save(sd, url(), staging_dir=sdir, cluster=args.cluster, keep_local=2, keep_remote=2,
                         background_mover=False, options=opts)
        return h, time.perf_counter() - t

    def record(path: str, seconds: float, **extra: Any) -> None:
        results.append({"workload": "save_overlap_blocking", "path": path, "clients": 1, "servers": 4, "bytes": size,
                        "seconds": round(seconds, 4), "gbps": round(size / seconds / 1e9, 3), **extra})
        more = "  ".join(f"{k} {v}" for k, v in extra.items())
        print(f"{'save_overlap_blocking':24s} {path:36s} {seconds:8.3f} s  {size / seconds / 1e9:6.2f} GB/s  {more}",
              flush=True)

    opts = staging.MoverOptions(cluster=args.cluster)
    h1, _ = save(opts)
    h2, first = save(opts)  # the run's first overlap: makes the second buffer, unless it exists
    h1.wait()
    h2.wait()
    record("first_overlap", first, extra_buffers=int(h2.extra_buffer), snapshot_wait_s=round(h2.snapshot_wait_s, 4))
    for label, bandwidth in ((f"capped_{args.overlap_bandwidth / 1e6:g}MBps", args.overlap_bandwidth),
                             ("uncapped", None)):
        opts = staging.MoverOptions(cluster=args.cluster, bandwidth=bandwidth)
        idle: list[float] = []
        loaded: list[float] = []
        second: list[float] = []
        waited: list[float] = []
        extra = overlapped = 0
        for _ in range(args.repeat):
            idle.append(floor())
            h1, _ = save(opts)
            loaded.append(floor())
            h1.wait()
            h1, _ = save(opts)
            h2, b = save(opts)
            overlapped += not h1.globally_durable
            second.append(b)
            waited.append(h2.snapshot_wait_s)
            extra += h2.extra_buffer
            h1.wait()
            h2.wait()
        ratio = statistics.median(s / f for s, f in zip(second, loaded))
        ratio_idle = statistics.median(s / f for s, f in zip(second, idle))
        rounds = f"{overlapped}/{args.repeat}"
        record(f"{label}_floor_touched_idle", statistics.median(idle))
        record(f"{label}_floor_touched_after_save", statistics.median(loaded))
        record(f"{label}_second_save", statistics.median(second), ratio_to_floor=round(ratio, 3),
               ratio_to_idle_floor=round(ratio_idle, 3), snapshot_wait_s=round(max(waited), 4),
               extra_buffers=extra, first_still_uploading=rounds)
        print(f"{'':24s} {label}: a save made while the previous one is written and uploaded blocks {ratio:.2f}x "
              f"a copy into touched memory made at the same point ({ratio_idle:.2f}x one with nothing in flight; "
              f"medians of per-round ratios; the previous save was still uploading in {rounds} rounds)", flush=True)


def durable_bench(sd: dict[str, Any], args: Any, client: Client, sdir: str, url: Callable[[], str],
                  rec: Callable[..., None]) -> str:
    """Time from save() to globally durable vs a native write of the same bytes, interleaved.

    Each round writes the native file, then saves with ``keep_local=0`` (upload streamed from the
    snapshot, nothing local), with ``keep_local=0`` and ``verify=False`` (sizes checked, no
    read-back), and with a local copy (``keep_local=1``: local write and upload overlap). The
    ratios are medians of per-round ratios: neighbours in time see the same machine load.
    """
    size = nbytes(sd)
    buf = torch.empty(size, dtype=torch.uint8)
    buf.fill_(1)
    view = memoryview(buf.numpy())

    def native_write() -> float:
        t = time.perf_counter()
        with client.open("/bench/native.bin", "wb") as f:
            f.write(view)
        return time.perf_counter() - t

    variants = {"staging_keep_local_0": (0, True), "staging_keep_local_0_noverify": (0, False),
                "staging_keep_local_1": (1, True)}
    last = ""

    def durable(keep_local: int, verify: bool) -> tuple[float, dict[str, float]]:
        nonlocal last
        last = url()
        opts = staging.MoverOptions(cluster=args.cluster, verify=verify)
        t = time.perf_counter()
        h = staging.save(sd, last, staging_dir=sdir, cluster=args.cluster, keep_local=keep_local, keep_remote=1,
                         background_mover=False, options=opts)
        h.wait()
        return time.perf_counter() - t, h.timings

    durable(1, True)  # warm-up: buffers, connections, the first files of the series
    native_write()
    native: list[float] = []
    got: dict[str, list[tuple[float, dict[str, float]]]] = {k: [] for k in variants}
    for _ in range(args.repeat):
        native.append(native_write())
        for label, (kl, verify) in variants.items():
            got[label].append(durable(kl, verify))
    rec("save_global_durable", "native_write", statistics.median(native))
    for label, runs in got.items():
        rec("save_global_durable", label, statistics.median(d for d, _ in runs))
        ratio = statistics.median(d / n for (d, _), n in zip(runs, native))
        results_note = {p: round(statistics.median(t.get(p, 0.0) for _, t in runs), 3)
                        for p in ("snapshot", "serialize", "local_write", "upload")}
        print(f"{'':24s} {label}: {ratio:.2f}x native write (median of per-round ratios); phases {results_note}",
              flush=True)
    return last


def load_bench(sd: dict[str, Any], args: Any, client: Client, sdir: str, scratch: str, last: str,
               rec: Callable[..., None]) -> None:
    """staging.load from the store vs the loopback socket floor (same bytes, same run) and torch.load."""
    from stripefs.bench.floors import floor_socket

    size = nbytes(sd)
    floor: list[float] = []
    remote: list[float] = []
    noverify: list[float] = []
    for _ in range(args.repeat):  # interleaved: each load is compared with a floor measured next to it
        floor.append(floor_socket(size, streams=4, directory=scratch)["seconds"])
        remote.append(timed(lambda: staging.load(last, cluster=args.cluster, prefer_local=False)))
        noverify.append(timed(lambda: staging.load(last, cluster=args.cluster, prefer_local=False, verify=False)))
    rec("load", "floor_socket", statistics.median(floor))
    rec("load", "staging_remote", statistics.median(remote))
    rec("load", "staging_remote_noverify", statistics.median(noverify))
    ratio = statistics.median(f / r for f, r in zip(floor, remote))
    ratio_nv = statistics.median(f / r for f, r in zip(floor, noverify))
    print(f"{'':24s} load from the store: {ratio:.2f}x the socket floor ({ratio_nv:.2f}x without CRC checks; "
          "median of per-round ratios)", flush=True)
    rec("load", "staging_local", median(lambda: timed(lambda: staging.load(last, cluster=args.cluster,
                                                                           staging_dir=sdir)), args.repeat))
    local_pt = os.path.join(scratch, "local.pt")
    torch.save(sd, local_pt)
    rec("load", "torch_load_mmap_local", median(lambda: timed(
        lambda: [t.sum() for t in torch.load(local_pt, mmap=True, weights_only=True).values()
                 if isinstance(t, torch.Tensor)]), args.repeat))
    if not client.exists("/bench/torch.pt"):
        with client.open("/bench/torch.pt", "wb") as f:
            torch.save(sd, f)
    rec("load", "torch_load_native_file", median(lambda: timed(
        lambda: torch.load(client.open("/bench/torch.pt", "rb"), weights_only=True)), args.repeat))


def restore_state(total: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of equal size, about ``total`` bytes in all (random: incompressible;
    the state of ``stripefs bench``'s ``restore`` workload)."""
    from stripefs.bench._seed import restore_tensors

    return dict(restore_tensors(total, count))


def restore_bench(args: Any, sdir: str, scratch: str, url: Callable[[], str], count: int,
                  results: list[dict[str, Any]]) -> None:
    """``staging.load`` (and ``dcp.load`` through ``StagedStorageReader``) of one state from the
    store and from the local staged copy, vs the socket floor.

    Each round measures the floor, then a load from the store (``prefer_local=False``), then a
    load from the staged copy (the same call, ``staging_dir`` given): the ratios are medians of
    per-round ratios, neighbours in time seeing the same machine load. Each loaded state is
    dropped before the next load, so every such load writes into fresh memory; the ``_into``
    loads (``load(into=...)``) fill a state held all along, as a restarted job's model is.
    """
    from stripefs.bench.floors import floor_socket

    sd = restore_state(args.restore_size, count)
    size = nbytes(sd)
    where = url()
    staging.save(sd, where, staging_dir=sdir, cluster=args.cluster, keep_local=1, keep_remote=1,
                 background_mover=False).wait()
    # A restarted job's state, built (and so touched) before it loads, as a model is: the
    # ``_into`` loads fill it in place (``load(into=...)``), the others make fresh tensors.
    held = {k: v.clone() for k, v in sd.items()}
    del sd
    # The same state through torch DCP (StagedStorageWriter / StagedStorageReader): a DCP
    # load always fills the state it is given. A staging area without the step reads it
    # from the store.
    import torch.distributed.checkpoint as dcp

    # Its own series: retention (keep_local/keep_remote) counts the steps of one series.
    dcp_where = f"stripefs://bench/dcp-restore/{os.path.basename(where)}-t{count}"
    no_copy = tempfile.mkdtemp(prefix="no-copy-", dir=scratch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(held, storage_writer=staging.StagedStorageWriter(dcp_where, staging_dir=sdir, cluster=args.cluster,
                                                                  keep_local=1, keep_remote=1))

    def dcp_load(staging_dir: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(held, storage_reader=staging.StagedStorageReader(dcp_where, staging_dir=staging_dir,
                                                                      cluster=args.cluster))

    def load(**kw: Any) -> Callable[[], Any]:
        return lambda: staging.load(where, cluster=args.cluster, **kw)

    loads = {"store": load(prefer_local=False), "local": load(staging_dir=sdir),
             "store_into": load(prefer_local=False, into=held), "local_into": load(staging_dir=sdir, into=held),
             "dcp_store": lambda: dcp_load(no_copy), "dcp_local": lambda: dcp_load(sdir)}
    times: dict[str, list[float]] = {"floor_socket": [], **{k: [] for k in loads}}
    for fn in loads.values():  # warm-up: connections, the local copy in the page cache
        fn()
    for _ in range(args.repeat):
        times["floor_socket"].append(floor_socket(size, streams=4, directory=scratch)["seconds"])
        for label, fn in loads.items():
            times[label].append(timed(fn))
    workload = f"restore_{count}"
    for label, runs in times.items():
        s = statistics.median(runs)
        ratio = statistics.median(f / r for f, r in zip(times["floor_socket"], runs))
        results.append({"workload": workload, "path": label, "clients": 1, "servers": 4, "bytes": size,
                        "seconds": round(s, 4), "gbps": round(size / s / 1e9, 3), "ratio_to_floor": round(ratio, 3)})
        print(f"{workload:24s} {label:28s} {s:8.3f} s  {size / s / 1e9:6.2f} GB/s  {ratio:5.2f}x floor", flush=True)


def dcp_bench(sd: dict[str, Any], args: Any, scratch: str, sdir: str, rec: Callable[..., None]) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    writer = staging.StagedStorageWriter(staging_dir=sdir, cluster=args.cluster, keep_local=1, keep_remote=1)
    fsw = dcp.FileSystemWriter(os.path.join(scratch, "dcp0"), cache_staged_state_dict=False)
    for label, mk in (("staging_writer", lambda i: (writer, f"stripefs://bench/dcp/step-{i}")),
                      ("torch_fs_writer_local", lambda i: (fsw, os.path.join(scratch, f"dcp{i}")))):
        blocking, total = [], []
        for i in range(args.repeat + 1):
            w, cid = mk(i)
            t = time.perf_counter()
            fut = dcp.async_save(tensors, checkpoint_id=cid, storage_writer=w)
            b = time.perf_counter() - t
            fut.result()
            if i:  # the first one warms the reusable buffers
                blocking.append(b)
                total.append(time.perf_counter() - t)
        rec("dcp_async_save_blocking", label, statistics.median(blocking))
        rec("dcp_async_save_total", label, statistics.median(total))


def train_bench(args: Any, sdir: str, rec: Callable[..., None]) -> None:
    """A loop of matmuls that checkpoints a 256 MiB state every N steps; the wall-time fraction lost."""
    torch.manual_seed(0)
    a = torch.randn(1024, 1024)
    state = {f"p{i}": torch.randn(8 << 20) for i in range(8)}
    every = 20
    runs = iter(range(100))

    def loop(ckpt: bool) -> float:
        run = next(runs)
        t = time.perf_counter()
        pending = None
        for s in range(args.train_steps):
            for _ in range(4):
                torch.mm(a, a)
            state["p0"].add_(1e-3)
            if ckpt and s % every == every - 1:
                if pending is not None:
                    pending.wait()
                pending = staging.save(state, f"stripefs://bench/train{run}/step-{s:06d}", staging_dir=sdir,
                                       cluster=args.cluster, keep_local=1, keep_remote=1, background_mover=False)
        if pending is not None:
            pending.wait()
        return time.perf_counter() - t

    loop(True)  # warm-up
    base, with_ckpt = loop(False), loop(True)
    rec("train_loop_no_ckpt", "baseline", base, 1)
    rec("train_loop_ckpt", "staging", with_ckpt, 1)
    print(f"train loop: {max(0.0, with_ckpt - base) / with_ckpt:.1%} of wall time lost to checkpointing "
          f"(every {every} steps, {args.train_steps} steps)")


if __name__ == "__main__":
    sys.exit(main())
