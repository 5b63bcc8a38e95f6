"""torch.distributed.checkpoint bridge: DCP writes through local staging and the mover.

``StagedStorageWriter`` is torch's ``FileSystemWriter`` pointed at a private
directory of the staging area; in ``finish`` it checksums every file DCP
wrote, records them in the journal, makes the copy locally durable and hands
it to the same uploader as :func:`staging.save` (atomic rename, manifest
last). ``dcp.async_save`` uses its ``stage`` (torch's ``BlockingAsyncStager``
with ``cache_staged_state_dict=True``: the CPU copy is made into buffers that
are reused by every later save). ``StagedStorageReader`` verifies the files
against the manifest — using the local staged copy when there is one,
otherwise downloading into the staging area's cache — and lets torch's
``FileSystemReader`` read them.

Caveats:
    * DCP's own ``.metadata`` file is a pickle that torch loads itself; the
      manifest's checksum guarantees it is the file the writer produced.
    * The reader downloads the checkpoint to local disk before DCP reads it.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from stripefs.fsclient import normpath

from ._durable import publish_dir
from ._format import BASE_VERSION, FORMAT, MANIFEST, ChecksumError, chunk_crcs, manifest_bytes, parse_manifest
from ._journal import CkptRow, FileRow, Journal
from ._mover import MoverOptions, Uploader, client_for
from ._save import default_staging_dir
from ._service import apply_retention

__all__ = ["StagedStorageWriter", "StagedStorageReader"]


def _is_url(checkpoint_id: Any) -> bool:
    return isinstance(checkpoint_id, str) and checkpoint_id.startswith("stripefs://")


class StagedStorageWriter(FileSystemWriter):
    """A DCP ``StorageWriter`` + ``AsyncStager`` that commits to ``url`` through staging.

    Args:
        url: final directory (``stripefs://run/step-100``); ``checkpoint_id`` of
            ``dcp.save`` overrides it.
        staging_dir, cluster, keep_local, keep_remote, options: as for :func:`staging.save`.
        upload: False leaves the staged copy for a standalone mover.
    """

    def __init__(self, url: str | None = None, *, staging_dir: str | None = None, cluster: str | None = None,
                 keep_local: int | None = 2, keep_remote: int | None = None, upload: bool = True,
                 options: MoverOptions | None = None, thread_count: int = 2) -> None:
        self.journal = Journal(os.path.abspath(staging_dir or default_staging_dir()))
        self.cluster, self.keep_local, self.keep_remote, self.upload = cluster, keep_local, keep_remote, upload
        self.options = options or MoverOptions(cluster=cluster)
        self.url = url
        self.timings: dict[str, float] = {}
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
        # Register before DCP writes anything, so a mover never mistakes the files for orphans.
        self._lock = self.journal.lock(self.ckpt_id)
        self._lock.try_acquire()
        self.row = CkptRow(self.ckpt_id, normpath(self.url), self.cluster or client_for(self.cluster).config.path,
                           self._final_local, "writing", None, False, self.keep_local, self.keep_remote,
                           time.time(), None, None, 0, "dcp")
        self.journal.begin(self.row, [])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        try:
            self._stage_and_upload()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
                self._new_id()
                super().reset(self._tmp)

    def _stage_and_upload(self) -> None:
        records, rows = [], []
        for name in sorted(os.listdir(self._tmp)):
            with open(os.path.join(self._tmp, name), "rb") as f:
                data = f.read()
            total, crcs = chunk_crcs(memoryview(data))
            records.append({"name": name, "size": len(data), "crc32c": total, "chunk": 4 << 20, "chunk_crc32c": crcs,
                            "encoding": "raw"})
            rows.append(FileRow(name, len(data), total, 4 << 20, crcs, 0))
        manifest = {"format": FORMAT, "version": BASE_VERSION, "id": self.ckpt_id, "kind": "dcp", "step": None,
                    "created": self.row.created, "url": self.row.url, "files": records}
        with open(os.path.join(self._tmp, MANIFEST), "wb") as f:
            f.write(manifest_bytes(manifest))
            os.fsync(f.fileno())
        self.journal.add_files(self.ckpt_id, rows)
        publish_dir(self._tmp, self._final_local)  # durable before the journal says "staged"
        self.journal.set_state(self.ckpt_id, "staged")
        self.timings["local_write"] = time.monotonic() - self.t0
        if self.upload:
            t = time.monotonic()
            Uploader(self.journal, self.row, self.options).run()
            self.timings["upload"] = time.monotonic() - t
            apply_retention(self.journal, self.journal.get(self.ckpt_id) or self.row, self.options)


class StagedStorageReader(FileSystemReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`StagedStorageWriter`.

    Raises (at construction / reset):
        FileNotFoundError: nothing committed at ``url``. ChecksumError: a file fails its CRC32C.
    """

    def __init__(self, url: str, *, staging_dir: str | None = None, cluster: str | None = None) -> None:
        self.staging_dir = os.path.abspath(staging_dir or default_staging_dir())
        self.cluster = cluster
        super().__init__(self._resolve(url))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_url(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(self._resolve(str(checkpoint_id)) if checkpoint_id is not None else None)

    def _resolve(self, url: str) -> str:
        client = client_for(self.cluster)
        final = normpath(url)
        man = parse_manifest(client.read_bytes(posixpath.join(final, MANIFEST)), final)
        journal = Journal(self.staging_dir)
        local = journal.step_dir(man["id"])
        if os.path.isdir(local):
            try:
                _verify_dir(local, man, lambda name: open(os.path.join(local, name), "rb").read())
                return local
            except (ChecksumError, OSError):
                pass  # fall through to a fresh verified download
        cache = os.path.join(self.staging_dir, "cache", man["id"])
        if not os.path.isfile(os.path.join(cache, MANIFEST)):
            tmp = cache + f".tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            for rec in man["files"]:  # names validated by parse_manifest: plain, relative, unique
                data = client.read_bytes(posixpath.join(final, rec["name"]))
                _verify_dir(tmp, {"files": [rec]}, lambda _n, d=data: d)
                _write_synced(os.path.join(tmp, rec["name"]), data)
            # The cache is trusted without another check once its manifest exists: durable first.
            _write_synced(os.path.join(tmp, MANIFEST), manifest_bytes(man))
            shutil.rmtree(cache, ignore_errors=True)
            publish_dir(tmp, cache)
        return cache


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _verify_dir(where: str, man: dict[str, Any], read: Any) -> None:
    for rec in man["files"]:
        data = read(rec["name"])
        total, _ = chunk_crcs(memoryview(data))
        if len(data) != rec["size"] or total != rec["crc32c"]:
            raise ChecksumError(f"{rec['name']} fails its CRC32C check", where)
