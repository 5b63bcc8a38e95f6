"""The ``stripefs`` command line.

Cluster: ``up``, ``down``, ``status``, ``add-server``, ``remove-server``. Files: ``ls stat cat put get cp mv rm mkdir``
(paths inside the file system; the ``stripefs://`` prefix is optional).
Checkpoints: ``ckpt list|latest PREFIX``, ``ckpt verify URL``. Observing: ``top`` (live, from the
metrics endpoints), ``profile FILE`` (an access log's summary); see docs/observability.md.

A command not given ``--cluster`` (nor ``STRIPEFS_CLUSTER``) uses the cluster of the last
``stripefs up`` and says which on stderr (one line; stdout stays the command's output).
Output into a closed pipe (``stripefs ls | head``) ends the command quietly, as ``ls`` does.
Other commands (``mount``, ``umount``, ``mover``, ``bench``) are provided by
their packages and registered in :data:`EXTRA_COMMANDS`.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import stat as _stat
import sys
import time
from typing import Any, Callable

from stripefs.wire import ErrorCode, StripefsError

from stripefs.fsclient import Client, testing

from . import _cli_ckpt, _cli_profile, _cli_serve, _cli_top, _upload
from ._units import human as _human, ls_size

# name -> "module:function" taking (argv) and returning an exit status; loaded lazily so
# `stripefs ls` does not import torch or pyfuse3.
EXTRA_COMMANDS: dict[str, tuple[str, str]] = {
    "mount": ("stripefs.fsclient.fuse", "Mount the file system with FUSE"),
    "umount": ("stripefs.fsclient.fuse", "Unmount a stripefs FUSE mount"),
    "mover": ("stripefs.staging.mover_cli", "Run the checkpoint mover for a staging directory"),
    "bench": ("stripefs.bench.cli", "Run the throughput benchmark"),
    "serve": ("stripefs._cli_serve", "Run one role of a cluster on this host: serve metadata|storage (docs/deploy.md)"),
}


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=total < (32 << 20) or not sys.stderr.isatty())


# -- cluster commands ----------------------------------------------------------------------
UP_DEFAULTS = {"servers": 4, "replicas": 1, "chunk_size": "4M", "stripe": 16, "metadata_store": "sqlite",
               "metadata_services": 1}  # `up`'s defaults for a new cluster (argparse leaves them None: given or not)


def _live_servers(cluster: dict[str, Any]) -> int:
    return sum(1 for s in cluster.get("servers", []) if isinstance(s, dict) and not s.get("removed"))


def _up_conflicts(a: argparse.Namespace, running: dict[str, Any]) -> list[str]:
    """The arguments given to ``up`` that a running cluster differs from and ``up`` cannot apply."""
    from stripefs.bench.floors import parse_size  # the one size parser; lazily, as bench is heavy to import
    from stripefs.metadata._leasetable import LEASE_TTL

    have = {"replicas": running.get("replicas", 1), "chunk_size": running.get("chunk_size"),
            "stripe": running.get("stripe"), "metadata_store": running.get("metadata_store", "sqlite"),
            "metadata_services": max(1, len(running.get("metadata_services") or [])),
            "metadata_sync": running.get("metadata_sync", "full"),
            "data_sync": running.get("data_sync", "full"),
            "lease_ttl": running.get("lease_ttl", LEASE_TTL), "postgres_url": running.get("metadata_store_url")}
    fixed = {"replicas": "replication is set when a cluster is made",
             "chunk_size": "the default layout is set when a cluster is made",
             "stripe": "the default layout is set when a cluster is made",
             "metadata_store": "the store is set when a cluster is made",
             "postgres_url": "the store is set when a cluster is made",
             "metadata_services": "services are started with the cluster: `stripefs down` first",
             "metadata_sync": "it applies when the metadata service starts: `stripefs down` first",
             "data_sync": "it applies when the storage servers start: `stripefs down` first",
             "lease_ttl": "it applies when the metadata service starts: `stripefs down` first"}
    out = []
    for name, why in fixed.items():
        given = getattr(a, name)
        if given is None:
            continue
        wanted = parse_size(given) if name == "chunk_size" else given
        if wanted != have[name]:
            shown = have[name] if name != "postgres_url" else "another database"
            out.append(f"--{name.replace('_', '-')} {given}: the cluster runs with {shown} ({why})")
    live = _live_servers(running)
    if a.servers is not None and a.servers < live:
        out.append(f"--servers {a.servers}: the cluster has {live} storage servers and `up` never removes one "
                   "(`stripefs remove-server ID`)")
    return out


def cmd_up(a: argparse.Namespace) -> int:
    """Start a cluster, restart its dead processes, or (running) apply what can be: more servers.

    An argument a running cluster differs from and that cannot be applied (its replication,
    layout, store) is refused -- exit status 1, nothing changed -- rather than ignored.
    """
    from stripefs.bench.floors import parse_size
    from stripefs.fsclient.core import pid_alive

    old = testing.read_cluster(os.path.abspath(a.root))
    running = old is not None and any(pid_alive(p) for p in old.get("pids", []))
    metrics_base = a.metrics_base if a.metrics_base is not None else (old or {}).get("metrics_base")
    _metrics_env(metrics_base)
    if running:
        assert old is not None
        conflicts = _up_conflicts(a, old)
        for line in conflicts:
            print(f"stripefs up: {line}", file=sys.stderr)
        if conflicts:
            print(f"stripefs up: the cluster under {a.root} is running; nothing was changed", file=sys.stderr)
            return 1
        c = testing.up(a.root)  # restarts dead processes with the cluster's own settings
        more = (a.servers or 0) - _live_servers(c)
        for _ in range(more):
            c = testing.add_server(a.root)
        if more > 0:
            print(f"added {more} storage server{'s' if more > 1 else ''}; they take over their share of the chains in the background "
                  "(`stripefs status`)", file=sys.stderr)
    else:
        opts = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in UP_DEFAULTS.items()}
        c = testing.up(a.root, servers=opts["servers"], replicas=opts["replicas"],
                       chunk_size=parse_size(opts["chunk_size"]), stripe=opts["stripe"],
                       metadata_store=opts["metadata_store"], postgres_url=a.postgres_url,
                       metadata_services=opts["metadata_services"], metadata_sync=a.metadata_sync,
                       lease_ttl=a.lease_ttl, data_sync=a.data_sync)
    if metrics_base is not None:
        c = _record_metrics(c, metrics_base)
    print(f"{c['metadata']['host']}:{c['metadata']['port']}")
    print(f"cluster file: {os.path.join(c['root'], 'cluster.json')} ({_live_servers(c)} storage servers)",
          file=sys.stderr)
    return 0


def _metrics_env(base: int | None) -> None:
    """Have the server processes ``up`` starts serve metrics: from port ``base`` on (each the
    first free one; the metadata service, started first, gets ``base``), or any free port (0)."""
    from stripefs.rpc._metrics import METRICS_ENV

    if base is not None:
        os.environ[METRICS_ENV] = f"127.0.0.1:{base}+" if base else "127.0.0.1:0"


def _record_metrics(c: dict[str, Any], base: int) -> dict[str, Any]:
    """Write where each process serves its metrics into cluster.json (what they recorded)."""
    from stripefs.fsclient.testing._cluster import _write_cluster
    from stripefs.rpc._metrics import METRICS_FILE

    def address(path: str) -> str | None:
        try:
            with open(path) as f:
                return json.load(f).get("address")
        except (OSError, ValueError):
            return None

    root = c["root"]
    for s in c.get("metadata_services") or []:
        s["metrics"] = address(os.path.join(root, "meta", f"metrics-{s['port']}.json"))
    if c.get("metadata"):
        c["metadata"]["metrics"] = address(os.path.join(root, "meta", f"metrics-{c['metadata']['port']}.json"))
    for s in c.get("servers", []):
        if isinstance(s, dict) and not s.get("removed"):
            s["metrics"] = address(os.path.join(s["root"], METRICS_FILE))
    c["metrics_base"] = base
    _write_cluster(root, c)
    return c


def cmd_add_server(a: argparse.Namespace) -> int:
    base = (testing.read_cluster(os.path.abspath(a.root)) or {}).get("metrics_base")
    _metrics_env(base)
    c = testing.add_server(a.root)
    if base is not None:
        c = _record_metrics(c, base)
    s = c["servers"][-1]
    print(f"{s['host']}:{s['port']}")
    print("the new server copies its share of the chains in the background; watch `stripefs status`", file=sys.stderr)
    return 0


SERVER_FILE = "server.json"  # beside a local cluster's cluster.json: the cluster secret (``stripefs up``)


def _server_config(a: argparse.Namespace) -> Any:
    """The servers' credential (ROOT/server.json): administration is not a client's to do."""
    from stripefs.fsclient.core import ClusterConfig, find_cluster

    if a.root:
        return ClusterConfig.from_file(os.path.join(a.root, SERVER_FILE))
    cfg = find_cluster(a.cluster)
    if cfg.role == "server":
        return cfg
    beside = os.path.join(os.path.dirname(cfg.path), SERVER_FILE) if cfg.path else ""
    if beside and os.path.exists(beside):
        return ClusterConfig.from_file(beside)
    raise StripefsError(ErrorCode.ACCESS, "this needs the servers' credential, which a client's cluster.json does not "
                                          "hold: pass --root DIR of the cluster (DIR/server.json) or --cluster DIR/server.json")


def _what_is_lost(c: Client, sid: int, chains: list[int]) -> str:
    """Chunks and bytes server ``sid`` holds of ``chains`` (ListChunks, paged; a server's request)."""
    from stripefs.wire import messages as m

    count = size = 0
    try:
        for chain in chains:
            after = None
            while True:
                page = c.call_storage(sid, m.ListChunks(chain=chain, after=after, limit=8192), timeout=30.0)
                count += len(page.chunks)
                size += sum(int(e[3]) for e in page.chunks)
                if not page.more or not page.chunks:
                    break
                after = page.chunks[-1][:2]
    except StripefsError as exc:
        return f"chunk count unknown (server {sid} unreachable: {exc.message})"
    return f"{count} chunks, {_human(size)} held only by server {sid}"


def cmd_remove_server(a: argparse.Namespace) -> int:
    """Drain a storage server (R >= 2) and remove it for good; with R = 1 only with --force."""
    from stripefs.wire import messages as m

    cfg = _server_config(a)
    with Client(cfg) as c:
        known = {s.server_id: s for s in c.status().servers}
        if a.id not in known:
            raise StripefsError(ErrorCode.NOT_FOUND, f"no storage server {a.id} in this cluster "
                                                     f"(servers: {', '.join(map(str, sorted(known))) or 'none'})")
        at_risk = [ch["chain_id"] for ch in c.status().chains if a.id in ch["targets"]
                   and not any(t != a.id and st == "serving" for t, st in zip(ch["targets"], ch["states"]))]
        # Counted before the request: once removed, the server may stop answering.
        lost_data = _what_is_lost(c, a.id, at_risk) if at_risk and known[a.id].state != "removed" else ""
        try:
            reply = c.call(m.RemoveServer(server_id=a.id, force=a.force))
        except StripefsError as exc:
            if exc.code == ErrorCode.PERMISSION:
                print(f"stripefs remove-server: {exc.message}; {lost_data}", file=sys.stderr)
                return 1
            raise
        if reply.lost:
            print(f"server {a.id} removed; chains lost: {', '.join(map(str, reply.lost))} ({lost_data}): the files "
                  "striped over them cannot be read", file=sys.stderr)
        deadline = time.monotonic() + a.timeout
        state = reply.state
        while state == "draining" and not a.no_wait:
            if time.monotonic() > deadline:
                raise StripefsError(ErrorCode.TIMEOUT, f"server {a.id} still draining after {a.timeout:.0f}s "
                                                       "(it goes on; watch `stripefs status`)")
            time.sleep(0.5)
            st = c.status()
            info = next(s for s in st.servers if s.server_id == a.id)
            state = "removed" if info.state == "removed" else "draining"
            left = [ch["chain_id"] for ch in st.chains if a.id in ch["targets"]]
            print(f"draining server {a.id}: chains left {left}", file=sys.stderr)
        info = known[a.id]
        if state == "removed" and cfg.path:
            testing.mark_removed(os.path.dirname(cfg.path), info.host, info.port)  # `up` never restarts it
    print(f"server {a.id}: {state}")
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    n = testing.down(a.root)
    print(f"stopped {n} processes", file=sys.stderr)
    return 0


def _service_roles(services: tuple[tuple[str, int], ...], secret: str) -> list[tuple[str, int, str]]:
    """Each metadata service's role as it says itself: leader, follower or unreachable."""
    from stripefs.wire import messages as m

    out = []
    for host, port in services:
        try:
            with Client(f"{host}:{port}", secret=secret) as one:
                md = one.call(m.ClusterStatus(), timeout=2.0).metadata
            out.append((host, port, f"{'leader' if md.get('leader') else 'follower'}  pid {md.get('pid', '?')}"))
        except (OSError, StripefsError) as exc:
            out.append((host, port, f"unreachable ({exc})"))
    return out


def cmd_status(a: argparse.Namespace) -> int:
    from stripefs.kvcache import namespaces

    with Client(a.cluster) as c:
        st = c.status()
        address = "%s:%d" % c.config.metadata
        services, secret = c.config.addresses, c.config.secret
        kv = namespaces(c)
    if a.json:
        out = st.to_header()  # the wire form: plain maps, as the service sent them
        out["metadata"] = {**out["metadata"], "address": address}
        out["kvcache"] = [{"namespace": n.name, "page_size": n.page_size, "segments": n.segments, "pages": n.pages,
                           "occupancy_bytes": n.occupancy_bytes, "retired_segments": n.retired} for n in kv]
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    md = st.metadata
    where = f"{address}  pid {md['pid']}" if len(services) == 1 else f"{len(services)} services"
    ttl = md.get("lease_ttl")
    leases = f"leases {ttl:g} s" if isinstance(ttl, (int, float)) and ttl > 0 else "leases off"
    print(f"metadata  {where}  store {md.get('store', 'sqlite')}  sync {md.get('sync', 'full')}  {leases}  "
          f"inodes {md.get('inodes', '?')}  routing v{st.routing_version}")
    if len(services) > 1:
        for host, port, role in _service_roles(services, secret):
            print(f"    service {host}:{port}  {role}")
    print(f"{'id':>3} {'address':<22} {'state':<8} {'pid':>7} {'used':>12} {'capacity':>12}")
    for s in st.servers:
        print(f"{s.server_id:>3} {s.host + ':' + str(s.port):<22} {s.state:<8} {s.pid:>7} {_human(s.used):>12} {_human(s.capacity):>12}")
    removed = [s.server_id for s in st.servers if s.state == "removed"]
    if removed:
        print(f"    removed for good: {', '.join(map(str, removed))}")
    for p in md.get("pending", []):  # registrations the metadata service has not admitted (yet)
        print(f"    pending {p['server_id']} ({p['host']}:{p['port']}, {p['waiting']}s): {p['reason']}")
    def chain(c: dict[str, Any]) -> str:
        return "[" + ",".join(f"{t}{'' if s == 'serving' else '(' + s + ')'}" for t, s in zip(c["targets"], c["states"])) + "]"

    print(f"chains (replicas {st.replicas}): " + "  ".join(f"{c['chain_id']}:{chain(c)}" for c in st.chains))
    for n in kv:  # KV-cache namespaces (docs/kvcache.md)
        print(f"kvcache {n.name}  pages of {_human(n.page_size)}  {n.pages} pages in {n.segments} segments "
              f"({_human(n.occupancy_bytes)})  {n.retired} retired")
    return 0


def cmd_scrub(a: argparse.Namespace) -> int:
    """Verify every chunk on every serving server; repair bad ones from a replica."""
    from stripefs.wire import messages as m

    bad_left = 0
    with Client(a.cluster) as c:
        routing = c.routing(refresh=True)
        report: list[dict[str, Any]] = []
        for sid, info in sorted(routing.servers.items()):
            if info.state != "serving":
                report.append({"server_id": sid, "state": info.state, "skipped": True})
                continue
            scrubbed = c.call_storage(sid, m.Scrub(repair=not a.no_repair), timeout=3600)
            bad_left += len(scrubbed.bad) - scrubbed.repaired
            report.append({"server_id": sid, "state": info.state, **scrubbed.to_header()})
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        for r in report:
            if r.get("skipped"):
                print(f"server {r['server_id']}: {r['state']}, skipped")
            else:
                print(f"server {r['server_id']}: {r['checked']} chunks verified, {len(r['bad'])} bad, {r['repaired']} repaired")
    return 1 if bad_left else 0


# -- file commands ----------------------------------------------------------------------------
def _type_char(mode: int) -> str:
    return _stat.filemode(mode)[0]  # d l - p s c b, as ls shows them


def _owner(uid: int, names: dict[int, str]) -> str:
    if uid not in names:
        try:
            names[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:  # no such user here: the number, as ls shows it
            names[uid] = str(uid)
    return names[uid]


def _group(gid: int, names: dict[int, str]) -> str:
    if gid not in names:
        try:
            names[gid] = grp.getgrgid(gid).gr_name
        except KeyError:
            names[gid] = str(gid)
    return names[gid]


def cmd_ls(a: argparse.Namespace) -> int:
    """List directories (names starting with '.' only with -a, as ls); -l long, -h human sizes."""
    users: dict[int, str] = {}
    groups: dict[int, str] = {}

    def size_of(attr: Any) -> str:
        if _stat.S_ISCHR(attr.mode) or _stat.S_ISBLK(attr.mode):  # device nodes show their number, as ls does
            return f"{os.major(attr.rdev)}, {os.minor(attr.rdev)}"
        return ls_size(attr.size) if a.human else str(attr.size)

    def long_line(attr: Any, name: str) -> str:
        mtime = time.strftime("%Y-%m-%d %H:%M", time.localtime(attr.mtime_ns / 1e9))
        return (f"{_stat.filemode(attr.mode)} {attr.nlink:>3} {_owner(attr.uid, users):<8} {_group(attr.gid, groups):<8} "
                f"{size_of(attr):>12} {mtime} {name}")

    with Client(a.cluster) as c:
        for path in a.paths or ["/"]:
            st = c.stat(path)
            if not st.is_dir:
                print(long_line(st, path) if a.long else f"{_stat.filemode(st.mode)} {size_of(st):>12} {path}")
                continue
            for e in c.scandir(path):
                if e.name.startswith(".") and not a.all:
                    continue
                if a.long and e.attr is not None:
                    print(long_line(e.attr, e.name))
                else:
                    print(e.name + ("/" if _stat.S_ISDIR(e.mode) else ""))
    return 0


def cmd_stat(a: argparse.Namespace) -> int:
    with Client(a.cluster) as c:
        for path in a.paths:
            st = c.stat(path)
            info: dict[str, Any] = {"path": path, "ino": st.ino, "type": _type_char(st.mode), "mode": oct(st.mode & 0o7777),
                                    "size": st.size, "nlink": st.nlink, "uid": st.uid, "gid": st.gid,
                                    "mtime_ns": st.mtime_ns, "ctime_ns": st.ctime_ns}
            if st.layout is not None:
                info["layout"] = {"chunk_size": st.layout.chunk_size, "stripe": st.layout.stripe, "chains": list(st.layout.chains)}
                if a.chunks:
                    info["chunks"] = c.placement(path)
            print(json.dumps(info, indent=2))
    return 0


def cmd_cat(a: argparse.Namespace) -> int:
    out = sys.stdout.buffer
    with Client(a.cluster) as c:
        for path in a.paths:
            with c.open(path, "rb") as f:
                while chunk := f.read(8 << 20):
                    out.write(chunk)
    out.flush()
    return 0


def _pump(fin: Any, fout: Any, size: int, window: int, desc: str) -> None:
    """Copy ``fin`` to ``fout`` through one reused buffer, with a progress bar."""
    view = memoryview(bytearray(window))
    with _progress(size, desc) as bar:
        while n := fin.readinto(view):
            fout.write(view[:n])
            bar.update(n)


def cmd_put(a: argparse.Namespace) -> int:
    """Copy a local file in; with -r a directory tree (in parallel: :mod:`stripefs._upload`)."""
    if os.path.isdir(a.src) and not a.recursive:
        raise StripefsError(ErrorCode.IS_DIR, "is a directory (use put -r)", a.src)
    with Client(a.cluster) as c:
        dst = a.dst
        if c.isdir(dst):  # into an existing directory, as cp does
            dst = dst.rstrip("/") + "/" + os.path.basename(os.path.abspath(a.src))
        if not os.path.isdir(a.src):
            with open(a.src, "rb") as fin, c.open(dst, "wb") as fout:
                _pump(fin, fout, os.path.getsize(a.src), fout.window, "put")
            return 0
        plan = _upload.plan_tree(a.src, dst)
        t0 = time.monotonic()
        with _progress(plan.size, "put") as bar:
            failed = _upload.put_tree(c, plan, workers=a.jobs, progress=bar.update)
    for local, remote, exc in failed:
        print(f"stripefs put: {local} -> {remote}: {exc.strerror or exc}", file=sys.stderr)
    if plan.skipped:
        print(f"stripefs put: skipped {len(plan.skipped)} entries that are not regular files "
              f"(e.g. {plan.skipped[0]})", file=sys.stderr)
    took = time.monotonic() - t0
    print(f"{len(plan.files) - len(failed)} files, {len(plan.dirs)} directories, {_human(plan.size)} "
          f"in {took:.1f} s", file=sys.stderr)
    return 1 if failed else 0


def cmd_get(a: argparse.Namespace) -> int:
    with Client(a.cluster) as c:
        dst = a.dst
        if os.path.isdir(dst):
            dst = os.path.join(dst, os.path.basename(a.src.rstrip("/")))
        with c.open(a.src, "rb") as fin, open(dst, "wb") as fout:
            _pump(fin, fout, fin.size, fin.window, "get")
    return 0


def cmd_cp(a: argparse.Namespace) -> int:
    with Client(a.cluster) as c:
        dst = a.dst.rstrip("/") + "/" + os.path.basename(a.src) if c.isdir(a.dst) else a.dst
        c.copy(a.src, dst)
    return 0


def cmd_mv(a: argparse.Namespace) -> int:
    with Client(a.cluster) as c:
        dst = a.dst.rstrip("/") + "/" + os.path.basename(a.src) if c.isdir(a.dst) else a.dst
        c.rename(a.src, dst)
    return 0


def _rm_tree(c: Client, path: str) -> None:
    for e in list(c.scandir(path, attrs=False)):
        child = path.rstrip("/") + "/" + e.name
        if _stat.S_ISDIR(e.mode):
            _rm_tree(c, child)
        else:
            c.remove(child)
    c.rmdir(path)


def cmd_rm(a: argparse.Namespace) -> int:
    with Client(a.cluster) as c:
        for path in a.paths:
            st = c.lstat(path)
            if st.is_dir:
                if not a.recursive:
                    raise StripefsError(ErrorCode.IS_DIR, "is a directory (use -r)", path)
                _rm_tree(c, path)
            else:
                c.remove(path)
    return 0


def cmd_mkdir(a: argparse.Namespace) -> int:
    with Client(a.cluster) as c:
        for path in a.paths:
            if a.parents:
                c.makedirs(path, exist_ok=True)
            else:
                c.mkdir(path)
    return 0


CLUSTER_HELP = ("cluster.json path, the directory holding it, or host:port (default: $STRIPEFS_CLUSTER, then the "
                "last `stripefs up` as this command found it)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stripefs", description="stripefs: a parallel file system for training clusters")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str, cluster: bool = True,
            **kw: Any) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, **kw)
        sp.set_defaults(fn=fn)
        if cluster:
            sp.add_argument("--cluster", "-c", help=CLUSTER_HELP)
        return sp

    sp = add("up", cmd_up, "Start (or restart) a local cluster under --root; on a running one, add servers "
                           "up to --servers (other settings that differ are refused)", cluster=False)
    sp.add_argument("--root", required=True)
    sp.add_argument("--metrics-base", type=int, metavar="PORT",
                    help="every process serves Prometheus metrics: the metadata service on PORT, the storage servers "
                         "on the next free ports (0: any free ports); recorded in cluster.json for `stripefs top` "
                         "(a restart keeps the cluster's setting unless given)")
    sp.add_argument("--servers", type=int, help="storage servers (default 4)")
    sp.add_argument("--replicas", type=int, help="targets per chain: 1 (default), 2 or 3")
    sp.add_argument("--chunk-size", help="default chunk size of new files (default 4M)")
    sp.add_argument("--stripe", type=int, help="default stripe width of new files (default 16)")
    sp.add_argument("--metadata-store", choices=["sqlite", "postgresql"],
                    help="where the namespace lives, sqlite (default) or postgresql (a private server under "
                         "--root unless --postgres-url)")
    sp.add_argument("--postgres-url", help="postgresql://user:password@host:port/db for --metadata-store postgresql")
    sp.add_argument("--metadata-services", type=int,
                    help="metadata service processes sharing the store (default 1; above 1 needs --metadata-store "
                         "postgresql)")
    sp.add_argument("--metadata-sync", choices=["full", "normal"], default=None,
                    help="SQLite durability: full (default) = each acknowledged operation survives power loss; "
                         "normal = no fsync per commit: it survives a kill -9, the last ones may be lost on power "
                         "loss (a restart keeps the cluster's setting unless given)")
    sp.add_argument("--data-sync", choices=["full", "none"], default=None,
                    help="storage durability: full (default) = an acknowledged chunk write is synced to disk and "
                         "survives power loss; none = acknowledged from the page cache: it survives a kill -9, not a "
                         "power loss (as MooseFS's chunkservers by default; a restart keeps the cluster's setting "
                         "unless given)")
    sp.add_argument("--lease-ttl", type=float, default=None,
                    help="seconds an attribute lease lives (default 5): clients answer stat from their cache under "
                         "it; a client that cannot be told of a change delays that change this long at most; "
                         "0 grants none (SQLite store only)")
    sp = add("add-server", cmd_add_server, "Add a storage server to the running cluster under --root (rebalances)", cluster=False)
    sp.add_argument("--root", required=True)
    sp = add("remove-server", cmd_remove_server, "Drain a storage server onto the others and remove it for good")
    sp.add_argument("id", type=int, help="the server id (stripefs status)")
    sp.add_argument("--root", help="the cluster directory (its server.json holds the servers' credential)")
    sp.add_argument("--force", action="store_true", help="remove it even when chains only it serves are lost")
    sp.add_argument("--no-wait", action="store_true", help="return while it drains")
    sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the drain")
    sp = add("down", cmd_down, "Stop the local cluster under --root", cluster=False)
    sp.add_argument("--root", required=True)
    sp = add("scrub", cmd_scrub, "Verify every chunk's checksums on every server and repair bad replicas")
    sp.add_argument("--no-repair", action="store_true")
    sp.add_argument("--json", action="store_true")
    sp = add("status", cmd_status, "Show servers, their state and usage, and the chain table")
    sp.add_argument("--json", action="store_true")
    sp = add("ls", cmd_ls, "List directories", add_help=False)  # -h is human sizes, as in ls: --help for help
    sp.add_argument("--help", action="help", help="show this help message and exit")
    sp.add_argument("-l", "--long", action="store_true", help="mode, links, owner, group, size, mtime")
    sp.add_argument("-a", "--all", action="store_true", help="also names starting with '.'")
    sp.add_argument("-h", "--human-readable", dest="human", action="store_true", help="sizes as 1.5K 23M 4.0G")
    sp.add_argument("paths", nargs="*")
    sp = add("stat", cmd_stat, "Show attributes and layout")
    sp.add_argument("--chunks", action="store_true", help="list every chunk and the server holding it")
    sp.add_argument("paths", nargs="+")
    add("cat", cmd_cat, "Write files to stdout").add_argument("paths", nargs="+")
    sp = add("put", cmd_put, "Copy a local file in (a directory tree with -r, many files at once)")
    sp.add_argument("-r", "--recursive", action="store_true",
                    help="copy a directory tree: files created in batches, written by --jobs threads")
    sp.add_argument("-j", "--jobs", type=int, default=16, help="files written at once with -r (default 16)")
    sp.add_argument("src")
    sp.add_argument("dst")
    for name, fn, help in (("get", cmd_get, "Copy a file out"), ("cp", cmd_cp, "Copy inside the file system"),
                           ("mv", cmd_mv, "Rename atomically")):
        sp = add(name, fn, help)
        sp.add_argument("src")
        sp.add_argument("dst")
    sp = add("rm", cmd_rm, "Remove files (and directories with -r)")
    sp.add_argument("-r", "--recursive", action="store_true")
    sp.add_argument("paths", nargs="+")
    sp = add("mkdir", cmd_mkdir, "Create directories")
    sp.add_argument("-p", "--parents", action="store_true")
    sp.add_argument("paths", nargs="+")
    _cli_ckpt.add_parsers(sub, CLUSTER_HELP)
    _cli_top.add_parsers(sub, CLUSTER_HELP)
    _cli_profile.add_parsers(sub)
    _cli_serve.add_parsers(sub)
    for name, (_mod, help) in EXTRA_COMMANDS.items():
        sub.add_parser(name, help=help, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in EXTRA_COMMANDS:
        import importlib

        module = EXTRA_COMMANDS[argv[0]][0]
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            print(f"stripefs {argv[0]}: not available ({exc})", file=sys.stderr)
            return 2
        return int(mod.main(argv) or 0)
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "cluster") and args.cluster is None and not getattr(args, "root", None):
            args.cluster = _default_cluster()
        status = args.fn(args)
        sys.stdout.flush()  # here, so that a closed pipe is seen by the handler below
        return status
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"stripefs {args.cmd}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _default_cluster() -> str | None:
    """The cluster a command not given ``--cluster`` uses; when it is the last ``stripefs up``'s
    (not named by ``STRIPEFS_CLUSTER``), one line on stderr says which."""
    from stripefs.fsclient.core import find_cluster

    if os.environ.get("STRIPEFS_CLUSTER"):
        return None  # named by the user; Client reads it
    cfg = find_cluster(None)
    print(f"stripefs: cluster {cfg.path} (the last `stripefs up`; --cluster or STRIPEFS_CLUSTER to choose)",
          file=sys.stderr)
    return cfg.path


def _quiet_broken_pipe() -> int:
    """Whoever read our output is gone (``| head``): end quietly, with the status a process
    killed by SIGPIPE has (128 + 13), as ls or cat do. SIGPIPE itself stays ignored (Python's
    default): it would also kill the process on a write to a server's closed socket."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
    except (OSError, ValueError):
        pass
    return 141


if __name__ == "__main__":
    sys.exit(main())
