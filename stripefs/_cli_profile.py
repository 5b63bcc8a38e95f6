"""``stripefs profile FILE``: what an access log says the workload is.

The log comes from a mount (``stripefs mount --access-log FILE``) or a native client
(``STRIPEFS_ACCESS_LOG=FILE``); its format is ``fsclient.core._accesslog``'s. The summary,
as ``juicefs profile`` gives one: operations by type (count, share, bytes, latency
percentiles), the sizes of reads and writes, and the hottest directories (by the first
``--depth`` components of each path's parent directory).
"""

from __future__ import annotations

import argparse
import json
import posixpath
import sys
from collections import defaultdict
from typing import Any, Iterable

from ._units import human as _human

__all__ = ["add_parsers", "summarize"]

_KIND = {"read": "read", "read_bytes": "read", "write": "write", "write_bytes": "write"}  # FUSE and client ops
SIZE_CLASSES = ((4 << 10, "<=4K"), (64 << 10, "<=64K"), (1 << 20, "<=1M"), (4 << 20, "<=4M"), (float("inf"), ">4M"))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def _hot_dir(path: str, depth: int) -> str:
    if not path.startswith("/"):
        return "?"
    parts = [p for p in posixpath.dirname(path).split("/") if p]
    return "/" + "/".join(parts[:depth])


def summarize(lines: Iterable[str], *, depth: int = 2, top: int = 10) -> dict[str, Any]:
    """The summary of an access log's lines (see the module docstring) as plain data."""
    from stripefs.fsclient.core._accesslog import parse_line

    ops: dict[str, list[float]] = defaultdict(list)
    nbytes: dict[str, int] = defaultdict(int)
    errors: dict[str, int] = defaultdict(int)
    sizes: dict[str, dict[str, int]] = {"read": defaultdict(int), "write": defaultdict(int)}
    dirs: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    first = last = None
    bad = 0
    for line in lines:
        rec = parse_line(line)
        if rec is None:
            bad += 1
            continue
        first = rec.time if first is None else min(first, rec.time)
        last = rec.time if last is None else max(last, rec.time)
        ops[rec.op].append(rec.seconds)
        nbytes[rec.op] += rec.size
        if rec.status != "ok":
            errors[rec.op] += 1
        kind = _KIND.get(rec.op)
        if kind is not None and rec.size:
            label = next(name for limit, name in SIZE_CLASSES if rec.size <= limit)
            sizes[kind][label] += 1
        d = dirs[_hot_dir(rec.path, depth)]
        d[0] += 1
        d[1] += rec.size
    total = sum(len(v) for v in ops.values())
    table = []
    for op, lat in sorted(ops.items(), key=lambda kv: -len(kv[1])):
        lat.sort()
        table.append({"op": op, "count": len(lat), "share": len(lat) / total if total else 0.0,
                      "bytes": nbytes[op], "errors": errors[op], "p50_s": _pct(lat, 0.5), "p99_s": _pct(lat, 0.99),
                      "max_s": lat[-1], "total_s": sum(lat)})
    hot = sorted(dirs.items(), key=lambda kv: -kv[1][0])[:top]
    return {"ops": total, "seconds": (last - first) if first is not None and last is not None else 0.0,
            "unparsed": bad, "by_op": table,
            "sizes": {op: {name: sizes[op].get(name, 0) for _l, name in SIZE_CLASSES} for op in sizes},
            "hot_dirs": [{"dir": d, "ops": n, "bytes": b} for d, (n, b) in hot]}


def _ms(s: float) -> str:
    return f"{s * 1000:.2f}"


def render(summary: dict[str, Any]) -> str:
    out = [f"{summary['ops']} operations over {summary['seconds']:.1f} s"
           + (f" ({summary['unparsed']} lines not understood)" if summary["unparsed"] else "")]
    out.append(f"{'op':<12} {'count':>9} {'share':>6} {'bytes':>10} {'errors':>7} {'p50 ms':>8} {'p99 ms':>8} "
               f"{'max ms':>8} {'total s':>8}")
    for r in summary["by_op"]:
        out.append(f"{r['op']:<12} {r['count']:>9} {r['share']:>6.1%} {_human(r['bytes']):>10} {r['errors']:>7} "
                   f"{_ms(r['p50_s']):>8} {_ms(r['p99_s']):>8} {_ms(r['max_s']):>8} {r['total_s']:>8.2f}")
    for op, classes in summary["sizes"].items():
        if any(classes.values()):
            out.append(f"{op} sizes: " + "  ".join(f"{k} {v}" for k, v in classes.items()))
    out.append("hot directories:")
    for d in summary["hot_dirs"]:
        out.append(f"  {d['dir']:<40} {d['ops']:>9} ops {_human(d['bytes']):>10}")
    return "\n".join(out)


def cmd_profile(a: argparse.Namespace) -> int:
    try:
        with open(a.file, errors="replace") as f:
            summary = summarize(f, depth=a.depth, top=a.top)
    except OSError as exc:
        print(f"stripefs profile: {a.file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if a.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        print(render(summary))
    return 0


def add_parsers(sub: Any) -> None:
    sp = sub.add_parser("profile", help="Summarize an access log (stripefs mount --access-log, STRIPEFS_ACCESS_LOG)",
                        description=__doc__.split("\n\n")[1] if __doc__ else None)
    sp.set_defaults(fn=cmd_profile)
    sp.add_argument("file", help="the access log")
    sp.add_argument("--depth", type=int, default=2, help="directory components that name a hot directory (default 2)")
    sp.add_argument("--top", type=int, default=10, help="hot directories shown (default 10)")
    sp.add_argument("--json", action="store_true", help="the summary as JSON")
