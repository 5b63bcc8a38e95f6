"""``staging.load`` and ``staging.latest``: parallel reads straight into tensor memory.

How the bytes move is :mod:`._fill`'s: tensors of at least ``DIRECT`` bytes are read into their
own memory in chunk-sized pieces spread over the ``READERS`` threads, each piece's CRC32C taken
as it lands; runs of small tensors are read with one request each, so a model with thousands of
biases costs a few round trips, not thousands. Each tensor's CRC32C is checked before it is
returned: a mismatch raises :class:`ChecksumError` (fail closed).

Memory: the tensors themselves plus a fixed budget, whatever the state holds: each of the
``READERS`` threads holds at most one scratch buffer of ``RUN_BYTES`` (a run of small tensors
read from the store is cut there; a local one is scattered straight into its tensors), or for a
zstd file ``ZSTD_BLOCK`` of frames and one decompressed frame: 64 MiB over the state's size for
raw files, about 96 MiB for zstd ones.
"""

from __future__ import annotations

import logging
import errno
import os
import posixpath
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable

import crc32c
import torch

# DIRECT and RUN_BYTES are imported for those who read the load's knobs here (the memory tests).
from ._fill import DIRECT, RUN_BYTES, bytes_of, dest_of, raw_jobs, read_exact  # noqa: F401
from ._format import MANIFEST, ChecksumError, decode_tree, dtype_from_name, parse_manifest, step_order
from ._into import Targets, pair
from ._journal import Journal
from ._ranks import rank_slice
from ._mover import checkpoint_path, client_for
from ._save import default_staging_dir
from ._verify import file_problems, rows_of

__all__ = ["load", "latest", "read_manifest", "verify"]

log = logging.getLogger("stripefs.staging")

READERS = 8
LOCAL_PIECE = 4 << 20  # a local file's pieces (a stored file's are its chunks)


class _Source:
    """Positional reads of a checkpoint's files, local (a directory) or remote (stripefs)."""

    def __init__(self, root: str, client: Any | None):
        self.root, self.client = root, client
        self.local = client is None
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()

    def manifest(self) -> bytes:
        if self.client is None:
            with open(os.path.join(self.root, MANIFEST), "rb") as f:
                return f.read()
        return self.client.read_bytes(posixpath.join(self.root, MANIFEST))

    def open(self, name: str) -> Any:
        with self._lock:
            return self._open(name)

    def _open(self, name: str) -> Any:
        if name not in self._files:
            if self.client is None:
                self._files[name] = os.open(os.path.join(self.root, name), os.O_RDONLY)
            else:
                self._files[name] = self.client.open(posixpath.join(self.root, name), "rb")
        return self._files[name]

    def pread_into(self, name: str, dest: memoryview, offset: int) -> int:
        f = self.open(name)
        if self.client is None:
            return os.preadv(f, [dest], offset)
        # Straight to the client's stateless read: StripeFile's readahead window is per-thread state.
        return self.client.read_into(f.ino, f.layout, f.size, offset, dest)

    def piece(self, name: str) -> int:
        """Bytes of one piece of a large tensor's read: a stored file's chunk (one request)."""
        if self.client is None:
            return LOCAL_PIECE
        chunk = self.open(name).layout.chunk_size
        while chunk > 4 * LOCAL_PIECE and chunk % 2 == 0:  # a huge chunk: still pieces to spread
            chunk //= 2
        return chunk

    def preadv(self, name: str, dests: list[memoryview], offset: int) -> int:
        """One scattering read of a local file (only local sources have one)."""
        return os.preadv(self.open(name), dests, offset)

    def close(self) -> None:
        for f in self._files.values():
            os.close(f) if self.client is None else f.close()
        self._files.clear()


def _load_from(src: _Source, man: dict[str, Any], verify: bool, only: range | None = None,
               targets: Targets | None = None) -> list[torch.Tensor]:
    """Every stored tensor of ``man`` (``only``: those of these files; the others stay None),
    each in fresh memory or in the memory ``targets`` gives for it."""
    files = man["files"]
    index = man["tensors"]
    out: list[torch.Tensor | None] = [None] * len(index)
    if targets is not None:
        targets.prefill(out)
    jobs: list[Callable[[], None]] = []

    def check(i: int, t: torch.Tensor) -> None:
        if verify and crc32c.crc32c(bytes_of(t)) != index[i]["crc32c"]:
            raise ChecksumError(f"tensor {i} of {src.root} fails its CRC32C check", src.root)

    scratch = threading.local()  # each reader thread's buffer for runs of small tensors
    for fi, rec in enumerate(files):
        if only is not None and fi not in only:
            continue
        # Views (version 3) have no bytes of their own: _materialize makes them from their storage.
        mine = sorted((i for i, e in enumerate(index) if "base" not in e and e["file"] == fi),
                      key=lambda i: index[i]["offset"])
        if rec.get("encoding", "raw") == "zstd":
            jobs.append(lambda rec=rec, mine=mine: _load_zstd(src, rec, index, mine, out, check))
        else:
            jobs.extend(raw_jobs(src, rec, index, mine, out, verify, scratch))
    with ThreadPoolExecutor(READERS) as pool:
        futures = [pool.submit(j) for j in jobs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            pool.shutdown(cancel_futures=True)  # the load fails: the jobs not started never start
            failed.result()
    return out  # type: ignore[return-value]


ZSTD_BLOCK = 8 << 20  # compressed bytes read per request by a zstd load (whole frames)


def _load_zstd(src: _Source, rec: dict[str, Any], index: list[dict[str, Any]], mine: list[int], out: list[Any],
               check: Any) -> None:
    """Decompress frame by frame straight into the tensors of the file.

    Only a block of compressed frames (about ``ZSTD_BLOCK``) and one decompressed frame are
    held besides the tensors themselves: never the whole stored file, never the whole raw file.
    """
    import zstandard

    tensors = {i: dest_of(out, i, index[i]) for i in mine}
    spans = [(index[i]["offset"], index[i]["offset"] + index[i]["nbytes"], bytes_of(tensors[i])) for i in mine]
    frames, size, raw_size = rec["frames"], rec["size"], rec["raw_size"]
    dec = zstandard.ZstdDecompressor()
    block = bytearray()
    pos = cpos = k = fi = 0  # raw and stored offset of frame fi; spans[k] is the first not yet complete
    while fi < len(frames):
        # The next run of whole frames, up to ZSTD_BLOCK of stored bytes (at least one frame).
        last, want = fi, 0
        while last < len(frames) and (want == 0 or want + frames[last][1] <= ZSTD_BLOCK):
            want += frames[last][1]
            last += 1
        if cpos + want > size:
            raise ChecksumError(f"{rec['name']}: zstd frames run past the stored size", src.root)
        if len(block) < want:
            block = bytearray(want)
        view = memoryview(block)[:want]
        read_exact(src, rec["name"], view, cpos)
        boff = 0
        for rlen, clen, crc in frames[fi:last]:
            if pos + rlen > raw_size:
                raise ChecksumError(f"{rec['name']}: zstd frames decode past the raw size", src.root)
            piece = dec.decompress(view[boff : boff + clen], max_output_size=rlen)
            if len(piece) != rlen or crc32c.crc32c(piece) != crc:
                raise ChecksumError(f"{rec['name']}: zstd frame at {cpos + boff} fails its check", src.root)
            pv = memoryview(piece)
            j = k
            while j < len(spans) and spans[j][0] < pos + rlen:  # tensors this frame covers a part of
                lo, hi, dest = spans[j]
                a, b = max(lo, pos), min(hi, pos + rlen)
                if a < b:
                    dest[a - lo : b - lo] = pv[a - pos : b - pos]
                j += 1
            while k < len(spans) and spans[k][1] <= pos + rlen:
                k += 1
            pos, boff = pos + rlen, boff + clen
        cpos += want
        fi = last
    if pos != raw_size:  # the frames must cover every tensor byte, also when verify is off
        raise ChecksumError(f"{rec['name']}: zstd frames decode {pos} bytes, {raw_size} recorded", src.root)
    del block
    for i in mine:
        check(i, tensors[i])
        out[i] = tensors[i]


def _materialize(src: _Source, man: dict[str, Any], verify: bool, map_location: Any, rank: int | None = None,
                 into: Any = None) -> Any:
    if man.get("kind") == "dcp":
        raise ValueError(f"{man.get('url')} is a torch DCP checkpoint: load it with torch.distributed.checkpoint.load "
                         "and staging.StagedStorageReader(url)")
    tree, files, mine = man["tree"], None, range(len(man["tensors"]))
    if rank is not None and (rank != 0 or "ranks" in man):
        files, mine, keys = rank_slice(man, rank)
        tree = {"d": tree["d"][keys.start : keys.stop]}
    index = man["tensors"]
    targets = pair(tree, into, index, mine) if into is not None else Targets()
    tensors: list[Any] = _load_from(src, man, verify, files, targets)
    if map_location is not None:
        device = torch.device(map_location)
        # numpy arrays stay numpy (host memory): only tensors move, and a target stays where it is.
        tensors = [t if t is None or e.get("numpy") or i in targets.direct else t.to(device)
                   for i, (t, e) in enumerate(zip(tensors, index))]
    for i, e in enumerate(index):
        if i not in mine:
            continue  # another rank's tensor (load(rank=...))
        if "base" in e:  # a view of a stored storage, on whatever device that storage now is
            base = tensors[e["base"]]
            dt = dtype_from_name(e["dtype"])
            tensors[i] = torch.empty(0, dtype=dt, device=base.device).set_(
                base.untyped_storage(), e["byte_offset"] // dt.itemsize, e["shape"], e["stride"])
    targets.finish(tensors)
    for i, e in enumerate(index):  # version 4: parameters and tensors that required grad come back so
        if i not in mine or i in targets.given:  # a target keeps its own autograd state
            continue
        if e.get("param"):
            tensors[i] = torch.nn.Parameter(tensors[i], requires_grad=bool(e.get("requires_grad")))
        elif e.get("requires_grad"):
            tensors[i].requires_grad_(True)
    values: list[Any] = [t.numpy() if e.get("numpy") and t is not None else t for t, e in zip(tensors, index)]
    for i, obj in targets.given.items():
        values[i] = obj
    return decode_tree(tree, values)


def read_manifest(url: str, *, cluster: str | None = None) -> dict[str, Any]:
    """The committed manifest of ``url``. Raises FileNotFoundError when no step is committed there."""
    client = client_for(cluster)
    final = checkpoint_path(url)
    return parse_manifest(client.read_bytes(posixpath.join(final, MANIFEST)), final)


def load(url: str | None, *, map_location: Any = None, verify: bool = True, staging_dir: str | None = None,
         cluster: str | None = None, prefer_local: bool = True, rank: int | None = None, into: Any = None) -> Any:
    """Load a checkpoint saved by :func:`staging.save`.

    A step saved by several ranks (``save(..., rank=r, world_size=n)``) loads as one dict
    holding every rank's keys; ``rank=r`` loads only the keys rank ``r`` saved (and reads
    only its files).

    Args:
        url: ``stripefs://…/step-N``, or a local staged step directory.
        rank: only this rank's keys of a step saved by several ranks (0 for a step saved by one).
        map_location: device for the tensors (a ``torch.device`` or its name); default CPU.
            numpy arrays are always returned as numpy arrays, in host memory.
        verify: check every tensor's CRC32C (fail closed on mismatch).
        prefer_local: use the staging directory's copy when it is the committed one and verifies.
        into: a state already in memory to restore into (``model.state_dict()``, or a dict of
            several): each stored tensor whose place (same keys, same list positions) holds a
            tensor or numpy array of the stored dtype and shape is filled in place, host
            contiguous ones straight by the readers, and is what the returned state holds
            there. Saves faulting in fresh memory and the copy of ``load_state_dict``. A
            failed check leaves the targets partly written.

    Raises:
        FileNotFoundError: nothing committed at ``url``. ChecksumError: corrupt bytes.
        pickle.UnpicklingError: a non-JSON value needs a type the restricted loader refuses.
        ValueError: ``rank`` is not a rank of the step; the step is a DCP checkpoint; a tensor
            in ``into`` has another dtype or shape than the stored one (raised before any read).
    """
    if url is None:  # load(latest(prefix)) on a first run
        raise FileNotFoundError(errno.ENOENT, "no checkpoint to load (latest() found none: a first run?)")
    if isinstance(url, str) and not url.startswith("stripefs://") and os.path.isfile(os.path.join(url, MANIFEST)):
        src = _Source(url, None)
        try:
            return _materialize(src, parse_manifest(src.manifest(), url), verify, map_location, rank, into)
        finally:
            src.close()
    final = checkpoint_path(url)
    client = client_for(cluster)
    remote = _Source(final, client)
    try:
        man = parse_manifest(remote.manifest(), final)
        if prefer_local:
            local = _local_copy(final, man["id"], staging_dir)
            if local is not None:
                src = _Source(local, None)
                try:
                    return _materialize(src, man, verify, map_location, rank, into)
                except (ChecksumError, OSError) as exc:
                    log.warning("local copy %s unusable (%s); reading %s", local, exc, url)
                finally:
                    src.close()
        # One stat per file before anything is allocated: a step cut short (or a manifest that
        # claims more than the store holds) fails here, naming every bad file.
        problems = file_problems(client, final, rows_of(man["files"]), checksums=False)
        if problems:
            raise ChecksumError("; ".join(f"{n}: {r}" for n, r in sorted(problems.items())), final)
        return _materialize(remote, man, verify, map_location, rank, into)
    finally:
        remote.close()


def _local_copy(final: str, ckpt_id: str, staging_dir: str | None) -> str | None:
    d = staging_dir or default_staging_dir()
    if not os.path.isfile(os.path.join(d, "journal.sqlite")):
        return None
    path = Journal(d).step_dir(ckpt_id)
    return path if os.path.isfile(os.path.join(path, MANIFEST)) else None


def latest(prefix: str, *, cluster: str | None = None) -> str | None:
    """URL of the newest committed step directly under ``prefix`` that can be loaded, or None.

    Steps are tried newest first (by trailing step number); a step counts only when its
    manifest passes its checksum and validation and every file it lists has the committed
    size the manifest records (one ``stat`` per file: cheap). A step that fails is skipped
    with a warning; :func:`verify` also reads every byte back.

    Raises:
        OSError: the store could not be asked (a broken step is skipped, not an error).
    """
    client = client_for(cluster)
    base = checkpoint_path(prefix)
    try:
        entries = list(client.scandir(base))
    except (FileNotFoundError, NotADirectoryError):
        return None
    candidates = []
    for e in entries:
        if e.name.startswith(".") or (e.attr is not None and not e.attr.is_dir):
            continue  # hidden: a partial upload, never a step
        candidates.append(e.name)
    for name in sorted(candidates, key=step_order, reverse=True):
        path = posixpath.join(base, name)
        try:
            man = parse_manifest(client.read_bytes(posixpath.join(path, MANIFEST)), path)
        except (FileNotFoundError, NotADirectoryError):
            continue  # never committed: not a step
        except ChecksumError as exc:
            log.warning("latest: skipping %s: %s", path, exc.strerror)
            continue
        problems = file_problems(client, path, rows_of(man["files"]), checksums=False)
        if problems:
            log.warning("latest: skipping %s: %s", path, "; ".join(f"{n}: {r}" for n, r in problems.items()))
            continue
        return "stripefs://" + path.lstrip("/")
    return None


def verify(url: str, *, cluster: str | None = None) -> dict[str, Any]:
    """Check a committed step completely: its manifest, and every file's size and CRC32Cs (read back).

    Args:
        url: ``stripefs://…/step-N`` (the prefix is optional).
        cluster: cluster.json or host:port; default discovery.

    Returns:
        the step's manifest (without its checksum key).

    Raises:
        FileNotFoundError: no checkpoint is committed at ``url``.
        ChecksumError: the manifest or a file fails a check; the message names every bad file.
        OSError: the store could not be read.
    """
    client = client_for(cluster)
    final = checkpoint_path(url)
    man = parse_manifest(client.read_bytes(posixpath.join(final, MANIFEST)), final)
    problems = file_problems(client, final, rows_of(man["files"]), checksums=True)
    if problems:
        raise ChecksumError("; ".join(f"{n}: {r}" for n, r in sorted(problems.items())), final)
    return man
