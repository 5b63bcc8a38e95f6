"""Where a namespace lives on the cluster, and opening (or creating) it.

A namespace ``NS`` under the store's root (``/.kvcache`` by default)::

    /.kvcache/NS/            xattr user.kvcache.page_size: fixed when the namespace is made
    /.kvcache/NS/seg/        live segments (their chunk size set to suit the page size)
    /.kvcache/NS/idx/        one symlink per key: name = key hex, target = page location
    /.kvcache/NS/retired/    evicted segments, kept until no reader can be using them
    /.kvcache/NS/tmp/        index entries on their way to replace an existing one (writers before
                             SymlinkMany replaced in place; still swept)
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

from stripefs.fsclient import Client
from stripefs.wire import MAX_CHUNK, MIN_CHUNK, ErrorCode, StripefsError, validate_name

__all__ = ["Namespace", "NamespaceInfo", "namespaces", "open_namespace", "PAGE_SIZE_XATTR", "ROOT"]

PAGE_SIZE_XATTR = "user.kvcache.page_size"
ROOT = "/.kvcache"  # where namespaces live unless a store is given another root
DEFAULT_CHUNK_MAX = 4 << 20  # the largest chunk size the store picks for its segments


@dataclass(frozen=True, slots=True)
class Namespace:
    """The paths (and directory inodes) of one namespace."""

    dir: str
    seg_ino: int
    idx_ino: int
    retired_ino: int
    tmp_ino: int

    @property
    def seg(self) -> str:
        return f"{self.dir}/seg"

    @property
    def idx(self) -> str:
        return f"{self.dir}/idx"

    @property
    def retired(self) -> str:
        return f"{self.dir}/retired"

    @property
    def tmp(self) -> str:
        return f"{self.dir}/tmp"

    def seg_path(self, name: str) -> str:
        return f"{self.dir}/seg/{name}"

    def idx_path(self, key_hex: str) -> str:
        return f"{self.dir}/idx/{key_hex}"


def segment_chunk_size(page_size: int) -> int:
    """The largest power of two that divides the page size, within [64 KiB, 4 MiB]: pages
    then start on chunk boundaries and a page of up to 4 MiB is one request per chunk."""
    low = page_size & -page_size
    return max(MIN_CHUNK, min(low, DEFAULT_CHUNK_MAX, MAX_CHUNK))


def open_namespace(client: Client, root: str, name: str, page_size: int) -> Namespace:
    """Open namespace ``name`` under ``root``, creating it with ``page_size`` if it is new.

    Raises:
        StripefsError: EINVAL for a bad name, or when the namespace exists with another
            page size (every client of a namespace must agree on it).
    """
    validate_name(name)
    top = posixpath.join(root, name)
    client.makedirs(top)
    try:
        client.setxattr(top, PAGE_SIZE_XATTR, str(page_size).encode(), os.XATTR_CREATE)
    except FileExistsError:
        pass
    stored = int(client.getxattr(top, PAGE_SIZE_XATTR))
    if stored != page_size:
        raise StripefsError(ErrorCode.INVALID, f"namespace {name!r} holds pages of {stored} bytes, not {page_size}", top)
    inos = []
    for sub in ("seg", "idx", "retired", "tmp"):
        path = f"{top}/{sub}"
        attr = client.mkdir(path, 0o755, exist_ok=True)
        if sub == "seg":  # every opener sets the same value: no race to lose
            client.set_layout(path, chunk_size=segment_chunk_size(page_size))
        inos.append(attr.ino)
    return Namespace(top, *inos)


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """What ``stripefs status`` shows of a namespace: its page size and live occupancy."""

    name: str
    page_size: int
    segments: int
    pages: int
    retired: int  # evicted segments waiting for their grace before they are freed

    @property
    def occupancy_bytes(self) -> int:
        return self.pages * self.page_size


def namespaces(client: Client, root: str = ROOT) -> list[NamespaceInfo]:
    """Every namespace under ``root`` (none when it does not exist), read-only: one
    listing of ``root`` and of each namespace's ``seg/`` and ``retired/``."""
    from ._format import BadRecord, segment_pages

    try:
        names = sorted(client.listdir(root))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        top = posixpath.join(root, name)
        try:
            page_size = int(client.getxattr(top, PAGE_SIZE_XATTR))
            segs = [e.name for e in client.scandir(f"{top}/seg", attrs=False)]
            retired = len(client.listdir(f"{top}/retired"))
        except (OSError, ValueError):
            continue  # not a namespace (or one being made): left out
        pages = 0
        for seg in segs:
            try:
                pages += segment_pages(seg)
            except BadRecord:
                continue
        out.append(NamespaceInfo(name, page_size, len(segs), pages, retired))
    return out
