"""Showing results: the live progress display, the summary table, the JSON file, the plot.

The JSON (``--json FILE``) has a stable format (docs/benchmarks.md)::

    {"header": {"machine": {...facts, package versions}, "config": {...}, "stripefs": "0.1.0",
                "command": [...], "duration_s": ..., "cold_reads": ..., "metadata_sync": "full"},
     "results": [{"workload", "path", "clients", "servers", "bytes", "seconds", "gbps",
                  "ops", "ops_per_s", "latency_p50_ms", "latency_p99_ms",
                  "latency_quantiles_ms", "verified_bytes", "vs_floor_socket"}, ...],
     "skipped": [{"path", "reason", ...}], "errors": [{"path", "workload", "error", ...}],
     "invalid": [{"path", "workload", "clients", "servers", "gbps", "floor_gbps", "reason"}]}

Latency fields appear where a workload times operations; ``vs_floor_socket`` is the record's
throughput over the loopback socket floor measured in the same run with the same clients.

Caveats:
    * The plot is drawn from the JSON alone (``plot(report, path)``), so an old run can be
      re-plotted; it needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["LiveDisplay", "print_summary", "write_json", "plot"]


class LiveDisplay:
    """rich progress bars on stderr while a workload runs, one finished line per record.

    Args:
        enabled: False prints only the finished lines (no live bars), e.g. for CI logs.
    """

    def __init__(self, enabled: bool = True):
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn, TransferSpeedColumn)

        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                                 console=self.console, transient=True,
                                 disable=not self.enabled)
        self.task: Any = None
        self.label = ""

    def __enter__(self) -> "LiveDisplay":
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def begin(self, label: str, total: int | None) -> None:
        self.label = label
        self.task = self.progress.add_task(label, total=total)

    def advance(self, done: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=done)

    def end(self, recs: list[dict[str, Any]] | None = None, note: str = "") -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
            self.task = None
        for r in recs or []:
            extra = ""
            if "ops_per_s" in r and not r["bytes"]:
                extra = f"{r['ops_per_s']:>10.0f} ops/s"
            elif "latency_p50_ms" in r:
                extra = f"p50 {r['latency_p50_ms']:.2f} ms p99 {r['latency_p99_ms']:.2f} ms"
            self.console.print(f"  {r['path']:<12} {r['workload']:<14} c={r['clients']} "
                               f"s={r['servers']} {r['gbps']:7.3f} GB/s {extra}", highlight=False)
        if note:
            self.console.print(f"  {self.label}: {note}", highlight=False)

    def log(self, text: str) -> None:
        self.console.print(text, highlight=False)


def print_summary(report: dict[str, Any], file: Any = None) -> None:
    """The summary table (rich), then skipped routes and errors with their reasons."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=140)
    t = Table(title="stripefs bench", show_lines=False)
    for col in ("workload", "path", "clients", "servers", "GB/s", "× floor_socket", "ops/s",
                "p50 ms", "p99 ms", "verified MiB"):
        t.add_column(col, justify="left" if col in ("workload", "path") else "right")
    order = sorted(report["results"], key=lambda r: (r["workload"], r["clients"], r["servers"],
                                                     -r["gbps"]))
    for r in order:
        t.add_row(r["workload"], r["path"], str(r["clients"]), str(r["servers"]),
                  f"{r['gbps']:.3f}" if r["bytes"] else "-",
                  (f"{r['vs_floor_socket']:.2f}" + (" INVALID" if "invalid" in r else ""))
                  if "vs_floor_socket" in r else "",
                  f"{r['ops_per_s']:.0f}" if "ops_per_s" in r else "",
                  f"{r['latency_p50_ms']:.3f}" if "latency_p50_ms" in r else "",
                  f"{r['latency_p99_ms']:.3f}" if "latency_p99_ms" in r else "",
                  f"{r.get('verified_bytes', 0) / 2**20:.0f}")
    console.print(t)
    for s in report["skipped"]:
        where = " ".join(f"{k}={s[k]}" for k in ("workload", "clients", "servers") if k in s)
        console.print(f"skipped {s['path']} {where}: {s['reason']}", highlight=False)
    for e in report["errors"]:
        console.print(f"[red]FAILED {e['path']} {e['workload']} c={e['clients']}: "
                      f"{e['error'].strip().splitlines()[-1]}", highlight=False)
    for bad in report.get("invalid", []):
        console.print(f"[red]INVALID {bad['reason']}", highlight=False)
    h = report.get("header", {})
    console.print(f"cold reads: {h.get('cold_reads', '?')}; validity: "
                  f"{h.get('validity', '?')}", highlight=False)


def write_json(report: dict[str, Any], path: str) -> None:
    """Write atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


RATIO_WORKLOADS = ["dataloader", "dataloader_batched", "small_writes", "small_writes_one_dir", "burst_interference", "seq_read", "seq_write",
                   "rand_read_64k", "rand_read_1m", "checkpoint", "restore_16", "restore_1000"]


def _ratio_bars(ax: Any, res: list[dict[str, Any]], key: str, title: str) -> None:
    """Grouped bars: one group per workload, one bar per route (first client/server count)."""
    seen: dict[tuple[str, str], float] = {}
    for r in res:
        if r["workload"] in RATIO_WORKLOADS and key in r and "invalid" not in r:
            seen.setdefault((r["workload"], r["path"]), r[key])
    workloads = [w for w in RATIO_WORKLOADS if any(k[0] == w for k in seen)]
    routes = sorted({k[1] for k in seen})
    width = 0.8 / max(len(routes), 1)
    for i, route in enumerate(routes):
        xs = [j + i * width for j, w in enumerate(workloads) if (w, route) in seen]
        ys = [seen[(w, route)] for w in workloads if (w, route) in seen]
        ax.bar(xs, ys, width, label=route)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=7)
    ax.set(title=title, ylabel="ratio")
    ax.grid(alpha=0.3, axis="y")
    if not workloads:
        ax.text(0.5, 0.5, "no records with this ratio in the run", ha="center",
                transform=ax.transAxes)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot(report: dict[str, Any], path: str) -> None:
    """Throughput vs clients (sequential read and write), latency CDFs, and the ratios of
    every seed workload to the socket floor, the best peer and the local disk."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    panels = [("seq_read", "sequential read (cold)"), ("seq_write", "sequential write (fsync)")]
    fig, grid = plt.subplots(2, 3, figsize=(17, 10))
    axes = grid[0]
    for ax, (workload, title) in zip(axes, panels):
        lines: dict[tuple[str, int], list[tuple[int, float]]] = {}
        for r in res:
            if r["workload"] == workload or (r["path"] == "floor_socket"):
                lines.setdefault((r["path"], r["servers"]), []).append((r["clients"], r["gbps"]))
        for (route, servers), pts in sorted(lines.items()):
            pts.sort()
            style = "--" if route.startswith("floor") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                    label=f"{route} ({servers} srv)")
        ax.set(title=title, xlabel="client processes", ylabel="GB/s")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax = axes[2]
    for r in res:
        q = r.get("latency_quantiles_ms")
        if q and r["workload"] in ("rand_read_4k", "rand_read_1m", "dataloader"):
            ys = [i / (len(q) - 1) for i in range(len(q))]
            ax.plot(q, ys, label=f"{r['path']} {r['workload']} c={r['clients']}")
    ax.set(title="read latency CDF (cold)", xlabel="ms (log)", ylabel="fraction of reads")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    _ratio_bars(grid[1][0], res, "vs_floor_socket", "× floor_socket (same run)")
    _ratio_bars(grid[1][1], res, "vs_best_peer", "× best peer (same run)")
    _ratio_bars(grid[1][2], res, "vs_local_disk", "× local_disk (same run)")
    m = report["header"].get("machine", {})
    fig.suptitle(f"stripefs bench — {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
                 f"{m.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
