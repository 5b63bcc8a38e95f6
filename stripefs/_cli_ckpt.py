"""``stripefs ckpt list|latest|verify``: checkpoints written by ``stripefs.staging``, from the shell.

``latest`` is :func:`staging.latest` (the step a resumed run loads); ``list`` shows every
step directory under a prefix with what its manifest says, in the order ``latest()`` and
retention rank them (newest last); ``verify`` is :func:`staging.verify` (every byte read back).
staging imports torch, so this module is imported only by these commands.
"""

from __future__ import annotations

import argparse
import posixpath
import sys
import time
from typing import Any, Callable

from ._units import human as _human

__all__ = ["add_parsers"]


def _step_label(man: dict[str, Any], url: str) -> str:
    """The step a manifest records; a DCP save records none, so the number ending the step's
    directory name (the order latest() and retention use); none at all: '-'."""
    from stripefs.staging._format import step_order  # the one ranking of steps: latest() and retention use it

    step = man.get("step")
    if step is None:
        number = step_order(url)[0]
        step = number if number >= 0 else None
    return "-" if step is None else str(step)


def cmd_verify(a: argparse.Namespace) -> int:
    """Check a committed checkpoint step: manifest checksum, every file's size and CRC32Cs."""
    from stripefs import staging

    try:
        man = staging.verify(a.url, cluster=a.cluster)
    except FileNotFoundError:
        print(f"stripefs ckpt verify: {a.url}: no checkpoint is committed there", file=sys.stderr)
        return 1
    except staging.ChecksumError as exc:
        print(f"stripefs ckpt verify: {a.url}: BAD: {exc.strerror}", file=sys.stderr)
        return 1
    from stripefs.staging._replicas import Durability

    total = sum(f["size"] for f in man["files"])
    dur = Durability.from_record(man.get("durability"))
    committed = "" if dur is None else f", committed with {dur}"
    print(f"{a.url}: OK (step {_step_label(man, a.url)}, {len(man['files'])} files, {_human(total)}, "
          f"every CRC32C checked{committed})")
    return 0


def cmd_latest(a: argparse.Namespace) -> int:
    """Print the URL of the newest loadable step under a prefix (exit 1: none)."""
    from stripefs import staging

    url = staging.latest(a.prefix, cluster=a.cluster)
    if url is None:
        print(f"stripefs ckpt latest: {a.prefix}: no committed checkpoint there", file=sys.stderr)
        return 1
    print(url)
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    """Every step directory under a prefix: step, size, files, when it was made, the replicas the
    store had serving at its commit, its URL."""
    from stripefs import staging
    from stripefs.fsclient.core import normpath
    from stripefs.staging._format import step_order
    from stripefs.staging._mover import client_for
    from stripefs.staging._replicas import Durability

    base = normpath(a.prefix)
    try:
        entries = [e for e in client_for(a.cluster).scandir(base) if not e.name.startswith(".")
                   and (e.attr is None or e.attr.is_dir)]  # hidden: a partial upload, never a step
    except FileNotFoundError:
        print(f"stripefs ckpt list: {a.prefix}: no such directory", file=sys.stderr)
        return 1
    newest = staging.latest(a.prefix, cluster=a.cluster)
    print(f"{'step':>8} {'size':>10} {'files':>6}  {'created':<16} {'replicas':>8}  url")
    for name in sorted((e.name for e in entries), key=step_order):
        url = "stripefs://" + posixpath.join(base, name).lstrip("/")
        try:
            man = staging.read_manifest(url, cluster=a.cluster)
        except FileNotFoundError:
            print(f"{'-':>8} {'-':>10} {'-':>6}  {'-':<16} {'-':>8}  {url}  (not committed)")
            continue
        except staging.ChecksumError as exc:
            print(f"{'-':>8} {'-':>10} {'-':>6}  {'-':<16} {'-':>8}  {url}  (BAD: {exc.strerror})")
            continue
        created = man.get("created")
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if isinstance(created, (int, float)) else "-"
        size = sum(int(f["size"]) for f in man["files"])
        mark = "  (latest)" if url == newest else ""
        # Recorded at the commit since the durability record exists; older steps show '-'.
        dur = Durability.from_record(man.get("durability"))
        replicas = "-" if dur is None else f"{dur.serving}/{dur.replicas}"
        if dur is not None and not dur.full:
            mark = f"  (DEGRADED: committed with {dur}){mark}"
        print(f"{_step_label(man, url):>8} {_human(size):>10} {len(man['files']):>6}  {when:<16} {replicas:>8}  "
              f"{url}{mark}")
    return 0


def add_parsers(sub: Any, cluster_help: str) -> None:
    """The ``ckpt`` command and its subcommands, under the CLI's subparsers ``sub``."""
    sp = sub.add_parser("ckpt", help="Checkpoints written by staging (list, latest, verify)",
                        description="Checkpoints written by stripefs.staging (and its DCP writer)")
    ckpt = sp.add_subparsers(dest="ckpt_cmd", required=True, metavar="SUBCOMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str, description: str, arg: str,
            arg_help: str) -> None:
        p = ckpt.add_parser(name, help=help, description=description)
        p.set_defaults(fn=fn)
        p.add_argument("--cluster", "-c", help=cluster_help)
        p.add_argument(arg, help=arg_help)

    add("list", cmd_list, "List the steps under a prefix",
        "List the step directories under a prefix, oldest first: step, size, files, when it was saved "
        "(the one latest() picks is marked)", "prefix", "e.g. stripefs://ckpt/run1")
    add("latest", cmd_latest, "Print the newest loadable step under a prefix",
        "Print the URL of the newest step under a prefix that can be loaded, as staging.latest() picks it "
        "(exit status 1 when there is none)", "prefix", "e.g. stripefs://ckpt/run1")
    add("verify", cmd_verify, "Check a committed step's manifest and every file's checksums",
        "Check a committed step's manifest and every file's size and CRC32Cs "
        "(exit status 0: good, 1: missing or damaged)", "url", "the step, e.g. stripefs://ckpt/run1/step-000100")
