"""torch.distributed.checkpoint bridge: DCP writes through local staging and the mover.

``StagedStorageWriter`` is torch's ``FileSystemWriter`` pointed at a private
directory of the staging area; in ``finish`` it checksums every file DCP
wrote, records them in the journal, makes the copy locally durable and hands
it to the same uploader as :func:`staging.save` (atomic rename, manifest
last). ``dcp.async_save`` uses its ``stage`` (torch's ``BlockingAsyncStager``
with ``cache_staged_state_dict=True``: the CPU copy is made into buffers that
are reused by every later save). ``StagedStorageReader`` lets torch's
``FileSystemReader`` read the files where they lie — the local staged copy when
there is one, else the store — through :mod:`._checked`, which checks every
checksum chunk against the manifest as it is first read.

A save by several ranks (a process group of more than one) is one checkpoint:

1. the coordinator's ``prepare_global_plan`` names it: every rank's plan carries the
   coordinator's checkpoint id, the URL and the number of ranks (:class:`_RankPart`);
2. in ``write_data`` every rank writes its own files locally (DCP's ``__<rank>_<n>.distcp``),
   uploads them into the checkpoint's hidden partial directory
   (``.<name>.partial-<id>``, the one :func:`staging.save` uses), checks each in the store
   (committed size and CRC32Cs) and then writes its part record ``.rank-<r>.json``, last
   (``_ranks``: the mechanism a ``staging.save`` by several ranks commits with too);
3. torch gathers every rank's write results to the coordinator, and calls ``finish`` there
   only if every rank's ``write_data`` returned; a rank that failed, or died, fails every
   rank's ``dcp.save`` (torch's ``CheckpointException``) and nothing commits;
4. ``finish`` reads every rank's part record, checks that together they hold every file the
   write results name, uploads DCP's ``.metadata``, and commits the step as a single-rank
   save does: the manifest listing every rank's files, then one ``noreplace`` rename.

So ``latest()`` can never name a step that lacks a rank's shards. A multi-rank save has no
crash-safe local copy to resume from: it returns once the step is committed (a killed
save is saved again by the resumed job); ``upload=False`` is refused there.

Caveats:
    * DCP's own ``.metadata`` file is a pickle that torch loads itself; the
      manifest's checksum guarantees it is the file the writer produced.
    * The reader reads only the byte ranges of the load plan, where they lie (the local staged
      copy, else the store), checking each 4 MiB checksum chunk as it is first read: a damaged
      byte fails ``dcp.load``, not the reader's construction.
"""

from __future__ import annotations

import dataclasses
import io
import os
import posixpath
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait as futures_wait
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from stripefs.fsclient import Client, normpath

from . import _ranks
from ._durable import publish_dir
from ._format import BASE_VERSION, FORMAT, MANIFEST, ChecksumError, crc_combine, manifest_bytes, parse_manifest
from ._journal import CkptRow, FileRow, Journal
from ._replicas import Durability
from ._mover import MoverOptions, Uploader, client_for, remote_paths, with_retries
from ._checked import CheckedFiles
from ._dcp_direct import stored_tensor
from ._fill import bytes_of
from ._verify import file_problems, rows_of
from ._save import _step_of, default_staging_dir
from ._service import apply_retention

__all__ = ["StagedStorageWriter", "StagedStorageReader"]


PIECE = 8 << 20  # bytes of a rank's file read and sent at a time
CHECK_CHUNK = 4 << 20  # the checksum chunk of DCP's files
READERS = 4  # threads of a load reading its tensors' whole checksum chunks
READ_PIECE = 16 << 20  # bytes such a thread reads at a time


def _is_url(checkpoint_id: Any) -> bool:
    return isinstance(checkpoint_id, str) and checkpoint_id.startswith("stripefs://")


@dataclasses.dataclass
class _RankPart(_StoragePrefix):
    """One rank's share of a multi-rank save, as the coordinator planned it: DCP's file
    prefix, the checkpoint id and URL every rank uploads under, and the number of ranks."""

    group: str = ""
    rank: int = 0
    world: int = 1
    url: str = ""


class StagedStorageWriter(FileSystemWriter):
    """A DCP ``StorageWriter`` + ``AsyncStager`` that commits to ``url`` through staging.

    Args:
        url: final directory (``stripefs://run/step-100``); ``checkpoint_id`` of
            ``dcp.save`` overrides it.
        staging_dir, cluster, keep_local, keep_remote, options: as for :func:`staging.save`.
        upload: False leaves the staged copy for a standalone mover.

    Attributes:
        durability: after a save that committed here (one rank, or the coordinator of several),
            the replicas the store had serving at the commit (a :class:`Durability`, as
            ``SaveHandle.durability``; a degraded commit also logs a warning); None before, on
            the other ranks of a multi-rank save, with ``upload=False``, or when the cluster
            could not say. The journal, the manifest and ``stripefs ckpt list`` record it too.
    """

    def __init__(self, url: str | None = None, *, staging_dir: str | None = None, cluster: str | None = None,
                 keep_local: int | None = 2, keep_remote: int | None = None, upload: bool = True,
                 options: MoverOptions | None = None, thread_count: int = 2) -> None:
        self.journal = Journal(os.path.abspath(staging_dir or default_staging_dir()))
        self.cluster, self.keep_local, self.keep_remote, self.upload = cluster, keep_local, keep_remote, upload
        self.options = options or MoverOptions(cluster=cluster)
        self.url = url
        self.timings: dict[str, float] = {}
        self.durability: Durability | None = None
        self._lock: Any = None
        self._new_id()
        super().__init__(self._tmp, single_file_per_rank=True, sync_files=True, thread_count=thread_count,
                         cache_staged_state_dict=False, overwrite=True)
        self._staged: Any = None

    def _new_id(self) -> None:
        self.ckpt_id = uuid.uuid4().hex
        self._final_local = self.journal.step_dir(self.ckpt_id)
        self._tmp = os.path.join(os.path.dirname(self._final_local), ".tmp-" + self.ckpt_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_url(checkpoint_id)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """AsyncStager: copy into CPU buffers kept from the previous save (pinned with CUDA)."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        self.per_thread_copy_ahead = 0
        t = time.monotonic()
        cuda = torch.cuda.is_available()
        for attempt in (0, 1):
            if self._staged is None:
                self._staged = _create_cpu_state_dict(state_dict, pin_memory=cuda)
            try:
                out = _copy_state_dict(state_dict, self._staged, non_blocking=cuda)
                break
            except (ValueError, RuntimeError, KeyError, TypeError, AssertionError):
                if attempt:
                    raise
                self._staged = None  # the state dict changed shape: new buffers
        if cuda:
            torch.cuda.synchronize()
        self.timings["snapshot"] = time.monotonic() - t
        return out

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            if not _is_url(checkpoint_id):
                raise ValueError(f"StagedStorageWriter needs a stripefs:// checkpoint_id, got {checkpoint_id!r}")
            self.url = str(checkpoint_id)
        if self._lock is not None:  # the previous save of this writer registered: a new checkpoint
            self._lock.release()
            self._lock = None
            self._new_id()
        super().reset(self._tmp)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if self.url is None:
            raise ValueError("StagedStorageWriter needs a url (or checkpoint_id)")
        if self._lock is not None:
            self.reset()
        self.t0 = time.monotonic()
        self._coordinator, self._world = is_coordinator, 1
        self.durability = None
        # Register before DCP writes anything, so a mover never mistakes the files for orphans.
        self._lock = self.journal.lock(self.ckpt_id)
        self._lock.try_acquire()
        self.row = CkptRow(self.ckpt_id, normpath(self.url), self.cluster or client_for(self.cluster).config.path,
                           self._final_local, "writing", _step_of(self.url, None), False, self.keep_local,
                           self.keep_remote,
                           time.time(), None, None, 0, "dcp")
        self.journal.begin(self.row, [])

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: with more than one rank, every rank's plan names the one
        checkpoint they all upload into (this writer's id) and how many ranks take part."""
        plans = super().prepare_global_plan(plans)
        if len(plans) == 1:
            return plans
        if not self.upload:
            raise ValueError("a save by several ranks commits once every rank's files are in the store; "
                             "upload=False (a local copy for a standalone mover) is for one rank")
        self._world = len(plans)
        url = normpath(self.url)  # type: ignore[arg-type]
        return [dataclasses.replace(p, storage_data=_RankPart(p.storage_data.prefix, self.ckpt_id, i, len(plans), url))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        part = plan.storage_data
        if not isinstance(part, _RankPart):
            return super().write_data(plan, planner)
        try:
            if normpath(self.url) != part.url:  # type: ignore[arg-type]
                raise ValueError(f"rank {part.rank} saves to {self.url}, the coordinator to stripefs:/{part.url}")
            written = super().write_data(plan, planner)  # local files, fsynced; done when it returns
            written.wait()
            _upload_part(self._client(), part, self._tmp, self.options)
            return written
        finally:
            if not self._coordinator:  # finish runs on the coordinator only: this save ends here
                self._end_save()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        try:
            if self._world > 1:
                self._commit_ranks(results)
            else:
                self._stage_and_upload()
        finally:
            self._end_save()

    def _end_save(self) -> None:
        """This writer's save is over; the next one gets a new id. A rank of a multi-rank
        save keeps no local copy (the store has its files) and no journal row, except the
        coordinator's row of a committed step (retention counts it)."""
        if self._world > 1 or not self._coordinator:
            shutil.rmtree(self._tmp, ignore_errors=True)
            row = self.journal.get(self.ckpt_id)
            if row is not None and row.state != "committed":
                self.journal.delete(self.ckpt_id)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
            self._new_id()
            super().reset(self._tmp)

    def _client(self) -> Client:
        return client_for(self.options.cluster or self.cluster)

    def _commit_ranks(self, results: list[list[WriteResult]]) -> None:
        """The coordinator's commit of a multi-rank save: every rank's part is in the store
        (torch calls ``finish`` only once every rank's ``write_data`` returned: no waiting)."""
        client = self._client()
        _, partial = remote_paths(self.row.url, self.ckpt_id)
        parts = _ranks.gather(client, partial, self._world, self.row.url, timeout=0.0)
        records = [rec for part in parts for rec in part["files"]]
        named = {wr.storage_data.relative_path for rank_results in results for wr in rank_results}
        missing = named - {r["name"] for r in records}
        if missing:
            raise _ranks.CheckpointAborted(f"files of {self.row.url} missing from every rank's part: {sorted(missing)}")
        meta, _ = _records(self._tmp, [".metadata"])
        with_retries(lambda: _put_files(client, partial, self._tmp, meta, self.options.verify), self.options,
                     self.row.url, self.options.cluster)
        records += meta
        self.journal.add_files(self.ckpt_id, [_row_of(r) for r in records])
        self.durability = _ranks.commit(self.journal, self.row, self.options, client, partial, self._world,
                                        self._manifest(records))
        self.timings["upload"] = time.monotonic() - self.t0
        apply_retention(self.journal, self.journal.get(self.ckpt_id) or self.row, self.options)

    def _manifest(self, records: list[dict[str, Any]]) -> bytes:
        return manifest_bytes({"format": FORMAT, "version": BASE_VERSION, "id": self.ckpt_id, "kind": "dcp",
                               "step": self.row.step, "created": self.row.created, "url": self.row.url, "files": records})

    def _stage_and_upload(self) -> None:
        records, rows = _records(self._tmp, sorted(os.listdir(self._tmp)))
        with open(os.path.join(self._tmp, MANIFEST), "wb") as f:
            f.write(self._manifest(records))
            os.fsync(f.fileno())
        self.journal.add_files(self.ckpt_id, rows)
        publish_dir(self._tmp, self._final_local)  # durable before the journal says "staged"
        self.journal.set_state(self.ckpt_id, "staged")
        self.timings["local_write"] = time.monotonic() - self.t0
        if self.upload:
            t = time.monotonic()
            up = Uploader(self.journal, self.row, self.options)
            up.run()
            self.durability = up.durability
            self.timings["upload"] = time.monotonic() - t
            apply_retention(self.journal, self.journal.get(self.ckpt_id) or self.row, self.options)


class StagedStorageReader(FileSystemReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`StagedStorageWriter`.

    Raises:
        FileNotFoundError: nothing committed at ``url`` (construction / reset).
        ChecksumError: a file is missing or of another size than committed (construction /
            reset); a checksum chunk fails its CRC32C (``dcp.load``).
    """

    def __init__(self, url: str, *, staging_dir: str | None = None, cluster: str | None = None) -> None:
        self.staging_dir = os.path.abspath(staging_dir or default_staging_dir())
        self.cluster = cluster
        path, files = self._resolve(url)
        super().__init__(path)
        self.fs, self.path = files, path  # torch's reader opens every file through self.fs

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_url(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(None)
        if checkpoint_id is not None:
            self.path, self.fs = self._resolve(str(checkpoint_id))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each stored tensor the plan loads whole into a contiguous CPU tensor of its dtype
        is read straight into that tensor (:mod:`._dcp_direct`), its whole checksum chunks on
        :data:`READERS` threads while the next tensors' records are parsed; other objects
        (bytes items) are read from the same open file; torch's reader loads the rest
        (narrowed or transformed items: into fresh memory, then copied)."""
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        rest: list[ReadItem] = []
        with ThreadPoolExecutor(READERS, thread_name_prefix="stripefs-dcp-read") as pool:
            for relative_path, reqs in per_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                    reading: list[Any] = []
                    done: list[tuple[ReadItem, torch.Tensor]] = []
                    try:
                        for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                            info = self.storage_data[req.storage_index]
                            if req.type == LoadItemType.BYTE_IO and not info.transform_descriptors:
                                stream.seek(info.offset)  # an object torch.save'd: its bytes as they are
                                planner.load_bytes(req, io.BytesIO(stream.read(info.length)))
                                continue
                            target = self._read_in_place(stream, req, planner, pool, reading)
                            if target is None:
                                rest.append(req)
                            else:
                                done.append((req, target))
                    finally:
                        futures_wait(reading)  # no read into a target outlives this call
                    for fut in reading:
                        fut.result()  # a bad chunk's ChecksumError
                    for req, target in done:
                        planner.commit_tensor(req, target)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_in_place(self, stream: Any, req: ReadItem, planner: LoadPlanner, pool: ThreadPoolExecutor,
                       reading: list[Any]) -> torch.Tensor | None:
        """The target of ``req`` once its bytes are read or being read (whole chunks on
        ``pool``, their futures in ``reading``), or ``None`` for torch's reader."""
        info = self.storage_data[req.storage_index]
        if req.type != LoadItemType.TENSOR or info.transform_descriptors or any(req.storage_offsets):
            return None
        stored = stored_tensor(stream, info.offset, info.length)
        if stored is None or tuple(req.lengths) != stored.shape:
            return None
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != stored.shape:
            raise ValueError(f"{req.dest_index.fqn}: the target's shape is {tuple(target.shape)}, "
                             f"the checkpoint's {stored.shape}")
        if target.device.type == "cpu" and target.dtype == stored.dtype and target.is_contiguous():
            if stored.nbytes:
                for view, at in stream.read_split(bytes_of(target), info.offset + stored.data_offset, READ_PIECE):
                    reading.append(pool.submit(stream.read_checked, view, at))
        else:  # another dtype, device or layout: loaded as torch's reader does, then copied
            stream.seek(info.offset)
            target.copy_(torch.load(io.BytesIO(stream.read(info.length)), map_location="cpu", weights_only=True))
        return target

    def _resolve(self, url: str) -> tuple[str, CheckedFiles]:
        """Where torch's reader reads the committed step ``url`` from: the local staged copy
        when this staging area holds all of its files (a bad chunk there is read again from
        the store), else the store. Either way each file is read through a
        :class:`~._checked.CheckedFile` (every 4 MiB checksum chunk checked as it is first
        read), and only the byte ranges the load plan names are read."""
        client = client_for(self.cluster)
        final = normpath(url)
        man = parse_manifest(client.read_bytes(posixpath.join(final, MANIFEST)), final)
        local = Journal(self.staging_dir).step_dir(man["id"])
        if all(_local_size(local, rec["name"]) == rec["size"] for rec in man["files"]):
            return local, CheckedFiles(final, man, client, local=local)
        # One stat per file first: a step cut short fails here, naming every bad file.
        problems = file_problems(client, final, rows_of(man["files"]), checksums=False)
        if problems:
            raise ChecksumError("; ".join(f"{n}: {r}" for n, r in sorted(problems.items())), final)
        return final, CheckedFiles(final, man, client)


def _local_size(where: str, name: str) -> int | None:
    try:
        return os.stat(os.path.join(where, name)).st_size
    except OSError:
        return None


def _records(where: str, names: list[str]) -> tuple[list[dict[str, Any]], list[FileRow]]:
    """The manifest records and journal rows of the local files ``names`` in ``where``, read
    a checksum chunk at a time (a rank's file may be many GB: never whole in memory)."""
    records = []
    for name in names:
        size, total, crcs = 0, 0, []
        with open(os.path.join(where, name), "rb") as f:
            while piece := f.read(CHECK_CHUNK):
                crcs.append(crc32c.crc32c(piece))
                total = crc_combine(total, crcs[-1], len(piece))
                size += len(piece)
        records.append({"name": name, "size": size, "crc32c": total, "chunk": CHECK_CHUNK, "chunk_crc32c": crcs,
                        "encoding": "raw"})
    return records, [_row_of(r) for r in records]


def _row_of(record: dict[str, Any]) -> FileRow:
    return FileRow(record["name"], record["size"], record["crc32c"], record["chunk"], record["chunk_crc32c"], 0)


def _upload_part(client: Client, part: _RankPart, where: str, options: MoverOptions) -> None:
    """Put one rank's files into the checkpoint's partial directory, check them there, then
    write the rank's part record: the coordinator commits only what every record names."""
    _, partial = remote_paths(part.url, part.group)
    records, _ = _records(where, sorted(os.listdir(where)))
    with_retries(lambda: _put_files(client, partial, where, records, options.verify), options, part.url,
                 options.cluster)
    _ranks.write_part(client, partial, part.rank, {"files": records})


def _put_files(client: Client, partial: str, where: str, records: list[dict[str, Any]], verify: bool) -> None:
    """Send whole files from ``where`` into ``partial``, then check each in the store.

    Raises:
        ChecksumError: a file's committed size or CRC32Cs differ from what was sent.
    """
    client.makedirs(partial)
    for rec in records:
        with open(os.path.join(where, rec["name"]), "rb") as local, \
                client.open(posixpath.join(partial, rec["name"]), "wb") as remote:
            while piece := local.read(PIECE):
                remote.write(piece)
    problems = file_problems(client, partial, [_row_of(r) for r in records], checksums=verify)
    if problems:
        name, why = next(iter(problems.items()))
        raise ChecksumError(f"uploaded file {name} fails its checks: {why}", partial)
