"""An open directory's handle (:class:`DirHandle`): the listing pages it served and the
offsets it gave the kernel, so that a listing resumes right after any of them.

Where the pages come from (the daemon's kept listings, or a ``Readdir`` now) and what
each entry tells the kernel is the kernel operations' business (``_operations.py``).
"""

from __future__ import annotations

from ._listings import Page

__all__ = ["DirHandle", "OFFSET_BITS", "READDIR_PAGE"]

READDIR_PAGE = 1000  # entries one Readdir request asks the metadata service for
OFFSET_BITS = 20  # a readdir offset is (page serial << OFFSET_BITS) + 1 + the entry's position in it


class DirHandle:
    """A directory handle: the pages it listed, the offsets given to the kernel, its page.

    The metadata service lists a directory in name order, a page at a time, resuming
    ``after`` a name. Each offset handed to the kernel stands for "after this entry of
    this page" (offset 0: from the start; see :data:`OFFSET_BITS`), so a listing resumed
    at any offset -- the next ``getdents``, or a ``seekdir`` back to a ``telldir`` --
    continues right after the entry it stopped at, however the directory changed
    meanwhile: no entry twice, none skipped, and one page fetched rather than the
    listing read again from the start. The handle keeps every page it listed from, so
    that its offsets stay valid until ``closedir``.
    """

    def __init__(self, ino: int):
        self.ino = ino
        self.listed: dict[int, Page] = {}  # serial -> a page this handle listed from
        self.page_after: str | None = None  # the cursor ``page`` was fetched for
        self.page: Page | None = None
        self.kept = False  # ``page`` came from the daemon's kept listings, not this handle's fetch

    def resume(self, offset: int) -> str | None:
        """The name a listing at ``offset`` resumes after ("": from the start), or None
        for an offset this handle never gave out."""
        if offset == 0:
            return ""
        page = self.listed.get(offset >> OFFSET_BITS)
        k = (offset & ((1 << OFFSET_BITS) - 1)) - 1
        if page is None or not 0 <= k < len(page.entries):
            return None
        return page.entries[k].name

    def find(self, after: str) -> int | None:
        """Where the entries after ``after`` start in the page, or None if not there."""
        page = self.page
        if page is None:
            return None
        if after == self.page_after:
            return 0
        i = page.index.get(after)
        if i is None or (i == len(page.entries) - 1 and page.more):
            return None  # not in this page, or its last entry: the next page is needed
        return i + 1

    def set_page(self, after: str, page: Page | None, kept: bool = False) -> None:
        self.page_after, self.page, self.kept = after, page, kept
        if page is not None:
            self.listed[page.serial] = page
