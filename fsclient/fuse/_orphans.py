"""Open-but-unlinked files of this mount (:class:`Orphans`): the hidden names that keep
them alive, and the clean-up of those a dead daemon left behind.

Unlinking (or renaming over) the last name of a file open in this mount would let the
metadata service free its chunks under the open handles. So the daemon does what NFS
clients do ("silly rename"): first it links the file into ``/.stripefs-orphans`` as
``<ino>@<host>@<pid>.<start>@<random>`` (:meth:`Orphans.keep_if_open`); the last
``release`` removes that name (:meth:`Orphans.remove`). A daemon killed with such files
open leaves their names behind: the next mount on the same host removes those whose
daemon no longer runs (:meth:`Orphans.clean`), judged by the pid *and* its start time.

Caveats:

* Only this mount's handles are known: a file open in another mount loses its data
  when the last name goes (the metadata service cannot know those handles).
* Orphans of a dead daemon on another host stay until a mount on that host cleans up.
"""

from __future__ import annotations

import os
import socket

import pyfuse3

from stripefs.wire import Attr, messages as m

from ..core import AsyncClient, pid_alive
from ._dirattrs import DirAttrs
from ._dirhandle import READDIR_PAGE
from ._listings import Listings
from ._mounts import process_start
from ._openfile import OpenFile

__all__ = ["ORPHAN_DIR", "Orphans"]

ORPHAN_DIR = ".stripefs-orphans"


class Orphans:
    """The hidden names this mount gives open files losing their last name.

    Args:
        aio: the daemon's client, on its trio loop.
        dir_attrs: the daemon's kept directory attributes (the orphan directory's change).
        listings: the daemon's kept listings and names (the changed link counts and names).
    """

    def __init__(self, aio: AsyncClient, dir_attrs: DirAttrs, listings: Listings):
        self.aio = aio
        self.dir_attrs = dir_attrs
        self.listings = listings
        # host@pid.start@random: the pid's start time tells a later mount whether this very
        # daemon still runs (a pid alone may have been reused; see clean).
        self.mount_id = f"{socket.gethostname()}@{os.getpid()}.{process_start(os.getpid())}@{os.urandom(3).hex()}"
        self.ino: int | None = None  # ORPHAN_DIR's inode, once made or found

    async def directory(self) -> int:
        """The inode of ORPHAN_DIR, made now if it does not exist yet."""
        if self.ino is None:
            try:
                attr = await self.aio.attr(m.Mkdir(parent=pyfuse3.ROOT_INODE, name=ORPHAN_DIR, mode=0o700))
                self.dir_attrs.drop(pyfuse3.ROOT_INODE)  # its link count and times changed
                self.listings.drop(pyfuse3.ROOT_INODE)
                self.listings.added(pyfuse3.ROOT_INODE, ORPHAN_DIR)
            except FileExistsError:
                attr = await self.aio.attr(m.Lookup(parent=pyfuse3.ROOT_INODE, name=ORPHAN_DIR))
            self.ino = attr.ino
        return self.ino

    async def keep_if_open(self, state: OpenFile | None, victim: Attr) -> bool:
        """Silly rename: give an open file losing its last name a hidden one.

        Args:
            state: the victim's open state in this mount (None: not open here).
            victim: the attributes of the file about to lose a name.

        Returns:
            Whether a hidden name was made (to be taken back with :meth:`unkeep` if the
            unlink or rename then fails).
        """
        if state is None or state.orphan is not None or not victim.is_file or victim.nlink != 1:
            return False
        name = f"{victim.ino}@{self.mount_id}"  # host@pid: a later mount can tell it is stale
        orphans = await self.directory()
        try:
            await self.aio.call(m.Link(ino=victim.ino, new_parent=orphans, new_name=name))
        finally:
            self.dir_attrs.drop(orphans)
            self.listings.clear()  # the victim's link count
            self.listings.forget_names(orphans)
        state.orphan = name
        return True

    async def unkeep(self, state: OpenFile | None, linked: bool) -> None:
        """Take back the hidden name :meth:`keep_if_open` made (``linked``) for ``state``."""
        if linked and state is not None and state.orphan is not None:
            name, state.orphan = state.orphan, None
            await self.aio.call(m.Unlink(parent=await self.directory(), name=name))

    async def remove(self, name: str) -> None:
        """Remove the hidden name ``name``: the last handle of its file is closed."""
        await self.aio.call(m.Unlink(parent=await self.directory(), name=name))
        self.listings.drop(self.ino or 0)
        self.listings.forget_names(self.ino or 0)

    async def clean(self) -> int:
        """Remove orphans that dead daemons of this host left behind. Returns how many."""
        try:
            d = await self.aio.attr(m.Lookup(parent=pyfuse3.ROOT_INODE, name=ORPHAN_DIR))
        except FileNotFoundError:
            return 0
        self.ino = d.ino
        host, removed, after = socket.gethostname(), 0, ""
        while True:
            reply = await self.aio.call(m.Readdir(ino=d.ino, after=after, limit=READDIR_PAGE))
            names = [e.name for e in reply.entries]
            for name in names:
                parts = name.split("@")
                if len(parts) >= 4 and parts[-3] == host and not _owner_alive(parts[-2]):
                    await self.aio.call(m.Unlink(parent=d.ino, name=name))
                    self.listings.drop(d.ino)
                    self.listings.removed(d.ino, name)
                    removed += 1
            if not reply.more or not names:
                return removed
            after = names[-1]


def _owner_alive(owner: str) -> bool:
    """Is the daemon named ``owner`` in an orphan name (``PID.START``) still running?

    The start time identifies the process, whatever its command line (``stripefs mount
    --foreground`` serves in the ``stripefs`` process itself) and even if the pid was
    reused since. Names of older daemons carry the pid alone: those are kept while any
    process has that pid (keeping a stale orphan is harmless, removing a live one is not).
    Anything unparsable is kept.
    """
    pid, dot, start = owner.partition(".")
    if not pid.isdigit():
        return True
    if not dot:
        return pid_alive(int(pid))
    if not start.isdigit():
        return True
    return process_start(int(pid)) == int(start)
