"""``cat_ranges`` for ``stripefs://``: many ranges of many files, all in flight at once.

What dataloaders and torch DCP loads ask for: thousands of small ranges over
a few files. Done one by one, every range pays a metadata round trip and a
storage round trip in turn. Here instead:

1. the distinct files are resolved together (``Client.stat_many``: from the attribute
   cache, a directory's leased listing when several of its files are asked, else 200
   per ``StatMany`` round trip);
2. the ranges of one file are sorted and those closer than ``max_gap`` are
   merged into one read (never longer than ``max_span``);
3. the merged reads run on a pool of threads, each a native
   ``ClientCore.read_into`` that itself sends one request per chunk to the
   chunk's server; so requests to every server are in flight together, and the
   client's retry on a restarted server applies to each of them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from stripefs.wire import Attr, ErrorCode, StripefsError

from ..core import fill_bytes

if TYPE_CHECKING:
    from ..core import Client

__all__ = ["read_ranges"]


def clamp(start: int | None, end: int | None, size: int) -> tuple[int, int]:
    """fsspec range semantics: None = file start/end, negative = from the end; clipped to the file."""
    s = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
    e = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
    return s, max(s, e)


def _merge(ranges: list[tuple[int, int, int]], max_gap: int, max_span: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Group sorted ``(start, end, index)`` ranges into spans ``(start, end, members)``."""
    spans: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    for s, e, i in sorted(ranges):
        if spans:
            ss, se, members = spans[-1]
            if s <= se + max_gap and max(se, e) - ss <= max_span:
                spans[-1] = (ss, max(se, e), members + [(s, e, i)])
                continue
        spans.append((s, e, [(s, e, i)]))
    return spans


def read_ranges(client: "Client", paths: list[str], starts: list[Any], ends: list[Any], *,
                max_gap: int, max_span: int, max_workers: int) -> list[Any]:
    """Bytes of ``[starts[i], ends[i])`` of ``paths[i]``, or the exception that range met.

    Args:
        client: the native client.
        paths: absolute paths inside the file system.
        starts, ends: fsspec semantics (None, negative from the end), clipped to the file.
        max_gap: merge ranges of one file separated by at most this many bytes.
        max_span: upper bound of a merged read.
        max_workers: merged reads in flight at once (each sends one request per chunk).

    Returns:
        One entry per range, in input order: ``bytes`` or an ``OSError``.
    """
    out: list[Any] = [None] * len(paths)
    unique = list(dict.fromkeys(paths))
    workers = max(1, min(max_workers, len(paths)))
    with ThreadPoolExecutor(workers, thread_name_prefix="stripefs-ranges") as pool:
        try:
            found: list[Any] = client.stat_many(unique)
        except OSError as exc:  # every range fails with it, as a Resolve each would have
            # (but a path stat_many refuses before asking anything: each path on its own)
            invalid = isinstance(exc, StripefsError) and exc.code == ErrorCode.INVALID
            found = [_stat(client, p) for p in unique] if invalid else [exc] * len(unique)
        attrs = {p: _file_attr(p, attr) for p, attr in zip(unique, found)}
        by_file: dict[str, list[tuple[int, int, int]]] = {}
        for i, (p, start, end) in enumerate(zip(paths, starts, ends)):
            attr = attrs[p]
            if isinstance(attr, BaseException):
                out[i] = attr
                continue
            s, e = clamp(start, end, attr.size)
            if s == e:
                out[i] = b""
            else:
                by_file.setdefault(p, []).append((s, e, i))
        jobs = [(attrs[p], span) for p, ranges in by_file.items() for span in _merge(ranges, max_gap, max_span)]
        # Largest reads first so a long merged read does not start last and trail the rest.
        jobs.sort(key=lambda job: job[1][0] - job[1][1])
        for (attr, (s, e, members)), result in zip(jobs, pool.map(lambda job: _read_span(client, *job), jobs)):
            for ms, me, i in members:
                out[i] = result if isinstance(result, BaseException) else (
                    result if (ms, me) == (s, e) else bytes(memoryview(result)[ms - s : me - s]))
    return out


def _stat(client: "Client", path: str) -> "Attr | OSError":
    try:
        return client.stat(path)
    except OSError as exc:
        return exc


def _file_attr(path: str, attr: "Attr | OSError") -> "Attr | OSError":
    if isinstance(attr, OSError):
        return attr
    if attr.layout is None:
        return StripefsError(ErrorCode.IS_DIR, "is a directory", path)
    return attr


def _read_span(client: "Client", attr: Attr, span: tuple[int, int, list[tuple[int, int, int]]]) -> "bytes | OSError":
    s, e, _members = span
    assert attr.layout is not None
    try:
        return fill_bytes(e - s, lambda view, pos: client.read_into(attr.ino, attr.layout, attr.size, s + pos, view))
    except OSError as exc:
        return exc
