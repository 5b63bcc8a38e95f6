"""``make demo``: start a local cluster and show the main jobs working.

Steps: start 4 storage servers + the metadata service under ``--root``; write a
64 MiB file and show its chunks spread over every server; read it back and
compare checksums; read a small dataset in batches through the zero-copy read ring;
then (when those parts are installed) mount the cluster with
FUSE and use shell tools on it, and save/restore a small model through the
checkpoint mover. The cluster keeps running afterwards; ``stripefs down --root
ROOT`` stops it.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import shutil
import subprocess
import sys
import time

from stripefs.fsclient import Client, testing


def say(msg: str) -> None:
    print(f"\n\033[1m== {msg}\033[0m", flush=True)


def demo_core(c: Client) -> str:
    say("write a 64 MiB file through the native client (chunks go to all servers in parallel)")
    data = os.urandom(1 << 20) * 64
    c.makedirs("/demo")
    t = time.perf_counter()
    with c.open("/demo/data.bin", "wb") as f:
        f.write(data)
    dt = time.perf_counter() - t
    print(f"wrote {len(data) >> 20} MiB in {dt:.2f}s ({len(data) / dt / 1e9:.2f} GB/s, fdatasync per chunk)")
    placement = c.placement("/demo/data.bin")
    per_server = collections.Counter(p["server"] for p in placement)
    attr = c.stat("/demo/data.bin")
    assert attr.layout is not None
    print(f"layout: chunk {attr.layout.chunk_size >> 20} MiB, stripe {attr.layout.stripe}, chains {list(attr.layout.chains)}")
    for sid, n in sorted(per_server.items()):
        print(f"  server {sid}: {n} chunks")
    print("  first chunks: " + ", ".join(f"#{p['index']}->server {p['server']}" for p in placement[:8]))
    say("read it back and compare")
    t = time.perf_counter()
    back = c.read_bytes("/demo/data.bin")
    dt = time.perf_counter() - t
    same = hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    print(f"read {len(back) >> 20} MiB in {dt:.2f}s; sha256 equal: {same}")
    if not same:
        raise SystemExit("demo failed: data differs")
    return hashlib.sha256(data).hexdigest()


def demo_dataset(c: Client) -> None:
    say("a dataloader's batches: 512 small files, 64 at a time, through the zero-copy read ring")
    from stripefs.fsclient.batchread import ReadRing

    c.makedirs("/demo/dataset", exist_ok=True)
    blob = os.urandom(64 << 10)
    files = {f"/demo/dataset/s{i:04d}": blob[i * 97 % 1024:][: 4096 * (1 + i % 15)] for i in range(512)}
    for path, body in files.items():
        c.write_bytes(path, body)
    order = sorted(files, key=lambda p: hashlib.sha256(p.encode()).digest())  # a shuffled epoch
    same = True
    with ReadRing(c, entries=64) as ring:
        t = time.perf_counter()
        for start in range(0, len(order), 64):
            batch = order[start:start + 64]
            registered = ring.open_many(batch)  # after the first batch: the directory's leased listing
            bufs = [bytearray(f.size) for f in registered]
            ring.read([(b, f, 0, f.size) for b, f in zip(bufs, registered)])
            same = same and all(bytes(b) == files[p] for b, p in zip(bufs, batch))
        dt = time.perf_counter() - t
    print(f"read {len(order)} files in batches of 64: {len(order) / dt:,.0f} files/s; all equal: {same}")
    if not same:
        raise SystemExit("demo failed: a dataset file differs")


def demo_fuse(root: str, cluster_file: str, digest: str) -> None:
    try:
        import pyfuse3  # noqa: F401
    except ImportError as exc:
        print(f"(FUSE mount not available: {exc})")
        return
    if not os.path.exists("/dev/fuse"):
        print("(no /dev/fuse here: skipping the mount)")
        return
    mnt = os.path.join(root, "mnt")
    os.makedirs(mnt, exist_ok=True)
    say(f"mount the cluster at {mnt} and use shell tools")
    stripefs = [sys.executable, "-m", "stripefs"]
    subprocess.run([*stripefs, "umount", mnt], capture_output=True)
    subprocess.run([*stripefs, "mount", mnt, "--cluster", cluster_file], check=True)
    try:
        for cmd in (f"ls -la {mnt}/demo", f"mkdir -p {mnt}/demo/tree && cp -r /etc/apt {mnt}/demo/tree/",
                    f"du -sh {mnt}/demo/tree", f"df -h {mnt}"):
            print(f"$ {cmd}", flush=True)
            subprocess.run(cmd, shell=True, check=True)
        print(f"$ sha256sum {mnt}/demo/data.bin", flush=True)
        out = subprocess.run(["sha256sum", f"{mnt}/demo/data.bin"], capture_output=True, text=True, check=True).stdout
        print(out.strip())
        print(f"same bytes through the mount as written by the native client: {out.split()[0] == digest}")
        if out.split()[0] != digest:
            raise SystemExit("demo failed: the mount shows other bytes")
    finally:
        subprocess.run([*stripefs, "umount", mnt], check=False)


def demo_checkpoint(cluster_file: str, root: str) -> None:
    try:
        import torch

        from stripefs import staging

        staging.save  # noqa: B018 - present once the staging package is built
    except (ImportError, AttributeError) as exc:
        print(f"(checkpoint staging not available: {exc})")
        return
    say("save a small model through local staging + the background mover, then restore it")
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    state = {"model": model.state_dict(), "step": 100}
    t = time.perf_counter()
    handle = staging.save(state, "stripefs://demo/ckpt/step-100", staging_dir=os.path.join(root, "staging"), cluster=cluster_file)
    blocked = time.perf_counter() - t
    handle.wait(120)
    print(f"save() blocked the caller for {blocked * 1000:.1f} ms; globally durable after {time.perf_counter() - t:.2f}s")
    back = staging.load("stripefs://demo/ckpt/step-100", cluster=cluster_file)
    ok = all(torch.equal(back["model"][k], v) for k, v in state["model"].items()) and back["step"] == 100
    print(f"restored {len(back['model'])} tensors, step {back['step']}; equal: {ok}")
    print(f"latest step under demo/ckpt: {staging.latest('stripefs://demo/ckpt', cluster=cluster_file)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.demo")
    p.add_argument("--root", default="/tmp/stripefs-demo")
    p.add_argument("--fresh", action="store_true", help="delete ROOT first")
    args = p.parse_args(argv)
    if args.fresh and os.path.exists(args.root):
        try:
            testing.down(args.root)
        except OSError:
            pass
        shutil.rmtree(args.root)
    say(f"start a local cluster under {args.root} (metadata service + 4 storage servers)")
    cluster = testing.up(args.root, servers=4)
    cluster_file = os.path.join(cluster["root"], "cluster.json")
    print(f"metadata service at {cluster['metadata']['host']}:{cluster['metadata']['port']}; cluster file {cluster_file}")
    with Client(cluster_file) as c:
        digest = demo_core(c)
        demo_dataset(c)
        demo_fuse(args.root, cluster_file, digest)
        demo_checkpoint(cluster_file, args.root)
        say("cluster status")
    subprocess.run([sys.executable, "-m", "stripefs", "status", "--cluster", cluster_file], check=True)
    print(f"\nThe cluster keeps running. Try: .venv/bin/stripefs ls -l /demo    Stop it: .venv/bin/stripefs down --root {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
