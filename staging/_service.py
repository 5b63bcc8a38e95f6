"""The mover as a service: recovery after crashes, uploads of leftovers, retention.

One pass (:meth:`Mover.run_once`) does, for every checkpoint of the journal
whose lock it can take:

* ``writing`` with a free lock — its writer died before the local copy was
  durable: remove the local and remote remains, mark it ``abandoned``;
* ``streaming`` with a free lock — a ``keep_local=0`` save whose trainer died
  before the commit: its bytes were only in that process's memory, so the step
  is lost; remove the partial upload and mark it ``abandoned`` (or
  ``committed``, when the trainer died between the rename and the journal
  update);
* ``staged`` — upload from the last durable offset and commit;
* ``failed`` (on an earlier pass) — remove what is left of it, the remote partial
  directory and the local copy (best effort); the row stays, with its error. A pass
  reports such a row as ``cleaned``: only this pass's failures count as failures.

Then retention: per series (the parent directory of the URL), keep the newest
``keep_local`` committed steps on local disk and the newest ``keep_remote`` in
the store, plus pinned ones; newest by step number (as ``latest()`` ranks them),
and a step is deleted only if the checkpoint at its URL is the one its row
recorded. Retention runs only after a commit and only counts committed steps,
so no step is deleted before a newer one is globally durable.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import threading
import time
from typing import Callable

from stripefs.fsclient import normpath

from ._format import CheckpointConflict, CheckpointSuperseded, ChecksumError, step_order
from ._journal import CkptRow, Journal
from ._mover import MoverOptions, Uploader, client_for, committed_id, remote_paths, remove_tree

__all__ = ["Mover", "apply_retention", "series_of"]

log = logging.getLogger("stripefs.staging")


def series_of(url: str) -> str:
    return posixpath.dirname(normpath(url))


def _rm_local(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))
    shutil.rmtree(tmp, ignore_errors=True)


def apply_retention(journal: Journal, row: CkptRow, options: MoverOptions) -> None:
    """Trim older committed steps of ``row``'s series to its keep_local/keep_remote.

    Steps rank as ``latest()`` ranks them (:func:`step_order`: the step number in the
    directory's name), never by when they committed: an older step whose slow upload
    commits last does not push a newer one out. A row stands for the checkpoint it recorded
    only while that checkpoint is the one at its URL: a URL saved again after a rollback
    leaves the older row stale, and a stale row takes no keep slot and is forgotten without
    touching what is at the URL now (remote deletions check the checkpoint id there first).
    The newest step is never deleted, whatever ``keep_remote`` says.
    """
    series = series_of(row.url)
    same = [r for r in journal.checkpoints("WHERE state='committed'") if series_of(r.url) == series]
    same.sort(key=lambda r: (step_order(r.url), r.committed or 0, r.created), reverse=True)
    current: list[CkptRow] = []
    for r in same:  # the same URL twice: only the last commit there can still be at it
        (_forget(journal, r) if any(c.url == r.url and (c.committed or 0) > (r.committed or 0) for c in same)
         else current.append(r))
    if row.keep_remote is not None:
        current = _still_there(journal, current, options)
        for r in current[max(1, row.keep_remote):]:
            if r.pinned:
                continue
            client = client_for(options.cluster or r.cluster)
            final, _ = remote_paths(r.url, r.id)
            try:
                if committed_id(client, final) == r.id:
                    remove_tree(client, final)
            except OSError as exc:  # retention is best effort; the next commit tries again
                log.warning("retention: could not remove %s: %s", final, exc)
                continue
            _forget(journal, r)
        current = [r for r in current if journal.get(r.id) is not None]
    if row.keep_local is not None:
        if row.keep_remote is None:  # not checked above: only the rows the local slots need
            current = _still_there(journal, current, options, enough=row.keep_local)
        for r in current[row.keep_local:]:
            if not r.pinned and os.path.isdir(r.local_dir):
                _rm_local(r.local_dir)


def _still_there(journal: Journal, rows: list[CkptRow], options: MoverOptions,
                 enough: int | None = None) -> list[CkptRow]:
    """The rows whose checkpoint is still the one at their URL; the others (their step was
    deleted, or saved again by another run) are forgotten. Unreachable store: all are kept.
    ``enough``: once that many rows are found there, the rest are kept unchecked."""
    kept: list[CkptRow] = []
    for i, r in enumerate(rows):
        if enough is not None and len(kept) >= enough:
            return kept + rows[i:]
        try:
            there = committed_id(client_for(options.cluster or r.cluster), normpath(r.url))
        except OSError as exc:
            log.warning("retention: could not check %s: %s", r.url, exc)
            return rows
        if there == r.id:
            kept.append(r)
        else:
            _forget(journal, r)
    return kept


def _forget(journal: Journal, row: CkptRow) -> None:
    """Drop a row (and its local copy) whose checkpoint is no longer at its URL, or was trimmed."""
    _rm_local(row.local_dir)
    journal.delete(row.id)


class Mover:
    """Uploads every staged checkpoint of a staging directory.

    Args:
        staging_dir: the directory ``staging.save`` writes to.
        options: concurrency, bandwidth cap, retries, cluster override.
        on_progress: called with ``(row, bytes)`` after each uploaded piece.
    """

    def __init__(self, staging_dir: str, options: MoverOptions | None = None,
                 on_progress: Callable[[CkptRow, int], None] | None = None):
        self.journal = Journal(staging_dir)
        self.options = options or MoverOptions()
        self.on_progress = on_progress
        self.uploaded = 0

    def run_once(self) -> dict[str, str]:
        """One recovery + upload pass; returns ``{checkpoint id: final state}`` of what it touched."""
        out: dict[str, str] = {}
        for row in self.journal.checkpoints("WHERE state IN ('writing','streaming','staged','failed')"):
            lock = self.journal.lock(row.id)
            if not lock.try_acquire():
                continue  # its writer (or another mover) is on it
            try:
                row = self.journal.get(row.id) or row  # re-read under the lock
                out[row.id] = self._handle(row)
            finally:
                lock.release()
        self._sweep_orphans()
        return out

    def _handle(self, row: CkptRow) -> str:
        if row.state == "streaming":
            return self._lost_stream(row)
        if row.state == "writing":
            log.warning("checkpoint %s: writer died before it was locally durable; removing remains", row.url)
            self._remove_partial(row)
            _rm_local(row.local_dir)
            self.journal.set_state(row.id, "abandoned", "writer died before the local copy was durable")
            return "abandoned"
        if row.state == "failed":  # failed on an earlier pass: what is left of it goes, the row stays to tell why
            self._remove_partial(row)
            _rm_local(row.local_dir)
            return "cleaned"
        if not os.path.isdir(row.local_dir):
            self.journal.set_state(row.id, "failed", "local staged copy is missing")
            return "failed"
        up = Uploader(self.journal, row, self.options,
                      on_progress=(lambda n: self.on_progress(row, n)) if self.on_progress else None)
        t0 = time.monotonic()
        try:
            up.run()
        except CheckpointSuperseded as exc:  # the resumed run saved this step again: its copy stands
            log.info("checkpoint %s: %s", row.url, exc)
            self.journal.set_state(row.id, "abandoned", str(exc))
            self._remove_partial(row)
            _rm_local(row.local_dir)
            return "abandoned"
        except (ChecksumError, CheckpointConflict) as exc:
            # For good: its staged bytes are corrupt, or another writer's step holds the URL.
            log.error("checkpoint %s failed: %s", row.url, exc)
            self.journal.set_state(row.id, "failed", f"{type(exc).__name__}: {exc}")
            self._remove_partial(row)
            _rm_local(row.local_dir)
            return "failed"
        except OSError as exc:
            log.error("checkpoint %s: upload failed, will retry on the next pass: %s", row.url, exc)
            self.journal.note_error(row.id, f"{type(exc).__name__}: {exc}")
            return "staged"
        finally:
            self.uploaded += up.uploaded
        dt = time.monotonic() - t0
        log.info("checkpoint %s committed: %.1f MB uploaded in %.2fs", row.url, up.uploaded / 1e6, dt)
        apply_retention(self.journal, row, self.options)
        return "committed"

    def _lost_stream(self, row: CkptRow) -> str:
        client = client_for(self.options.cluster or row.cluster)
        final, _ = remote_paths(row.url, row.id)
        if committed_id(client, final) == row.id:  # died after the rename, before the journal said so
            self.journal.set_state(row.id, "committed")
            apply_retention(self.journal, row, self.options)
            return "committed"
        reason = "keep_local=0: the trainer died before the commit; the step was only in its memory and is lost"
        log.warning("checkpoint %s: %s", row.url, reason)
        self._remove_partial(row)
        self.journal.set_state(row.id, "abandoned", reason)
        return "abandoned"

    def _remove_partial(self, row: CkptRow) -> None:
        try:
            remove_tree(client_for(self.options.cluster or row.cluster), remote_paths(row.url, row.id)[1])
        except OSError as exc:
            log.warning("could not remove partial upload of %s: %s", row.url, exc)

    def _sweep_orphans(self) -> None:
        """Local ``.tmp-*`` directories whose checkpoint is no longer being written."""
        steps = os.path.join(self.journal.dir, "steps")
        for name in os.listdir(steps):
            if not name.startswith(".tmp-"):
                continue
            row = self.journal.get(name[5:])
            if row is not None and row.state == "writing":
                continue  # locked by a live writer (otherwise run_once abandoned it)
            shutil.rmtree(os.path.join(steps, name), ignore_errors=True)

    def run_forever(self, stop: threading.Event, interval: float = 5.0) -> None:
        """Pass after pass until ``stop`` is set."""
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:  # keep the service alive; each failure is already logged
                log.exception("mover pass failed")
            stop.wait(interval)
