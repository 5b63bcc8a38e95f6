"""``staging.save``: snapshot on the caller's thread, everything else in the background.

Phases (timed on the handle): ``snapshot`` (blocking: tensors copied into a
pooled host buffer), ``serialize`` (checksums, optional zstd, the manifest),
``local_write`` (files fsynced and renamed into the staging directory: the
checkpoint is *locally durable*), ``upload`` (streamed from memory — the snapshot buffer, or
the compressed bytes — while the local write runs, then from the local files)
and ``commit`` (manifest, atomic rename: *globally durable*). The snapshot
buffer goes back to the pool as soon as the checkpoint is locally durable. The
pool keeps two buffers (double buffering, ``_snapshot``), so the next save,
made while this one is still writing its local copy or uploading, snapshots
into the other buffer and waits for neither; only a save that finds both
buffers still held (two saves in flight) waits, for the older one's local write.

``keep_local=0`` skips the local copy: the whole upload streams from memory and
the buffer is held until the commit (the next save takes the other buffer; a
third one waits for the commit, or takes another buffer under ``snapshot_memory``);
the step is *locally* and *globally*
durable at once, at the commit, and a crash before it loses the step.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import crc32c
import numpy as np

from stripefs.fsclient import normpath

from ._format import (CHECK_CHUNK, DEFAULT_SHARD, FORMAT, MANIFEST, chunk_crcs, crc_combine, manifest_bytes,
                      plan_state_dict, step_order)
from ._durable import publish_dir
from ._journal import CkptRow, FileRow, Journal, fault_point
from . import _ranks
from ._mover import DIRECT_LOCAL, MoverOptions, SnapshotViews, Uploader, client_for, open_direct, remote_paths, remove_tree
from ._replicas import Durability
from ._service import Mover, apply_retention
from ._snapshot import POOL, snapshot, yield_to_snapshots

__all__ = ["save", "SaveHandle", "default_staging_dir", "release_buffers", "write_local_dir"]

log = logging.getLogger("stripefs.staging")


def release_buffers() -> int:
    """Give back the memory of the snapshot buffers no save is using; returns their bytes.

    Saves keep up to two buffers of the state's size pooled, warm, for the next save. A
    process done saving for a while (before an evaluation, or a load into fresh memory that
    would otherwise sit beside them) can return that memory; a save in flight keeps its own
    buffer, and the next save makes one again, paying for fresh memory once.
    """
    return POOL.clear()


def default_staging_dir() -> str:
    return os.environ.get("STRIPEFS_STAGING") or os.path.join(tempfile.gettempdir(), f"stripefs-staging-{os.getuid()}")


class SaveHandle:
    """Progress of one save: snapshotted → locally durable → globally durable, or an error.

    ``timings`` maps phase -> seconds and ``gbps`` phase -> GB/s once each phase ends.
    ``snapshot_wait_s`` is how long the save waited for a snapshot buffer to come free
    (part of ``timings["snapshot"]``; 0 unless two earlier saves still held theirs);
    ``extra_buffer`` is True when it took a buffer beyond the two of double buffering
    instead, because every buffer was busy and ``snapshot_memory`` allowed one.
    ``durability`` (a :class:`Durability`, once globally durable) says how many replicas the
    store had serving at the commit: ``durability.full`` is False when some chain had fewer than
    the cluster's replica count (the commit also logs a warning); None when the cluster could
    not say.
    """

    def __init__(self, url: str, ckpt_id: str, nbytes: int):
        self.url, self.id, self.nbytes = url, ckpt_id, nbytes
        self.timings: dict[str, float] = {}
        self.snapshot_wait_s = 0.0
        self.extra_buffer = False
        self.durability: Durability | None = None
        self._snap, self._local, self._global, self._done = (threading.Event() for _ in range(4))
        self._error: BaseException | None = None
        self._observed = False

    @property
    def snapshotted(self) -> bool:
        return self._snap.is_set()

    @property
    def locally_durable(self) -> bool:
        return self._local.is_set()

    @property
    def globally_durable(self) -> bool:
        return self._global.is_set()

    @property
    def error(self) -> BaseException | None:
        self._observed = True
        return self._error

    @property
    def gbps(self) -> dict[str, float]:
        return {k: self.nbytes / v / 1e9 for k, v in self.timings.items() if v > 0}

    def done(self) -> bool:
        """True once globally durable or failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None, *, durable: str = "global") -> bool:
        """Wait for ``durable`` ("local" or "global"); False on timeout.

        Raises:
            the save's error (OSError subclasses: ChecksumError, CheckpointConflict, ...).
        """
        target = {"local": self._local, "global": self._global}[durable]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not target.is_set():
            if self._error is not None:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._done.wait(0.05 if left is None else min(left, 0.05))
        if self._error is not None and not target.is_set():
            self._observed = True
            raise self._error
        return True

    result = wait

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        log.error("checkpoint %s failed: %s", self.url, exc)

    def __repr__(self) -> str:
        state = "failed" if self._error else "global" if self.globally_durable else "local" if self.locally_durable else "snapshot"
        return f"<SaveHandle {self.url} {state}>"


_handles: list[SaveHandle] = []
_movers: dict[str, threading.Event] = {}
_lock = threading.Lock()


def _raise_unobserved() -> None:
    """An error nobody looked at surfaces at the next save instead of vanishing."""
    with _lock:
        for h in list(_handles):
            if h.done():
                _handles.remove(h)
                if h._error is not None and not h._observed:
                    h._observed = True
                    raise h._error


def _ensure_background_mover(staging_dir: str, options: MoverOptions) -> None:
    with _lock:
        if staging_dir in _movers:
            return
        stop = _movers[staging_dir] = threading.Event()
    mover = Mover(staging_dir, options)
    threading.Thread(target=mover.run_forever, args=(stop, 30.0), daemon=True, name="stripefs-mover").start()


def _step_of(url: str, step: int | None) -> int | None:
    if step is not None:
        return step
    number = step_order(normpath(url))[0]
    return None if number < 0 else number


def save(state_dict: Any, url: str, *, staging_dir: str | None = None, compress: str | None = None,
         keep_local: int | None = 2, keep_remote: int | None = None, pin: bool = False, step: int | None = None,
         cluster: str | None = None, upload: bool = True, background_mover: bool = True,
         options: MoverOptions | None = None, shard_bytes: int = DEFAULT_SHARD,
         snapshot_timeout: float | None = 300.0, snapshot_memory: int | None = None, rank: int | None = None,
         world_size: int | None = None, save_id: str | None = None, rank_timeout: float = 600.0) -> SaveHandle:
    """Checkpoint ``state_dict`` to ``url`` (``stripefs://run/step-100``); blocks only for the snapshot.

    Args:
        state_dict: nested dicts/lists/tuples of tensors, numpy arrays and plain values.
        url: the final directory of this step in the file system; must not exist yet.
        staging_dir: local directory for staged copies and the journal.
        compress: None or "zstd" (per 4 MiB frame; pays off for sparse / low-entropy state).
        keep_local / keep_remote: committed steps of this series kept locally / remotely (None: all).
            ``keep_local=0`` writes nothing locally: the upload streams from the snapshot
            buffer, which this save holds until its commit. Until then the step exists only
            in this process's memory (journal state ``streaming``): a crash loses it, and the
            mover abandons it; ``latest()`` never names it.
        pin: never delete this step by retention.
        upload: False stages locally only (a standalone ``stripefs mover`` uploads it).
        background_mover: start an in-process mover thread that also resumes older leftovers.
        options: upload concurrency, bandwidth cap, retries.
        snapshot_timeout: when every snapshot buffer is busy (two earlier saves still hold
            theirs: writing their local copies, or streaming with ``keep_local=0``), wait at
            most this many seconds for one (None: no limit).
        snapshot_memory: bytes all snapshot buffers of the process may take together; when
            every buffer is busy and another fits under it, the save takes another buffer
            instead of waiting (the first buffer is always allowed: 0 keeps memory at one
            copy of the state, and a save then waits for the previous one's local write).
            None: at most two buffers (double buffering: a save never waits for the previous
            one's local write or upload; memory up to two copies of the state). The second is
            made, off the caller's thread, by a save made while an earlier one is still in
            flight (or else by the first save that finds the first buffer busy), then reused.
        rank, world_size: this process is rank ``rank`` of ``world_size`` ranks that each save
            their own keys of one step to the same ``url``: the step commits once, when every
            rank's files are in the store, with one manifest (see ``docs/checkpoint-format.md``).
            Each rank uploads its own files from its snapshot (no local copy is kept, so a crash
            before the commit loses the step: the resumed job saves it again); rank 0 commits,
            the other ranks' handles wait for its commit. If any rank fails, nothing commits and
            every rank's ``wait()`` raises :class:`CheckpointAborted` saying which and why.
        save_id: with ``world_size``, a string every rank of this save passes, unique to this
            save (e.g. job id, attempt and step): it names the checkpoint. None: the ranks agree
            on one through ``torch.distributed`` (one broadcast from rank 0 on the default
            group, on the calling thread; every rank must call ``save`` there).
        rank_timeout: how long rank 0 waits for the other ranks' files once its own are in
            the store, and (twice as long) each other rank for rank 0's verdict.

    Returns:
        a :class:`SaveHandle`; ``wait()`` raises the save's error. ``snapshot_wait_s`` and
        ``extra_buffer`` say whether the save waited for a buffer or took another one.

    Raises:
        ValueError: unknown ``compress``; ``keep_local=0`` with ``upload=False``; ``rank`` outside
            ``world_size``, or ``upload=False``, with ``world_size``; a URL of another
            scheme (``s3://``, ``file://``: ``stripefs://path`` or an absolute path). TypeError: a value that ``load`` could not give
            back (the message names its key).
        TimeoutError: no snapshot buffer within ``snapshot_timeout`` (nothing was saved).
        an unobserved error of an earlier save of this process.
    """
    if compress not in (None, "zstd"):
        raise ValueError(f"compress must be None or 'zstd', got {compress!r}")
    if keep_local == 0 and not upload:
        raise ValueError("keep_local=0 keeps no local copy, so it needs upload=True (nothing would be saved)")
    _raise_unobserved()
    staging_dir = os.path.abspath(staging_dir or default_staging_dir())
    try:
        journal = Journal(staging_dir)
    except sqlite3.Error as exc:  # typed, as every other failure of a save
        raise OSError(errno.EIO, f"staging journal in {staging_dir} cannot be opened: {exc}") from exc
    options = options or MoverOptions(cluster=cluster)
    cluster_spec = cluster or client_for(cluster).config.path
    final, _ = remote_paths(url, "x")  # the URL checked before any work
    ranks = _ranks_of(rank, world_size, save_id, upload, rank_timeout)
    if ranks is not None and type(state_dict) not in (dict, OrderedDict):
        raise TypeError(f"each rank of a save by several ranks saves a dict (the step's state is every rank's keys), "
                        f"not a {type(state_dict).__name__}")
    superseded = _supersede_leftovers(journal, final)
    t0 = time.monotonic()
    plan = plan_state_dict(state_dict, shard_bytes)
    buf = snapshot(plan, POOL, snapshot_timeout, snapshot_memory)
    h = SaveHandle(url, uuid.uuid4().hex if ranks is None else ranks.ckpt_id, plan.nbytes)
    h.timings["snapshot"] = time.monotonic() - t0
    h.snapshot_wait_s, h.extra_buffer = buf.wait_s, buf.extra
    h._snap.set()
    with _lock:
        in_flight = any(not other.done() for other in _handles)
        _handles.append(h)
    if in_flight:
        # An earlier save is still being written or uploaded: saves come close enough to
        # overlap, so the second buffer of double buffering is made now, off this thread,
        # rather than by the save that first finds this one's buffer busy.
        POOL.reserve_in_background(buf.used, snapshot_memory)
    # A rank other than 0 records its upload under an id of its own: ranks may share a journal.
    row_id = h.id if ranks is None or ranks.rank == 0 else uuid.uuid4().hex
    row = CkptRow(row_id, normpath(url), cluster_spec, journal.step_dir(row_id), "writing", _step_of(url, step), pin,
                  keep_local, keep_remote, time.time(), None, None, 0, "state_dict")
    if ranks is None:
        args: tuple[Any, ...] = (h, journal, row, plan, buf, compress, upload, options, superseded)
        threading.Thread(target=_background, args=args, daemon=True, name="stripefs-save").start()
    else:
        args = (h, journal, row, plan, buf, compress, options, superseded, ranks)
        threading.Thread(target=_background_rank, args=args, daemon=True, name="stripefs-save").start()
    if background_mover:
        _ensure_background_mover(staging_dir, options)
    return h


@dataclasses.dataclass(frozen=True)
class _Ranks:
    """This process's share of a save by several ranks."""

    rank: int
    world: int
    ckpt_id: str  # the checkpoint's id, the same on every rank
    timeout: float


def _ranks_of(rank: int | None, world: int | None, save_id: str | None, upload: bool,
              timeout: float) -> _Ranks | None:
    """None for a save by one process; else the ranks' shared checkpoint id (see ``save``)."""
    if world is None or (world == 1 and rank in (None, 0)):
        if rank not in (None, 0) or save_id is not None:
            raise ValueError("rank= and save_id= belong to a save by several ranks: pass world_size= too")
        return None
    if type(world) is not int or world < 1 or type(rank) is not int or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world_size): got rank={rank!r}, world_size={world!r}")
    if not upload:
        raise ValueError("a save by several ranks commits once every rank's files are in the store; "
                         "upload=False (a local copy for a standalone mover) is for one rank")
    if save_id is not None:
        return _Ranks(rank, world, hashlib.blake2b(save_id.encode(), digest_size=16).hexdigest(), timeout)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a save by several ranks needs save_id= (the same on every rank, unique to this save) "
                         "or an initialized torch.distributed to agree on one")
    if (dist.get_rank(), dist.get_world_size()) != (rank, world):
        raise ValueError(f"rank={rank}, world_size={world} but torch.distributed says rank {dist.get_rank()} "
                         f"of {dist.get_world_size()}")
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return _Ranks(rank, world, str(box[0]), timeout)


def _supersede_leftovers(journal: Journal, url: str) -> list[CkptRow]:
    """This save supersedes what an earlier save of the same step from this staging
    directory left behind, its writer dead before the upload was done (a run killed and
    resumed from an older step, saving this step again): the leftover is abandoned, so no
    mover commits it over (or before) this one. A leftover that a mover is uploading right
    now (its lock held) is left to the commit: the later save replaces the earlier one
    (``Uploader._replaces``). Checkpoints of other writers still conflict.

    Returns:
        the rows abandoned: the save's thread removes their partial uploads (no mover pass
        looks at an abandoned row again), off the caller's thread, which must not wait for
        the store.
    """
    out = []
    for row in journal.checkpoints("WHERE url=? AND state IN ('writing','streaming','staged')", (url,)):
        lock = journal.lock(row.id)
        if not lock.try_acquire():
            continue  # its writer lives, or a mover uploads it
        try:
            journal.set_state(row.id, "abandoned", "superseded by a later save of the same step")
            shutil.rmtree(row.local_dir, ignore_errors=True)
            out.append(row)
        finally:
            lock.release()
    return out


def _background(h: SaveHandle, journal: Journal, row: CkptRow, plan: Any, buf: Any, compress: str | None,
                upload: bool, options: MoverOptions, superseded: list[CkptRow]) -> None:
    lock = journal.lock(row.id)
    lent: SnapshotViews | None = None
    held = [True]

    def release() -> None:
        """Give the snapshot buffer back, once; never while a piece in flight still reads it."""
        if held[0]:
            held[0] = False
            if lent is not None:
                lent.revoke()
            POOL.release(buf)

    try:
        # Inside the try: a lock file that cannot be made (no inodes, no space, EMFILE) fails
        # this save's handle instead of killing the thread and leaving wait() to hang.
        lock.try_acquire()  # a fresh id: nobody else can hold it
        streaming = row.keep_local == 0
        if streaming and compress is None:
            _stream_raw(h, journal, row, plan, buf, options)
        else:
            t = time.monotonic()
            stored, records, raw_manifest = _serialize(plan, buf, compress, row)
            row.state = "streaming" if streaming else "writing"
            journal.begin(row, [FileRow(r["name"], r["size"], r["crc32c"], r["chunk"], r["chunk_crc32c"], 0)
                                for r in records])
            h.timings["serialize"] = time.monotonic() - t
            fault_point("after_begin")
            # The upload streams from memory (the snapshot, or the compressed bytes) from the start.
            lent = SnapshotViews(stored) if upload else None
            if streaming:
                failed = _stream(h, journal, row, options, lent, lambda: raw_manifest)  # type: ignore[arg-type]
                if failed is not None:
                    raise failed
            else:
                _write_and_upload(h, journal, row, options, lent, records, stored, raw_manifest, release)
        # Best effort, once this save's own work is done (so an unreachable store does not delay
        # it) and before wait() returns: what the superseded leftovers had uploaded.
        _remove_partials(options, superseded)
        if upload:
            # Retention first: when wait() returns, older steps are already trimmed.
            apply_retention(journal, journal.get(row.id) or row, options)
            if streaming:
                h._local.set()  # no local copy: the step is safe from a crash once committed
            h._global.set()
    except sqlite3.Error as exc:  # the journal (disk full, I/O error): typed as the docs promise
        h._fail(OSError(errno.EIO, f"staging journal {journal.path} failed: {exc}"))
    except BaseException as exc:
        h._fail(exc)
    finally:
        release()
        lock.release()  # before done(): a mover started after done() can take the checkpoint
        if h._error is not None:
            _remove_partials(options, superseded)
        h._done.set()


def _background_rank(h: SaveHandle, journal: Journal, row: CkptRow, plan: Any, buf: Any, compress: str | None,
                     options: MoverOptions, superseded: list[CkptRow], ranks: _Ranks) -> None:
    """One rank's save of a save by several ranks (``_ranks``): its files into the checkpoint's
    partial directory straight from the snapshot, then its part record; rank 0 then gathers
    every rank's part and commits, the others wait for its verdict."""
    lock = journal.lock(row.id)
    prefix = f"rank{ranks.rank:05d}-"
    _, partial = remote_paths(row.url, ranks.ckpt_id)
    client = None
    committed = False
    failure: BaseException | None = None
    held = [True]

    def release() -> None:
        if held[0]:
            held[0] = False
            POOL.release(buf)

    try:
        lock.try_acquire()  # a fresh id: nobody else can hold it
        client = client_for(options.cluster or row.cluster)
        t = time.monotonic()
        stored, records, man = _serialize_dict(plan, buf, compress, row, prefix)
        # "streaming": nothing local to resume from; a mover only ever abandons such a row.
        row.state = "streaming"
        journal.begin(row, [FileRow(r["name"], r["size"], r["crc32c"], r["chunk"], r["chunk_crc32c"], 0)
                            for r in records])
        h.timings["serialize"] = time.monotonic() - t
        fault_point("after_begin")
        part = {"files": records, "tensors": man["tensors"], "tree": man["tree"], "version": man["version"]}
        lent = SnapshotViews(stored)
        t = time.monotonic()
        try:
            Uploader(journal, row, options, buffers=lent, partial_id=ranks.ckpt_id,
                     finish=lambda c, _final, p: _ranks.write_part(c, p, ranks.rank, part)).run()
        finally:
            lent.revoke()
            release()  # this rank's files are in the store (or failed): the next save may snapshot
        h.timings["upload"] = time.monotonic() - t
        if ranks.rank == 0:
            parts = _ranks.gather(client, partial, ranks.world, row.url, ranks.timeout)
            raw = _ranks.merge_state_dicts(parts, {"id": ranks.ckpt_id, "step": row.step, "created": row.created,
                                                   "url": row.url})
            h.durability = _ranks.commit(journal, row, options, client, partial, ranks.world, raw)
            committed = True
            apply_retention(journal, journal.get(row.id) or row, options)
        else:
            h.durability = _ranks.wait_commit(client, row.url, ranks.ckpt_id, 2 * ranks.timeout)
            committed = True
        _remove_partials(options, superseded)
        h.timings["commit"] = time.monotonic() - t - h.timings["upload"]
    except sqlite3.Error as exc:
        failure = OSError(errno.EIO, f"staging journal {journal.path} failed: {exc}")
    except BaseException as exc:
        failure = exc
    finally:
        release()
        if failure is not None and client is not None and not committed:
            _ranks.report_failure(client, partial, ranks.rank, failure)
            _ranks.remove_files(client, partial, lambda name: name.startswith(prefix))
        try:
            # Rank 0's row stays: committed (retention counts it), or failed (a mover pass removes
            # the partial directory, the verdict with it); the other ranks keep none.
            if ranks.rank != 0:
                journal.delete(row.id)
            elif not committed and failure is not None:
                journal.set_state(row.id, "failed", f"{type(failure).__name__}: {failure}")
        except sqlite3.Error:
            pass
        lock.release()
        # Only now: once wait() returns or raises, the journal and the store say the same.
        if failure is not None:
            h._fail(failure)
        elif committed:
            h._local.set()
            h._global.set()
        h._done.set()


def _serialize(plan: Any, buf: Any, compress: str | None, row: CkptRow) -> tuple[list[memoryview], list[dict[str, Any]], bytes]:
    """Checksums (per tensor, per checksum chunk), optional zstd and the manifest.

    Returns:
        ``(stored bytes per file, file records, manifest bytes)``; raw files are views of
        the snapshot buffer, nothing is copied.
    """
    stored, records, manifest = _serialize_dict(plan, buf, compress, row)
    return stored, records, manifest_bytes(manifest)


def _serialize_dict(plan: Any, buf: Any, compress: str | None, row: CkptRow,
                    prefix: str = "") -> tuple[list[memoryview], list[dict[str, Any]], dict[str, Any]]:
    """:func:`_serialize`, the manifest as a dict; file names start with ``prefix``."""
    views = _file_views(plan, buf)
    # Files are checksummed (or compressed) on another thread while this one checksums the
    # tensors: crc32c releases the GIL, so the two passes take both cores.
    with ThreadPoolExecutor(1) as pool:
        encoded = pool.submit(lambda: [_encode_file(v, compress) for v in views])
        for e in plan.tensors:
            if e.base is not None:
                continue  # a view: its bytes are those of the storage entry it names
            base = buf.file_offsets[e.file] + e.offset
            e.crc = _yielding_crc(buf.view[base : base + e.nbytes])
        stored, records = [], []
        for i, (data, rec) in enumerate(encoded.result()):
            rec["name"] = prefix + _file_name(i)
            stored.append(data)
            records.append(rec)
    manifest = {"format": FORMAT, "version": plan.version, "id": row.id, "kind": "state_dict", "step": row.step,
                "created": row.created, "url": row.url, "files": records,
                "tensors": [e.index_record() for e in plan.tensors], "tree": plan.tree}
    return stored, records, manifest


def _file_views(plan: Any, buf: Any) -> list[memoryview]:
    """Each data file's bytes: a slice of the snapshot buffer, laid out as the file is."""
    return [buf.view[o : o + s] for o, s in zip(buf.file_offsets, plan.file_sizes)]


def _file_name(i: int) -> str:
    return f"data-{i:05d}.bin"


def _stream_raw(h: SaveHandle, journal: Journal, row: CkptRow, plan: Any, buf: Any, options: MoverOptions) -> None:
    """``keep_local=0``, uncompressed: the upload starts at once and the checksums and the
    manifest are computed while it runs (the commit waits for the manifest).

    The journal records the files' sizes only: nothing but this process can resume a
    streaming save, and the CRC32Cs reach the store in the manifest.
    """
    views = _file_views(plan, buf)
    row.state = "streaming"
    journal.begin(row, [FileRow(_file_name(i), len(v), 0, CHECK_CHUNK, [], 0) for i, v in enumerate(views)])
    fault_point("after_begin")
    serialized: Future = Future()
    box: dict[str, BaseException | None] = {}

    def upload() -> None:
        box["error"] = _stream(h, journal, row, options, SnapshotViews(views), lambda: serialized.result()[2])

    uploader = threading.Thread(target=upload, daemon=True, name="stripefs-upload")
    uploader.start()
    t = time.monotonic()
    try:
        serialized.set_result(_serialize(plan, buf, None, row))
    except BaseException as exc:
        serialized.set_exception(exc)  # the commit raises it: nothing is committed without a manifest
    h.timings["serialize"] = time.monotonic() - t
    uploader.join()
    if box.get("error") is not None:
        raise box["error"]  # type: ignore[misc]


def _stream(h: SaveHandle, journal: Journal, row: CkptRow, options: MoverOptions, lent: SnapshotViews,
            manifest: Callable[[], bytes]) -> BaseException | None:
    """``keep_local=0``: upload straight from memory and commit; nothing is written locally.

    The journal row stays ``streaming`` until the commit: retries within this process resume
    from the journaled offsets (the bytes are still in memory), but a crash of the process
    before the commit loses the step — the mover then abandons it (see ``Mover``).

    Returns:
        None once committed, else the upload's error: the row is then ``failed`` and its partial
        upload removed (no copy is left to resume from once this process lets go of the snapshot).
    """
    log.info("checkpoint %s: keep_local=0, streaming from memory; a crash of this process before the commit "
             "loses this step", row.url)
    box: dict[str, Any] = {}
    try:
        _upload(h, journal, row, options, lent, None, box, manifest)
    finally:
        lent.revoke()  # the pieces in flight are settled: the buffer may go back to the pool
    if "error" in box:
        exc = box["error"]
        journal.set_state(row.id, "failed", f"keep_local=0 upload failed, no local copy to resume from: "
                                            f"{type(exc).__name__}: {exc}")
        _remove_partial(options, row)
        return exc
    return None


def _write_and_upload(h: SaveHandle, journal: Journal, row: CkptRow, options: MoverOptions,
                      lent: SnapshotViews | None, records: list[dict[str, Any]], stored: list[memoryview],
                      raw_manifest: bytes, release: Callable[[], None]) -> None:
    """Write the local copy while the upload streams from memory; the buffer goes back to the
    pool as soon as the local copy is durable (the upload then goes on from the staged files)."""
    local_ok = threading.Event()
    up_thread = None
    up_box: dict[str, Any] = {}
    if lent is not None:
        up_thread = threading.Thread(target=_upload, args=(h, journal, row, options, lent, local_ok, up_box),
                                     daemon=True)
        up_thread.start()
    t = time.monotonic()
    try:
        write_local_dir(row.local_dir, [(r["name"], d) for r, d in zip(records, stored)], raw_manifest)
    except BaseException:
        journal.set_state(row.id, "failed", "local staging failed")
        local_ok.set()
        if up_thread is not None:
            up_thread.join()
        raise
    journal.set_state(row.id, "staged")
    fault_point("after_local")
    h.timings["local_write"] = time.monotonic() - t
    h._local.set()
    local_ok.set()
    # A durable local copy exists: the upload goes on from it, and the buffer is free for
    # the next save as soon as the pieces in flight from it are acknowledged.
    release()
    if up_thread is not None:
        up_thread.join()
    if "error" in up_box:
        raise up_box["error"]


def _remove_partials(options: MoverOptions, rows: list[CkptRow]) -> None:
    while rows:
        _remove_partial(options, rows.pop())


def _remove_partial(options: MoverOptions, row: CkptRow) -> None:
    try:
        remove_tree(client_for(options.cluster or row.cluster), remote_paths(row.url, row.id)[1])
    except OSError:
        pass


def _upload(h: SaveHandle, journal: Journal, row: CkptRow, options: MoverOptions, views: SnapshotViews | None,
            local_ok: threading.Event | None, box: dict[str, Any],
            manifest: Callable[[], bytes] | None = None) -> None:
    def wait_local() -> None:
        local_ok.wait()  # type: ignore[union-attr]
        if not h.locally_durable:
            raise RuntimeError("local staging failed; not committing")

    t = time.monotonic()
    try:
        up = Uploader(journal, row, options, buffers=views, manifest=manifest)
        up.run(wait_local if local_ok else None)
        h.durability = up.durability
        h.timings["upload"] = time.monotonic() - t
    except BaseException as exc:
        box["error"] = exc
        from ._format import CheckpointConflict, ChecksumError

        if local_ok is None:
            return  # streaming: the caller fails the row
        if isinstance(exc, (CheckpointConflict, ChecksumError, RuntimeError)):
            journal.set_state(row.id, "failed", f"{type(exc).__name__}: {exc}")
            _remove_partial(options, row)
        else:
            journal.note_error(row.id, f"{type(exc).__name__}: {exc}")


def _encode_file(view: memoryview, compress: str | None) -> tuple[Any, dict[str, Any]]:
    if compress is None:
        total, crcs = _yielding_chunk_crcs(view)
        return view, {"size": len(view), "crc32c": total, "chunk": CHECK_CHUNK, "chunk_crc32c": crcs, "encoding": "raw"}
    import zstandard

    def one(off: int) -> tuple[bytes, list[int]]:
        piece = view[off : off + CHECK_CHUNK]
        return zstandard.ZstdCompressor(level=1).compress(piece), [len(piece), 0, crc32c.crc32c(piece)]

    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(one, range(0, len(view), CHECK_CHUNK)))
    data = b"".join(p for p, _ in parts)
    frames = [[raw, len(p), crc] for p, (raw, _, crc) in parts]
    total, crcs = chunk_crcs(memoryview(data), CHECK_CHUNK)
    return memoryview(data), {"size": len(data), "crc32c": total, "chunk": CHECK_CHUNK, "chunk_crc32c": crcs,
                              "encoding": "zstd", "raw_size": len(view), "frames": frames}


_YIELD_SPAN = 8 * CHECK_CHUNK  # checksummed between two looks at a later save's snapshot (a few ms)


def _yielding_crc(view: memoryview) -> int:
    """CRC32C of ``view``, in spans, yielding to any snapshot being copied between spans: a
    later save's copy, its caller blocked, goes first (:func:`yield_to_snapshots`)."""
    crc = 0
    for off in range(0, len(view), _YIELD_SPAN):
        yield_to_snapshots()
        crc = crc32c.crc32c(view[off : off + _YIELD_SPAN], crc)
    return crc


def _yielding_chunk_crcs(view: memoryview) -> tuple[int, list[int]]:
    """:func:`chunk_crcs` of ``view``, in spans of whole chunks, yielding to any snapshot being
    copied between spans (:func:`yield_to_snapshots`): the same CRCs, combined."""
    total, crcs = 0, []
    for off in range(0, len(view), _YIELD_SPAN):
        yield_to_snapshots()
        part = view[off : off + _YIELD_SPAN]
        crc, more = chunk_crcs(part, CHECK_CHUNK)
        total = crc_combine(total, crc, len(part)) if off else crc
        crcs += more
    return total, crcs


# The local copy's whole 4 KiB blocks are written with O_DIRECT when its bytes sit in the
# page-aligned snapshot buffer: by DMA, not copied into the page cache and written back from
# there, which cost 0.8-2.7 s of kernel CPU per GiB on a virtual machine (direct: 0.03 s;
# local durability 1.4-3.3 s -> 0.6 s) and pushed a dataloader's cached pages out.
# ``STRIPEFS_DIRECT_IO=0`` (staging._mover.DIRECT_LOCAL): never.
DIRECT_ALIGN = 4096
DIRECT_MIN = 1 << 20  # smaller files go through the page cache
_WRITE_STEP = 256 << 20  # bytes per write(2) of the local copy


def _address(view: memoryview) -> int:
    """Where ``view``'s bytes start in memory (read-only views too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _write_direct(path: str, view: memoryview) -> int:
    """Write the whole 4 KiB blocks at the start of ``view`` into the new file ``path`` with
    ``O_DIRECT``; how many bytes (0: not aligned, too small, or a file system without direct
    I/O, such as tmpfs). The caller writes the rest through the page cache and fsyncs both."""
    n = len(view) - len(view) % DIRECT_ALIGN
    if not DIRECT_LOCAL or n < DIRECT_MIN or _address(view) % DIRECT_ALIGN:
        return 0
    dfd = open_direct(path, os.O_WRONLY)
    if dfd is None:
        return 0
    done = 0
    try:
        while done < n:
            try:
                done += os.pwrite(dfd, view[done : min(n, done + _WRITE_STEP)], done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # refused (EINVAL): the page cache takes the rest
                    raise
                break
            fault_point("local_write")
    finally:
        os.close(dfd)
    return done - done % DIRECT_ALIGN  # a short write's odd tail is written again, buffered


def write_local_dir(final: str, files: list[tuple[str, Any]], manifest: bytes) -> None:
    """Write files + manifest into ``.tmp-<name>``, fsync everything, rename to ``final`` durably.

    Raises:
        OSError: e.g. ENOSPC; the temporary directory is removed.
    """
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, ".tmp-" + name)
    os.makedirs(tmp, exist_ok=True)
    try:
        for fname, data in files + [(MANIFEST, memoryview(manifest))]:
            path = os.path.join(tmp, fname)
            # 0666: the umask decides, as for any file the trainer writes.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                view = memoryview(data).cast("B")
                off = _write_direct(path, view)
                while off < len(view):
                    off += os.pwrite(fd, view[off : off + _WRITE_STEP], off)
                    fault_point("local_write")
                os.fsync(fd)
            finally:
                os.close(fd)
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
