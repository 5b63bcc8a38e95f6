"""The seed workloads and checkpoint save/load over an emulated network, stripefs beside MooseFS.

    python -m stripefs.bench.net_bench [--rtt 0.2,1] [--systems native,moosefs] [--clients 2]
                                       [--workloads dataloader,small_writes,burst_interference,checkpoint]
                                       [--dataset-files 600] [--small-files 60] [--rounds 3] [--size 16M]
                                       [--ckpt-size 64M] [--mtu 65000] [--json FILE]

For every round-trip time a fresh :class:`~stripefs.fsclient.testing.netbed.NetBed` of hosts
``meta``, ``stor1``, ``stor2`` (the servers) and ``gpu1`` (the client) is made, each server
host delayed so that the client's round trip to it is the RTT (``NetBed.delay``: netem where
the kernel has it, else the user-space delay line; server to server it is twice that). The
link is measured first (a TCP ping-pong and a bulk send from ``gpu1`` to ``stor1``). Then,
one system at a time on the same hosts:

* ``native``: the deploy walk's roles (:class:`~stripefs.fsclient.testing.netfaults.BedCluster`,
  1 replica, 4 MiB chunks) and the benchmark's own native route;
* ``moosefs``: ``mfsmaster`` on ``meta``, ``mfschunkserver`` on ``stor1`` and ``stor2``
  (goal 1, as ``stripefs bench``'s peer), ``mfsmount`` on ``gpu1``, the POSIX route;

and on each the same ``stripefs bench`` workloads run from client processes on ``gpu1``
(:mod:`bench._orchestrate`'s route runner, so cold reads, verification and records are
``stripefs bench``'s), followed by a checkpoint of ``--ckpt-size`` saved until durable and
loaded cold: ``staging.save``/``staging.load`` on stripefs, ``torch.save`` + ``fsync`` /
``torch.load`` on MooseFS (``ckpt_save``/``ckpt_load`` records). Each system is started
afresh and run ``--rounds`` times per RTT, the order alternating; the table shows each
record's median over the rounds, the JSON every round (``results``, with ``rtt_ms``,
``system`` and ``round``) and the links (``links``).

Caveats:
    * Needs root, network namespaces (the bed's), and for MooseFS its Debian packages; a
      system that cannot start is listed in ``skipped`` with the reason, never faked.
    * Without netem the delay is the delay line's: measured RTTs sit above the setting (the
      ``link`` records say by how much) and a delayed link has a throughput cap (the bulk
      figure): see docs/deploy.md, "A delay without netem".
    * Everything runs on one machine: servers, clients, and the delay lines share its cores.
    * ``--rtt 0`` is the bare veth (no delay line): the same bed, nothing in the way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from stripefs.bench._report import write_json
from stripefs.bench.floors import parse_size
from stripefs.fsclient.testing import netbed
from stripefs.fsclient.testing.netbed import NetBed

__all__ = ["main", "measure_link", "PROBE"]

SERVERS, CLIENT = ["meta", "stor1", "stor2"], "gpu1"
WORKLOADS = ["dataloader", "small_writes", "burst_interference", "checkpoint"]
MFS_PORTS = {"ml": 19419, "cs": 19420, "cl": 19421}
MFS_CS_PORT = 19422
PROBE_PORT = 7600

# A link probe: ``echo`` answers, ``ping`` times one-byte round trips, ``sink``/``send`` a bulk send.
PROBE = r"""
import socket, sys, time
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "serve":  # a connection starting with b"p" is echoed; any other is drained, then b"k"
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen()
    print("ready", flush=True)
    while True:
        c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(1 << 20); n = c.recv_into(buf); echo = n > 0 and buf[0] == 0x70
        while n:
            if echo:
                c.sendall(buf[:n])
            n = c.recv_into(buf)
        if not echo:
            c.sendall(b"k")
        c.close()
elif mode == "ping":
    n = int(sys.argv[4]); c = socket.create_connection((addr, port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); c.sendall(b"p"); c.recv(1); ts.append(time.perf_counter() - t)
    ts.sort(); print(" ".join(f"{ts[int(q * (n - 1))] * 1e3:.4f}" for q in (0, 0.5, 0.9, 0.99)))
elif mode == "send":
    n = int(sys.argv[4]); c = socket.create_connection((addr, port)); b = b"s" * (1 << 20); t = time.perf_counter()
    for _ in range(n >> 20):
        c.sendall(b)
    c.shutdown(socket.SHUT_WR); c.recv(1); print(f"{n / (time.perf_counter() - t) / 1e6:.1f}")
"""


def measure_link(bed: NetBed, src: str, dst: str, pings: int = 1000, bulk: int = 128 << 20) -> dict[str, Any]:
    """Round trips (min/p50/p90/p99 ms of ``pings`` one-byte TCP exchanges) and a bulk send's
    MB/s from ``src`` to ``dst``, each in a process of its own on those hosts."""
    d = bed.host(dst)
    server = d.popen([sys.executable, "-c", PROBE, "serve", d.addr, str(PROBE_PORT)], stdout=subprocess.PIPE,
                     text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        s = bed.host(src)
        ping = s.run([sys.executable, "-c", PROBE, "ping", d.addr, str(PROBE_PORT), str(pings)], timeout=120)
        send = s.run([sys.executable, "-c", PROBE, "send", d.addr, str(PROBE_PORT), str(bulk)], timeout=120)
        if ping.returncode or send.returncode:
            raise RuntimeError(f"link probe {src}->{dst} failed: {ping.stderr.strip()} {send.stderr.strip()}")
        q = [float(x) for x in ping.stdout.split()]
        return {"rtt_min_ms": q[0], "rtt_p50_ms": q[1], "rtt_p90_ms": q[2], "rtt_p99_ms": q[3],
                "bulk_mb_s": float(send.stdout)}
    finally:
        server.kill()
        server.wait()


# -- the systems ----------------------------------------------------------------------------
class NativeOnBed:
    """stripefs's roles on the bed (the deploy walk's commands) and the native route's spec."""

    name = "native"

    def __init__(self, bed: NetBed, root: str, run_id: str) -> None:
        self.bed, self.root, self.run_id = bed, root, run_id
        self.cluster: Any = None

    def start(self) -> dict[str, Any]:
        from stripefs.bench._routes import NativeRoute, RunEnv
        from stripefs.fsclient.testing.netfaults import BedCluster

        self.cluster = BedCluster.start(self.bed, self.root, replicas=1, chunk_size=4 << 20)
        cf = self.cluster.client_file(CLIENT)
        return {"route": NativeRoute().start(RunEnv(cf, self.root, self.run_id, 2)), "cluster": cf,
                "server_pids": [p.pid for p in self.cluster.procs.values()]}

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()


class MooseOnBed:
    """MooseFS with its master on ``meta``, a chunkserver on each ``stor`` host, the mount on the client's.

    The configuration is ``stripefs bench``'s peer's (``bench._peers.MooseRoute``: goal 1,
    root as the working user), on the bed's addresses instead of one private namespace.
    """

    name = "moosefs"

    def __init__(self, bed: NetBed, root: str, run_id: str) -> None:
        self.bed, self.p = bed, os.path.join(root, "moosefs")
        self.mount: subprocess.Popen[bytes] | None = None
        self.stops: list[tuple[str, list[str]]] = []

    def _write(self, name: str, text: str) -> str:
        path = os.path.join(self.p, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def _run(self, host: str, argv: list[str]) -> None:
        p = self.bed.host(host).run(argv, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"moosefs: `{' '.join(argv)}` on {host} failed: {(p.stderr or p.stdout).strip()[-300:]}")

    def start(self) -> dict[str, Any]:
        from stripefs.bench._route_base import RouteSkipped, wait_for

        missing = [x for x in ("mfsmaster", "mfschunkserver", "mfsmount") if shutil.which(x) is None]
        empty = "/var/lib/mfs/metadata.mfs.empty"
        if missing or not os.path.exists(empty):
            raise RouteSkipped(f"moosefs not installed ({' '.join(missing) or empty}; apt-get install "
                               "moosefs-master moosefs-chunkserver moosefs-client)")
        p, meta = self.p, self.bed.host("meta").addr
        for d in ("master", "mnt", *[f"cs-{h}" for h in SERVERS[1:]], *[f"hdd-{h}" for h in SERVERS[1:]]):
            os.makedirs(os.path.join(p, d), exist_ok=True)
        shutil.copy(empty, os.path.join(p, "master", "metadata.mfs"))
        common = "WORKING_USER = root\nWORKING_GROUP = root\n"
        self._write("mfsexports.cfg", "* / rw,alldirs,maproot=0:0\n")
        master = self._write("master.cfg", common + f"DATA_PATH = {p}/master\nEXPORTS_FILENAME = {p}/mfsexports.cfg\n"
                             + "".join(f"MATO{k.upper()}_LISTEN_HOST = {meta}\nMATO{k.upper()}_LISTEN_PORT = {port}\n"
                                       for k, port in MFS_PORTS.items()))
        self._run("meta", ["mfsmaster", "-c", master, "start"])
        self.stops.append(("meta", ["mfsmaster", "-c", master, "stop"]))
        for host in SERVERS[1:]:
            addr = self.bed.host(host).addr
            self._write(f"mfshdd-{host}.cfg", f"{p}/hdd-{host}\n")
            cs = self._write(f"cs-{host}.cfg", common + f"DATA_PATH = {p}/cs-{host}\n"
                             f"HDD_CONF_FILENAME = {p}/mfshdd-{host}.cfg\nMASTER_HOST = {meta}\n"
                             f"MASTER_PORT = {MFS_PORTS['cs']}\nBIND_HOST = {addr}\nCSSERV_LISTEN_HOST = {addr}\n"
                             f"CSSERV_LISTEN_PORT = {MFS_CS_PORT}\n")
            self._run(host, ["mfschunkserver", "-c", cs, "start"])
            self.stops.append((host, ["mfschunkserver", "-c", cs, "stop"]))
        with open(os.path.join(p, "mfsmount.log"), "ab") as log:
            self.mount = self.bed.host(CLIENT).popen(["mfsmount", "-f", f"{p}/mnt", "-H", meta, "-P",
                                                      str(MFS_PORTS["cl"])], stdin=subprocess.DEVNULL,
                                                     stdout=log, stderr=subprocess.STDOUT)
        mount = self.mount

        def mounted() -> bool:
            if mount.poll() is not None:
                raise RouteSkipped(f"mfsmount exited with status {mount.returncode} (see {p}/mfsmount.log)")
            return os.path.ismount(f"{p}/mnt")

        wait_for(mounted, 30, "moosefs mount")
        self._run(CLIENT, ["mfssetgoal", "-r", "1", f"{p}/mnt"])
        return {"route": {"kind": "posix", "root": os.path.join(p, "mnt", "bench")}, "mount": f"{p}/mnt",
                "server_pids": []}

    def stop(self) -> None:
        from stripefs.bench._peers import stop_mount

        if self.mount is not None:
            stop_mount(self.mount, f"{self.p}/mnt")
            self.mount = None
        while self.stops:  # what does not stop in time is killed with the bed's namespaces
            host, argv = self.stops.pop()
            try:
                self.bed.host(host).run(argv, timeout=60)
            except subprocess.TimeoutExpired:
                pass


SYSTEMS: dict[str, type[NativeOnBed] | type[MooseOnBed]] = {"native": NativeOnBed, "moosefs": MooseOnBed}


# -- the client host's side -------------------------------------------------------------------
def _drop_caches() -> None:
    from stripefs.bench._orchestrate import drop_caches

    drop_caches()


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _ckpt(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Save a checkpoint until durable, then load it cold, ``repeat`` times after a warm-up."""
    import statistics

    import torch
    from stripefs.bench.staging_bench import make_state, nbytes

    sd = make_state(job["ckpt_size"])
    size, system, k = nbytes(sd), job["system"], iter(range(1000))
    saves: list[float] = []
    loads: list[float] = []
    if system == "native":
        from stripefs import staging

        cf, base, sdir = job["cluster"], job["route"]["root"] + "/ckpt", os.path.join(job["scratch"], "staging")

        def save() -> str:
            url = f"stripefs:/{base}/step-{next(k):04d}"
            staging.save(sd, url, staging_dir=sdir, cluster=cf, keep_local=0, keep_remote=1,
                         background_mover=False).wait()
            return url

        def load(url: str) -> None:
            staging.load(url, cluster=cf, prefer_local=False)
        path = "native (staging)"
    else:
        base = os.path.join(job["route"]["root"], "ckpt")
        os.makedirs(base, exist_ok=True)

        def save() -> str:
            name = os.path.join(base, f"step-{next(k):04d}.pt")
            with open(name, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            return name

        def load(url: str) -> None:
            torch.load(url, weights_only=True)
        path = "moosefs (torch.save)"
    save()  # warm-up: connections, buffers, the first files of the series
    for _ in range(job["repeat"]):
        t = time.perf_counter()
        last = save()
        saves.append(time.perf_counter() - t)
        _drop_caches()
        loads.append(_timed(lambda url=last: load(url)))
    return [{"workload": w, "path": path, "system": system, "clients": 1, "bytes": size,
             "seconds": round(statistics.median(ts), 4), "gbps": round(size / statistics.median(ts) / 1e9, 4),
             "samples_s": [round(t, 4) for t in ts]} for w, ts in (("ckpt_save", saves), ("ckpt_load", loads))]


def _client_side(job_file: str) -> int:
    """Run on the client host: the workloads through ``stripefs bench``'s route runner, then the checkpoint."""
    from stripefs.bench._orchestrate import BenchConfig, _NullDisplay, _run_route, drop_caches
    from stripefs.bench._route_base import Route

    with open(job_file) as f:
        job = json.load(f)
    cfg = BenchConfig(**job["cfg"])
    out: dict[str, Any] = {"header": {"cold_reads": "drop_caches" if drop_caches() else "posix_fadvise"},
                           "results": [], "skipped": [], "errors": []}
    route = Route()
    route.name, route.servers, route.on_cluster = job["system"], 2, True  # type: ignore[misc]

    class Progress(_NullDisplay):
        def begin(self, label: str, total: int | None) -> None:
            print(f"    {label.strip()} ...", flush=True)

    _run_route(route, job["route"], cfg.clients[0], 2, cfg, out, Progress(), [0], job["server_pids"])
    if job["ckpt_size"]:
        try:
            out["results"] += _ckpt(job)
        except Exception as exc:  # noqa: BLE001 - reported with the others, the run goes on
            out["errors"].append({"path": job["system"], "workload": "ckpt", "error": repr(exc)})
    with open(job["out"], "w") as f:
        json.dump(out, f)
    return 0


# -- the run ------------------------------------------------------------------------------------
def _one_system(bed: NetBed, name: str, args: argparse.Namespace, scratch: str, run_id: str,
                report: dict[str, Any], rtt: float, round_: int) -> None:
    from stripefs.bench._route_base import RouteSkipped

    scratch = os.path.join(scratch, f"{name}-{round_}")
    os.makedirs(scratch)
    system = SYSTEMS[name](bed, scratch, run_id)
    t0 = time.monotonic()
    try:
        started = system.start()
    except (RouteSkipped, RuntimeError, OSError) as exc:
        system.stop()
        report["skipped"].append({"path": name, "rtt_ms": rtt, "reason": str(exc)})
        print(f" {name}: skipped: {exc}", flush=True)
        return
    try:
        job = {"system": name, "route": started["route"], "cluster": started.get("cluster"),
               "server_pids": started["server_pids"], "scratch": os.path.join(scratch, f"{name}-client"),
               "out": os.path.join(scratch, f"{name}-out.json"), "ckpt_size": args.ckpt_size, "repeat": args.repeat,
               "cfg": {"clients": [args.clients], "servers": [2], "workloads": args.workloads, "size": args.size,
                       "block": min(args.size, 4 << 20), "duration": args.duration, "dl_files": args.dl_files,
                       "sw_files": args.sw_files, "timeout": 300.0}}
        os.makedirs(job["scratch"], exist_ok=True)
        job_file = os.path.join(scratch, f"{name}-job.json")
        with open(job_file, "w") as f:
            json.dump(job, f)
        print(f" {name}: started in {time.monotonic() - t0:.1f}s", flush=True)
        p = bed.host(CLIENT).run([sys.executable, "-m", "stripefs.bench.net_bench", "--client-side", job_file],
                                 timeout=1800, capture_output=False)
        if p.returncode != 0 or not os.path.exists(job["out"]):
            report["errors"].append({"path": name, "rtt_ms": rtt, "error": f"client side exited {p.returncode}"})
            return
        with open(job["out"]) as f:
            got = json.load(f)
        for r in got["results"]:
            r.update(rtt_ms=rtt, system=name, round=round_)
        report["results"] += got["results"]
        report["skipped"] += [{**x, "rtt_ms": rtt} for x in got["skipped"]]
        report["errors"] += [{**x, "rtt_ms": rtt} for x in got["errors"]]
    finally:
        system.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every RTT, every system (module docstring); returns the report."""
    import secrets

    report: dict[str, Any] = {"header": {"netem": netbed.has_netem(), "mtu": args.mtu, "command": sys.argv,
                                         "clients": args.clients, "workloads": args.workloads,
                                         "delay": "netem" if netbed.has_netem() else "user-space delay line"},
                              "links": [], "results": [], "skipped": [], "errors": []}
    t_start = time.monotonic()
    for rtt in args.rtt:
        scratch = tempfile.mkdtemp(prefix=f"stripefs-netbench-{rtt}-", dir=args.workdir)
        try:
            with NetBed([*SERVERS, CLIENT], mtu=args.mtu) as bed:
                for host in SERVERS:
                    if rtt > 0:
                        bed.delay(host, rtt)
                link = {"rtt_set_ms": rtt, "delay": report["header"]["delay"] if rtt > 0 else "none (veth)",
                        **measure_link(bed, CLIENT, "stor1")}
                report["links"].append(link)
                print(f"RTT {rtt} ms: measured {link['rtt_p50_ms']:.3f} ms p50 ({link['rtt_p99_ms']:.3f} p99), "
                      f"bulk {link['bulk_mb_s']:.0f} MB/s", flush=True)
                for k in range(args.rounds):  # the systems alternate: neither always runs on the quieter machine
                    for name in (args.systems if k % 2 == 0 else args.systems[::-1]):
                        print(f"  round {k + 1}/{args.rounds}", end="", flush=True)
                        _one_system(bed, name, args, scratch, secrets.token_hex(3), report, rtt, k)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    report["header"]["duration_s"] = round(time.monotonic() - t_start, 1)
    return report


def medians(report: dict[str, Any]) -> dict[tuple[str, float, str], dict[str, float]]:
    """Per (workload, RTT, system): the median over the rounds of throughput, rate, p99 and seconds."""
    import statistics

    runs: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for r in report["results"]:
        runs.setdefault((r["workload"], r["rtt_ms"], r["system"]), []).append(r)
    out = {}
    for key, rs in runs.items():
        out[key] = {f: statistics.median(r[f] for r in rs) for f in ("gbps", "ops_per_s", "latency_p99_ms", "seconds")
                    if all(r.get(f) is not None for r in rs)}
        out[key]["rounds"] = len(rs)
    return out


def table(report: dict[str, Any]) -> str:
    """A markdown table: one row per workload record, one column per RTT and system (medians of the rounds)."""
    med = medians(report)
    keys = sorted({(t, s) for _, t, s in med})
    rows: dict[str, dict[tuple[float, str], str]] = {}
    for (w, t, sname), m in med.items():
        if w.startswith("ckpt_"):
            cell = f"{m['seconds']:.2f} s ({m['gbps'] * 1e3:.0f} MB/s)"
        elif m.get("ops_per_s") and w in ("dataloader", "small_writes", "burst_alone", "burst_interference"):
            cell = f"{m['ops_per_s']:.0f}/s, p99 {m.get('latency_p99_ms', 0):.1f} ms"
        else:
            cell = f"{m['gbps'] * 1e3:.0f} MB/s"
        rows.setdefault(w, {})[(t, sname)] = cell
    head = "| workload | " + " | ".join(f"{s} @ {t:g} ms" for t, s in keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 1)]
    lines += [f"| {w} | " + " | ".join(cells.get(k, "-") for k in keys) + " |" for w, cells in rows.items()]
    links = "\n".join(f"| {x['rtt_set_ms']:g} ms | {x['delay']} | {x['rtt_min_ms']:.3f} / {x['rtt_p50_ms']:.3f} / "
                       f"{x['rtt_p99_ms']:.3f} ms | {x['bulk_mb_s']:.0f} MB/s |" for x in report["links"])
    mtu = report["header"]["mtu"]
    return ("\n".join(lines) + f"\n\n| RTT set | delay (MTU {mtu}) | gpu1->stor1 RTT min / p50 / p99 "
            "| bulk gpu1->stor1 |\n|---|---|---|---|\n" + links + "\n")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stripefs.bench.net_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt", type=_floats, default=[0.2, 1.0], help="round-trip times in ms, comma-separated "
                                                                   "(0: the bare veth)")
    ap.add_argument("--systems", default="native,moosefs", help="native, moosefs")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="stripefs bench workloads")
    ap.add_argument("--clients", type=int, default=2, help="client processes on the client host")
    ap.add_argument("--dataset-files", type=int, default=600, dest="dl_files")
    ap.add_argument("--small-files", type=int, default=60, dest="sw_files", help="per client")
    ap.add_argument("--size", type=parse_size, default=parse_size("16M"), help="bytes per client (checkpoint, burst)")
    ap.add_argument("--duration", type=float, default=1.0, help="seconds of burst_interference's reads alone")
    ap.add_argument("--ckpt-size", type=parse_size, default=parse_size("64M"), help="checkpoint state (0: none)")
    ap.add_argument("--repeat", type=int, default=2, help="checkpoint saves and loads per round (median)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each system per RTT, alternating (median)")
    ap.add_argument("--mtu", type=int, default=netbed.JUMBO_MTU, help="the bed's links' MTU")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--client-side", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_side:
        return _client_side(args.client_side)
    args.systems, args.workloads = args.systems.split(","), args.workloads.split(",")
    if set(args.systems) - set(SYSTEMS):
        ap.error(f"--systems: {', '.join(SYSTEMS)}")
    why = netbed.unavailable()
    if why:
        print(f"net_bench: no network test bed here: {why}", file=sys.stderr)
        return 2
    report = run(args)
    print("\n" + table(report))
    for x in report["skipped"]:
        print(f"skipped: {x}")
    for x in report["errors"]:
        print(f"ERROR: {x}")
    if args.json:
        write_json(report, args.json)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
