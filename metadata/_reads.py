"""Read plans: which ``Namespace`` method answers each read request, and what it costs.

A plan names the method, its arguments, the most it costs (in ``INLINE_COST``'s units:
~0.5 us, what one name of a listing costs, ``_commit.py``) and the reply made of its
result. The cost decides where the read runs (``CommitPath.read``): at once on the
trio loop when the arguments bound it below ``INLINE_COST``, else on the reader thread.
The plans of the reads that may ask for an attribute lease (:data:`LEASED`) also collect
the store keys their answer depends on, for ``_lease_grants.py``.
"""

from __future__ import annotations

from typing import Any, Callable

from stripefs.wire import Attr, ReplyMessage, StripefsError
from stripefs.wire import messages as m

from ._commit import INLINE_COST
from ._namespace import Namespace

__all__ = ["ReadPlan", "READS", "LEASED", "path_cost", "many_reply"]

STATEMENT_COST = 16  # one point query (a dentry, an inode)
NAME_COST = 1  # one name of a ListNames page
ENTRY_COST = 2  # one entry of a Readdir page
ENTRY_PLUS_COST = 14  # one entry of a Readdir page with attributes


def many_reply(found: list[Attr | StripefsError]) -> m.StatManyReply:
    """The reply to a batch of paths: the attributes that came back, the indexes and codes of the errors."""
    failed = [i for i, a in enumerate(found) if isinstance(a, StripefsError)]
    return m.StatManyReply([a for a in found if not isinstance(a, StripefsError)], failed,
                           [int(found[i].code) for i in failed])  # type: ignore[union-attr]


def _page_reply(kind: Callable[[list[Any], bool], ReplyMessage]) -> Callable[[tuple[Any, Any]], ReplyMessage]:
    return lambda page: kind(list(page[0]), bool(page[1]))


def path_cost(path: str) -> int:
    """What resolving ``path`` costs: a statement per component and one for the inode
    (symlinks met on the way add theirs: at most 40 of them, see ``Namespace.resolve``)."""
    return (path.count("/") + 2) * STATEMENT_COST if type(path) is str else INLINE_COST + 1


ReadPlan = tuple[Callable[..., Any], tuple[Any, ...], int, Callable[[Any], ReplyMessage]]

# The read requests: the ``Namespace`` method answering one, its arguments, what it costs at
# most (``INLINE_COST`` units) and the reply made of its result.
READS: dict[type, Callable[[Any], ReadPlan]] = {
    m.GetAttr: lambda q: (Namespace.getattr, (q.ino,), STATEMENT_COST, m.AttrReply),
    m.Lookup: lambda q: (Namespace.lookup, (q.parent, q.name), 3 * STATEMENT_COST, m.AttrReply),
    m.Resolve: lambda q: (Namespace.resolve, (q.path, q.follow), path_cost(q.path), m.AttrReply),
    m.StatMany: lambda q: (Namespace.resolve_many, (list(q.paths), q.follow), sum(map(path_cost, q.paths)),
                           many_reply),
    m.ListNames: lambda q: (Namespace.list_names, (q.path, q.after, q.limit), path_cost(q.path) + q.limit * NAME_COST,
                            _page_reply(m.NamesReply)),
    m.Readdir: lambda q: (Namespace.readdir, (q.ino, q.after, q.limit, q.plus, q.layouts),
                          STATEMENT_COST + q.limit * (ENTRY_PLUS_COST if q.plus else ENTRY_COST),
                          _page_reply(m.ReaddirReply)),
    m.GetXattr: lambda q: (Namespace.getxattr, (q.ino, q.name), 2 * STATEMENT_COST, m.XattrReply),
    m.ListXattr: lambda q: (Namespace.listxattr, (q.ino,), 2 * STATEMENT_COST, m.XattrNamesReply),
    m.Readlink: lambda q: (Namespace.readlink, (q.ino,), STATEMENT_COST, m.ReadlinkReply),
    m.GetLayout: lambda q: (Namespace.get_layout, (q.ino,), 2 * STATEMENT_COST, m.LayoutReply),
}

# The reads that may ask for an attribute lease: the ``Namespace`` method, its arguments
# (``keys``, filled with what the answer depends on, last: one list per path for
# ``StatMany``, the walk to the directory for ``ListNames``) and its cost. A ``Readdir``
# page depends on its directory's inode alone: its plan fills no keys; one with attributes
# and layouts (a listing fetched to answer lookups from) is read as a page by columns.
LEASED: dict[type, Callable[[Any, list[Any]], tuple[Callable[..., Any], tuple[Any, ...], int]]] = {
    m.Resolve: lambda q, keys: (Namespace.resolve, (q.path, q.follow, keys), path_cost(q.path)),
    m.Lookup: lambda q, keys: (Namespace.lookup, (q.parent, q.name, keys), 3 * STATEMENT_COST),
    m.GetAttr: lambda q, keys: (Namespace.getattr, (q.ino, keys), STATEMENT_COST),
    m.StatMany: lambda q, keys: (Namespace.resolve_many, (list(q.paths), q.follow, keys),
                                 sum(map(path_cost, q.paths))),
    m.ListNames: lambda q, keys: (Namespace.list_names, (q.path, q.after, q.limit, keys),
                                  path_cost(q.path) + q.limit * NAME_COST),
    m.Readdir: lambda q, keys: ((Namespace.readdir_page, (q.ino, q.after, q.limit), READS[m.Readdir](q)[2])
                                if q.plus and q.layouts else READS[m.Readdir](q)[:3]),
}
