"""One checkpoint across ranks: every rank's part in the store, then one commit.

Shared by a DCP save of several ranks (``StagedStorageWriter``) and by
``staging.save(..., rank=r, world_size=n)``. All ranks of one save agree on one
checkpoint id; its hidden partial directory (``.<name>.partial-<id>``, the one a
single-rank save uploads into) collects, while the save runs::

    <every rank's files>    uploaded and checked (committed size, CRC32Cs) by the rank that wrote them
    .rank-<r>.json          rank r's part record (its files' records, for staging.save also its
                            tensors and keys), written once its files are in: last, whole
    .rank-<r>.failed        written instead when rank r failed: why
    .failed                 the save's verdict when it aborted: why (every rank reads it)

Rank 0 commits: once every rank's part record is there (:func:`gather`) it removes the part
records, writes the manifest listing every rank's files and renames the directory to its
final name with ``noreplace`` (:func:`commit`, the single-rank commit). A failed or missing rank
makes rank 0 abort instead (:func:`abort`): nothing is renamed, so ``latest()`` can never name
a step that lacks a rank. The other ranks of a ``staging.save`` wait for one of the two
(:func:`wait_commit`); DCP's ranks hear of it from torch's collectives instead.

Caveats:
    * Without a collective, a rank that dies is noticed only when ``timeout`` runs out.
    * A rank whose wait for the verdict times out cannot tell whether rank 0 is only slow:
      its handle fails with :class:`TimeoutError`, and ``latest()`` says whether the step
      committed after all.
    * An aborted save leaves its partial directory holding the verdict (``.failed``), a few
      bytes, so that every rank can read why; rank 0's journal row is ``failed`` and the next
      mover pass removes the directory.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
from typing import Any

from stripefs.fsclient import Client

from ._format import BASE_VERSION, FORMAT, CheckpointConflict, manifest_bytes
from ._journal import CkptRow, Journal, fault_point
from ._mover import MoverOptions, Uploader, _recorded_durability, committed_id, remote_paths, transient
from ._replicas import Durability

__all__ = ["CheckpointAborted", "part_name", "write_part", "report_failure", "gather", "commit", "abort",
           "wait_commit", "merge_state_dicts", "rank_slice", "remove_files"]

log = logging.getLogger("stripefs.staging")

POLL = 0.2  # seconds between looks at the store while waiting for the other ranks
VERDICT = ".failed"


class CheckpointAborted(OSError):
    """A save by several ranks did not commit: a rank failed, or its files never reached the
    store. The message names the rank and why; nothing of the step is visible."""


def part_name(rank: int) -> str:
    """The part record a rank writes once its files are in the store (hidden, never committed)."""
    return f".rank-{rank}.json"


def _failed_name(rank: int) -> str:
    return f".rank-{rank}.failed"


def write_part(client: Client, partial: str, rank: int, part: dict[str, Any]) -> None:
    """Record that rank ``rank``'s files are all in ``partial`` (uploaded and checked).

    ``part`` holds ``files`` (their manifest records) and, for ``staging.save``, ``tensors``,
    ``tree`` and ``version``. A new file appears whole: a reader never sees half a record.
    """
    fault_point("rank_uploaded")
    client.write_bytes(posixpath.join(partial, part_name(rank)), json.dumps({**part, "rank": rank}).encode())
    fault_point("rank_part_written")


def _write_new(client: Client, path: str, text: str) -> None:
    """Best effort: the first writer's text stays (the store may be what failed)."""
    try:
        client.write_bytes(path, text.encode(), exclusive=True)
    except (FileExistsError, OSError) as exc:
        if not isinstance(exc, FileExistsError):
            log.warning("could not record %s: %s", path, exc)


def report_failure(client: Client, partial: str, rank: int, exc: BaseException) -> None:
    """Rank ``rank`` failed: say why where rank 0 looks (rank 0 itself aborts the save)."""
    why = f"{type(exc).__name__}: {exc}"
    if rank == 0:  # the verdict: a rank's failure rank 0 heard of, or rank 0's own
        abort(client, partial, str(exc) if isinstance(exc, CheckpointAborted) else f"rank 0 failed: {why}")
    else:
        try:
            client.makedirs(partial)
        except OSError:
            pass
        _write_new(client, posixpath.join(partial, _failed_name(rank)), why)


def gather(client: Client, partial: str, world: int, url: str, timeout: float) -> list[dict[str, Any]]:
    """Every rank's part record, in rank order, waiting up to ``timeout`` seconds for them.

    Raises:
        CheckpointAborted: a rank reported a failure, or some rank's record is still missing
            at the deadline (the rank died, or never started).
        OSError: the store stayed unreachable past the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            names = set(client.listdir(partial))
        except FileNotFoundError:
            names = set()
        except OSError as exc:
            if not transient(exc) or time.monotonic() > deadline:
                raise
            names = None  # type: ignore[assignment]
        if names is not None:
            for rank in range(world):
                if _failed_name(rank) in names:
                    why = client.read_bytes(posixpath.join(partial, _failed_name(rank))).decode(errors="replace")
                    raise CheckpointAborted(f"rank {rank} of {url} failed: {why}; nothing committed")
            missing = [r for r in range(world) if part_name(r) not in names]
            if not missing:
                parts = [json.loads(client.read_bytes(posixpath.join(partial, part_name(r)))) for r in range(world)]
                fault_point("ranks_gathered")
                return parts
            if time.monotonic() > deadline:
                raise CheckpointAborted(f"the files of rank(s) {missing} of {url} are not in the store after "
                                        f"{timeout:.0f} s (a rank died or never saved); nothing committed")
        time.sleep(POLL)


def commit(journal: Journal, row: CkptRow, options: MoverOptions, client: Client, partial: str, world: int,
           manifest: bytes) -> Durability | None:
    """Rank 0's commit, once :func:`gather` returned: drop the part records, then the manifest
    and the one ``noreplace`` rename of a single-rank save (``Uploader._commit``).

    Returns:
        the replicas the store had serving at the commit (None: it could not say).
    """
    for rank in range(world):
        try:
            client.remove(posixpath.join(partial, part_name(rank)))
        except FileNotFoundError:
            pass  # an earlier attempt removed it
    fault_point("ranks_before_commit")
    final, _ = remote_paths(row.url, row.id)
    up = Uploader(journal, row, options, manifest=lambda: manifest)
    up._commit(client, final, partial)
    return up.durability


def abort(client: Client, partial: str, why: str) -> None:
    """Rank 0 gives up: the verdict first (every rank reads why), then the files (best effort;
    a rank still uploading removes its own when it reads the verdict)."""
    try:
        client.makedirs(partial)
    except OSError:
        pass
    _write_new(client, posixpath.join(partial, VERDICT), why)
    remove_files(client, partial, lambda name: name != VERDICT)


def remove_files(client: Client, partial: str, which: Any) -> None:
    try:
        for name in client.listdir(partial):
            if which(name):
                try:
                    client.remove(posixpath.join(partial, name))
                except FileNotFoundError:
                    pass
    except OSError:
        pass  # best effort: the save's outcome is decided already


def wait_commit(client: Client, url: str, ckpt_id: str, timeout: float) -> Durability | None:
    """A rank other than 0, its part written: wait for rank 0's commit or verdict.

    Returns:
        the durability the committed manifest records.

    Raises:
        CheckpointAborted: rank 0 aborted the save (the message says why).
        CheckpointConflict: another checkpoint was committed at ``url``.
        TimeoutError: neither within ``timeout`` seconds (rank 0 died, or is slow).
    """
    final, partial = remote_paths(url, ckpt_id)
    deadline = time.monotonic() + timeout
    while True:
        try:
            there = committed_id(client, final)
            if there == ckpt_id:
                return _recorded_durability(client, final)
            try:
                why = client.read_bytes(posixpath.join(partial, VERDICT)).decode(errors="replace")
                raise CheckpointAborted(f"{url} was not committed: {why}")
            except FileNotFoundError:
                pass
            # This rank's part was in the partial directory: gone and not committed (the rename
            # would have committed it) means rank 0 aborted and a mover already cleaned up.
            if there is None and not client.exists(partial) and committed_id(client, final) != ckpt_id:
                raise CheckpointAborted(f"{url} was not committed: rank 0 aborted the save (its partial directory, "
                                        "with the reason, was already removed: see rank 0's error)")
            if there is not None:
                raise CheckpointConflict(f"{final} was committed by another writer (checkpoint {there})", final)
        except OSError as exc:
            if isinstance(exc, (CheckpointAborted, CheckpointConflict)) or not transient(exc):
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 neither committed nor aborted {url} within {timeout:.0f} s (dead, or slow: "
                               "latest() says whether the step committed after all)")
        time.sleep(POLL)


# -- staging.save: the parts' tensors and keys in one manifest ---------------------------------

def _shift_refs(node: Any, by: int) -> Any:
    """A manifest tree with every tensor reference (``{"t": i}``) moved by ``by``."""
    if isinstance(node, dict):
        if len(node) == 1 and type(node.get("t")) is int:
            return {"t": node["t"] + by}
        return {k: _shift_refs(v, by) for k, v in node.items()}
    if isinstance(node, list):
        return [_shift_refs(v, by) for v in node]
    return node


def merge_state_dicts(parts: list[dict[str, Any]], header: dict[str, Any]) -> bytes:
    """The manifest of a ``staging.save`` by ``len(parts)`` ranks: one state dict whose keys
    are every rank's keys (rank order), its files and tensors every rank's, and ``ranks``
    saying how many of each are rank r's (``load(url, rank=r)`` reads only those).

    Raises:
        CheckpointAborted: a rank's state is not a dict, or two ranks saved the same key.
    """
    files: list[dict[str, Any]] = []
    tensors: list[dict[str, Any]] = []
    items: list[list[Any]] = []
    ranks, owner = [], {}
    version = BASE_VERSION
    for part in parts:
        tree, rank = part["tree"], part["rank"]
        if not (isinstance(tree, dict) and len(tree) == 1 and next(iter(tree)) in ("d", "od")):
            raise CheckpointAborted(f"rank {rank} saved a {next(iter(tree)) if isinstance(tree, dict) else type(tree)}"
                                    " node: ranks of one save each save a dict (their keys make the step's state)")
        f0, t0 = len(files), len(tensors)
        for e in part["tensors"]:
            e = dict(e)
            if "base" in e:
                e["base"] += t0
            else:
                e["file"] += f0
            tensors.append(e)
        files += part["files"]
        for key, value in next(iter(tree.values())):
            seen = json.dumps(key, sort_keys=True)
            if seen in owner:
                raise CheckpointAborted(f"key {key!r:.60} is saved by rank {owner[seen]} and by rank {rank}: "
                                        "nothing committed")
            owner[seen] = rank
            items.append([key, _shift_refs(value, t0)])
        ranks.append({"files": len(part["files"]), "tensors": len(part["tensors"]),
                      "keys": len(next(iter(tree.values())))})
        version = max(version, int(part.get("version", BASE_VERSION)))
    return manifest_bytes({"format": FORMAT, "version": version, **header, "kind": "state_dict", "files": files,
                           "tensors": tensors, "tree": {"d": items}, "ranks": ranks})


def rank_slice(man: dict[str, Any], rank: int) -> tuple[range, range, range]:
    """``(files, tensors, keys)`` of rank ``rank`` in a manifest (one rank: all of them).

    Raises:
        ValueError: no such rank in this step.
    """
    ranks = man.get("ranks") or [{"files": len(man["files"]), "tensors": len(man["tensors"]), "keys": None}]
    if not 0 <= rank < len(ranks):
        raise ValueError(f"{man.get('url')} was saved by {len(ranks)} rank(s); there is no rank {rank}")
    f0 = sum(r["files"] for r in ranks[:rank])
    t0 = sum(r["tensors"] for r in ranks[:rank])
    k0 = sum(r["keys"] or 0 for r in ranks[:rank])
    me = ranks[rank]
    keys = range(k0, k0 + me["keys"]) if me["keys"] is not None else range(0)
    return range(f0, f0 + me["files"]), range(t0, t0 + me["tensors"]), keys

