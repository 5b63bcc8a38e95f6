"""Value types shared by the metadata service, storage servers and clients.

They travel inside message headers as plain msgpack maps (``to_wire``) and are
rebuilt with validation on the other side (``from_wire``).
"""

from __future__ import annotations

import operator
import stat as _stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from ._build import positional_builder
from ._errors import ErrorCode, StripefsError

__all__ = [
    "Layout",
    "Attr",
    "DirEntry",
    "ServerInfo",
    "Routing",
    "MAX_NAME",
    "MAX_PATH",
    "MIN_CHUNK",
    "MAX_CHUNK",
    "MAX_STRIPE",
    "MAX_FILE_SIZE",
    "MAX_XATTR_NAME",
    "MAX_XATTR_VALUE",
    "MAX_XATTR_TOTAL",
    "XATTR_NAMESPACES",
    "validate_name",
]

MAX_NAME = 255
MAX_PATH = 4096
MIN_CHUNK = 64 * 1024
MAX_CHUNK = 64 * 1024 * 1024
MAX_STRIPE = 256
MAX_FILE_SIZE = 1 << 50  # 1 PiB: "writes past sane limits" get EFBIG
MAX_XATTR_NAME = 255  # bytes, "user.x" included (Linux's XATTR_NAME_MAX)
MAX_XATTR_VALUE = 64 * 1024  # Linux's XATTR_SIZE_MAX
MAX_XATTR_TOTAL = 1 << 20  # names + values of one inode
XATTR_NAMESPACES = (b"user.", b"trusted.", b"security.")  # system.* (ACLs) would not be enforced


def _bad(msg: str) -> StripefsError:
    return StripefsError(ErrorCode.INVALID, msg)


def validate_name(name: object) -> str:
    """Check one path component. Raises EINVAL / ENAMETOOLONG."""
    if not isinstance(name, str) or name in ("", ".", ".."):
        raise _bad(f"invalid file name {name!r}")
    if "/" in name or "\x00" in name:
        raise _bad(f"file name may not contain '/' or NUL: {name!r}")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME:
        raise StripefsError(ErrorCode.NAME_TOO_LONG, f"name longer than {MAX_NAME} bytes")
    return name


@dataclass(frozen=True, slots=True)
class Layout:
    """How a file's bytes are spread: chunk ``i`` lives on chain ``chains[i % stripe]``.

    ``chains`` is the per-file shuffled list of chain ids (3FS ChainAllocator);
    ``stripe == len(chains)``.
    """

    chunk_size: int
    chains: tuple[int, ...]

    @property
    def stripe(self) -> int:
        return len(self.chains)

    def chain_of(self, chunk_index: int) -> int:
        return self.chains[chunk_index % len(self.chains)]

    def validate(self) -> "Layout":
        cs = self.chunk_size
        if not isinstance(cs, int) or cs < MIN_CHUNK or cs > MAX_CHUNK or cs & (cs - 1):
            raise _bad(f"chunk size must be a power of two in [{MIN_CHUNK}, {MAX_CHUNK}], got {cs!r}")
        if not self.chains or len(self.chains) > MAX_STRIPE:
            raise _bad(f"stripe must be 1..{MAX_STRIPE}")
        if not all(isinstance(c, int) and c >= 0 for c in self.chains):
            raise _bad("chain ids must be non-negative integers")
        return self

    def to_wire(self) -> dict:
        return {"chunk_size": self.chunk_size, "chains": list(self.chains)}

    @classmethod
    def from_wire(cls, d: object) -> "Layout":
        """Rebuild and validate a layout map (``to_wire``). Raises EINVAL for a bad one."""
        if type(d) is dict:
            fast = _layout_fast(d)
            if fast is not None:
                return fast
        return cls._from_wire_checked(d)

    @classmethod
    def _from_wire_checked(cls, d: object) -> "Layout":
        if not isinstance(d, dict):
            raise _bad("layout must be a map")
        try:
            return cls(int(d["chunk_size"]), tuple(int(c) for c in d["chains"])).validate()
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int() of an infinity
            raise _bad(f"bad layout: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Attr:
    """Inode attributes (``stat`` fields). Times are integer nanoseconds."""

    ino: int
    mode: int  # full st_mode, type bits included
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    layout: Layout | None = None
    target: str | None = None  # symlink target
    rdev: int = 0  # device number of a character or block device node
    # How many times the size was set (truncate, O_TRUNC): the storage servers then
    # dropped the bytes past it, including bytes written but not committed yet.
    # A writer's length commit names the count it last saw (CommitLength.truncations).
    truncations: int = 0

    @property
    def is_dir(self) -> bool:
        return _stat.S_ISDIR(self.mode)

    @property
    def is_file(self) -> bool:
        return _stat.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return _stat.S_ISLNK(self.mode)

    def to_wire(self) -> dict:
        # Field by field: dataclasses.asdict deep-copies the layout's chain tuple and cost
        # ~100x more (it was the largest single cost of answering a stat).
        return {
            "ino": self.ino, "mode": self.mode, "nlink": self.nlink, "uid": self.uid, "gid": self.gid,
            "size": self.size, "atime_ns": self.atime_ns, "mtime_ns": self.mtime_ns, "ctime_ns": self.ctime_ns,
            "layout": self.layout.to_wire() if self.layout else None, "target": self.target, "rdev": self.rdev,
            "truncations": self.truncations,
        }

    @classmethod
    def from_wire(cls, d: object) -> "Attr":
        """Rebuild an attribute map (``to_wire``). Raises EINVAL for a bad one."""
        if type(d) is dict:
            fast = _attr_fast(d)
            if fast is not None:
                return fast
        return cls._from_wire_checked(d)

    @classmethod
    def _from_wire_checked(cls, d: object) -> "Attr":
        if not isinstance(d, dict):
            raise _bad("attr must be a map")
        try:
            layout = d.get("layout")
            return cls(
                ino=int(d["ino"]),
                mode=int(d["mode"]),
                nlink=int(d["nlink"]),
                uid=int(d["uid"]),
                gid=int(d["gid"]),
                size=int(d["size"]),
                atime_ns=int(d["atime_ns"]),
                mtime_ns=int(d["mtime_ns"]),
                ctime_ns=int(d["ctime_ns"]),
                layout=Layout.from_wire(layout) if layout is not None else None,
                target=d.get("target"),
                rdev=int(d.get("rdev", 0)),
                truncations=int(d.get("truncations", 0)),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int() of an infinity
            raise _bad(f"bad attr: {exc}") from exc


@dataclass(frozen=True, slots=True)
class DirEntry:
    name: str
    ino: int
    mode: int  # type bits at least; full mode when attrs were asked for
    attr: Attr | None = None

    def to_wire(self) -> list:
        return [self.name, self.ino, self.mode, self.attr.to_wire() if self.attr else None]

    @classmethod
    def from_wire(cls, d: object) -> "DirEntry":
        """Rebuild an entry from ``[name, ino, mode, attr or None]``.

        A bad one raises EINVAL, or the TypeError/ValueError/OverflowError of a
        conversion (``decode_reply`` reports either as PROTOCOL).
        """
        if (type(d) is list or type(d) is tuple) and len(d) == 4:  # type: ignore[arg-type]
            name, ino, mode, attr = d  # type: ignore[misc]
            if type(name) is str and type(ino) is int and type(mode) is int:
                if attr is None:
                    return _new_dir_entry(name, ino, mode, None)  # type: ignore[no-any-return]
                fast = _attr_fast(attr) if type(attr) is dict else None
                if fast is not None:
                    return _new_dir_entry(name, ino, mode, fast)  # type: ignore[no-any-return]
        return cls._from_wire_checked(d)

    @classmethod
    def _from_wire_checked(cls, d: object) -> "DirEntry":
        if not isinstance(d, (list, tuple)) or len(d) != 4:
            raise _bad("dir entry must be a 4-list")
        return cls(str(d[0]), int(d[1]), int(d[2]), Attr.from_wire(d[3]) if d[3] is not None else None)


# --- fast paths of from_wire ---------------------------------------------------------------
# A client rebuilds an Attr per reply and one per entry of a readdir page. When every value
# already has the exact type msgpack yields, these build the object without conversions;
# anything else (a missing key, a float, a bool, a string) returns None and the checked
# from_wire decides, so both accept and reject the same maps.

_new_layout = positional_builder(Layout)
_new_attr = positional_builder(Attr)
_new_dir_entry = positional_builder(DirEntry)
_ATTR_INTS = operator.itemgetter("ino", "mode", "nlink", "uid", "gid", "size", "atime_ns", "mtime_ns", "ctime_ns")


def _layout_fast(d: dict) -> Layout | None:
    cs = d.get("chunk_size")
    chains = d.get("chains")
    if type(cs) is not int or (type(chains) is not list and type(chains) is not tuple):
        return None
    if not MIN_CHUNK <= cs <= MAX_CHUNK or cs & (cs - 1) or not 0 < len(chains) <= MAX_STRIPE:  # type: ignore[arg-type]
        return None
    for c in chains:  # type: ignore[union-attr]
        if type(c) is not int or c < 0:
            return None
    return _new_layout(cs, tuple(chains))  # type: ignore[arg-type]


def _attr_fast(d: dict) -> Attr | None:
    try:
        ino, mode, nlink, uid, gid, size, atime_ns, mtime_ns, ctime_ns = _ATTR_INTS(d)
    except KeyError:
        return None
    rdev = d.get("rdev", 0)
    truncations = d.get("truncations", 0)
    if not (type(ino) is int and type(mode) is int and type(nlink) is int and type(uid) is int
            and type(gid) is int and type(size) is int and type(atime_ns) is int and type(mtime_ns) is int
            and type(ctime_ns) is int and type(rdev) is int and type(truncations) is int):
        return None
    layout = d.get("layout")
    if layout is not None:
        layout = _layout_fast(layout) if type(layout) is dict else None
        if layout is None:
            return None
    return _new_attr(ino, mode, nlink, uid, gid, size, atime_ns, mtime_ns, ctime_ns, layout, d.get("target"), rdev,
                     truncations)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """A storage server (one target directory) as the metadata service knows it."""

    server_id: int
    host: str
    port: int
    state: str = "serving"  # serving | offline
    capacity: int = 0
    used: int = 0
    pid: int = 0
    last_seen: float = 0.0

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: object) -> "ServerInfo":
        if not isinstance(d, dict):
            raise _bad("server info must be a map")
        try:
            return cls(**{k: d[k] for k in d if k in cls.__dataclass_fields__})
        except TypeError as exc:
            raise _bad(f"bad server info: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Routing:
    """The chain table.

    ``chains``: chain id -> the *serving* targets in chain order (head first,
    tail last): clients write to the head and read from any of them.
    ``members``: chain id -> every target with its state (``serving``,
    ``syncing``, ``offline``), which storage servers use to forward writes
    (syncing targets receive writes at the end of the chain while they catch up).
    """

    version: int
    chains: dict[int, tuple[int, ...]] = field(default_factory=dict)
    servers: dict[int, ServerInfo] = field(default_factory=dict)
    members: dict[int, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    replicas: int = 1

    def forward_order(self, chain: int) -> list[int]:
        """Targets a write visits: serving ones in order, then syncing ones."""
        ms = self.members.get(chain, ())
        return [t for t, st in ms if st == "serving"] + [t for t, st in ms if st == "syncing"]

    def to_wire(self) -> dict:
        return {
            "version": self.version,
            "chains": [[cid, list(t)] for cid, t in sorted(self.chains.items())],
            "servers": [s.to_wire() for s in self.servers.values()],
            "members": [[cid, [list(m) for m in ms]] for cid, ms in sorted(self.members.items())],
            "replicas": self.replicas,
        }

    @classmethod
    def from_wire(cls, d: object) -> "Routing":
        if not isinstance(d, dict):
            raise _bad("routing must be a map")
        try:
            chains = {int(c): tuple(int(t) for t in ts) for c, ts in d["chains"]}
            servers = {s.server_id: s for s in (ServerInfo.from_wire(x) for x in d["servers"])}
            members = {int(c): tuple((int(t), str(st)) for t, st in ms) for c, ms in d.get("members", [])}
            return cls(int(d["version"]), chains, servers, members, int(d.get("replicas", 1)))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int() of an infinity
            raise _bad(f"bad routing: {exc}") from exc


# --- listing pages by columns ---------------------------------------------------------------
# A page of a listing travels as one list per field rather than a map per entry: msgpack
# packs and unpacks a few long lists of ints far faster than hundreds of small maps, and
# the receiver rebuilds the entries with one C-level map() per field (docs/protocol.md,
# "Listing pages"). A plus page (every entry with its attributes) adds one column per
# attribute field; "target" and "layout" only when some entry has one.

_COLUMN_INT64 = (-(1 << 63), 1 << 63)
_ENTRY_COLUMNS = ("name", "ino", "mode")
_ATTR_COLUMNS = ("nlink", "uid", "gid", "size", "atime_ns", "mtime_ns", "ctime_ns", "rdev", "truncations")
_ALL_COLUMNS = frozenset((*_ENTRY_COLUMNS, *_ATTR_COLUMNS, "target", "layout"))


def dir_columns(entries: list[DirEntry]) -> dict[str, list] | None:
    """``entries`` as columns (their wire form in a listing page), or None when they do not
    fit one: some with attributes and some without, or attributes that disagree with
    their entry's inode or mode (the sender then uses a map per entry)."""
    columns: dict[str, list] = {"name": [e.name for e in entries], "ino": [e.ino for e in entries],
                                "mode": [e.mode for e in entries]}
    attrs = [e.attr for e in entries]
    if not entries or attrs[0] is None:
        return columns if all(a is None for a in attrs) else None
    if None in attrs or any(a.ino != e.ino or a.mode != e.mode for a, e in zip(attrs, entries)):  # type: ignore[union-attr]
        return None
    ints = [list(map(operator.attrgetter(name), attrs)) for name in _ATTR_COLUMNS]
    return ListingPage.of_rows(columns["name"], columns["ino"], columns["mode"], ints,
                               [a.layout for a in attrs], [a.target for a in attrs]).wire  # type: ignore[union-attr]


def _column(columns: dict, name: str, n: int | None) -> list:
    col = columns.get(name)
    if type(col) is not list and type(col) is not tuple:
        raise _bad(f"listing column {name!r} is missing or not a list")
    if n is not None and len(col) != n:  # type: ignore[arg-type]
        raise _bad(f"listing column {name!r} has {len(col)} values for {n} entries")  # type: ignore[arg-type]
    return col  # type: ignore[return-value]


def _int_column(columns: dict, name: str, n: int) -> list:
    col = _column(columns, name, n)
    if col and (not set(map(type, col)) <= {int} or min(col) < _COLUMN_INT64[0] or max(col) >= _COLUMN_INT64[1]):
        raise _bad(f"listing column {name!r} holds a value that is not a 64-bit integer")
    return col


def _layout_column(given: list) -> list[Layout | None]:
    """A listing page's layouts, each checked as ``Layout.from_wire`` checks it (a file's
    layout is its own: a shuffled window of chains, so there is nothing to share)."""
    return [None if lo is None else (type(lo) is dict and _layout_fast(lo)) or Layout.from_wire(lo) for lo in given]


def dir_entries_from_columns(columns: object) -> list[DirEntry]:
    """Rebuild a listing page from :func:`dir_columns`' form, checking every value's type.

    Raises:
        StripefsError: EINVAL for a bad page (a missing, short or mistyped column, or an
            unknown one).
    """
    return ListingPage.from_columns(columns).entries()


class ListingPage:
    """A listing page in :func:`dir_columns`' form, every value checked as it is taken
    (:meth:`from_columns`), its entries made all at once (:meth:`entries`) or one at a
    time (:meth:`entry`): a client that keeps a large listing to answer lookups from it
    (a FUSE daemon) makes only the entries it is asked for -- making a thousand took ~2 ms
    of the daemon's loop, which every request waited for."""

    __slots__ = ("names", "_inos", "_modes", "_attrs", "_made", "wire")

    def __init__(self, names: list[str], inos: list[int], modes: list[int], attrs: tuple[list, ...] | None,
                 made: list[DirEntry] | None = None, wire: dict[str, list] | None = None):
        self.names = names
        self._inos = inos
        self._modes = modes
        self._attrs = attrs  # nlink .. truncations (_ATTR_COLUMNS), then layouts and targets; None: no attributes
        self._made = made  # the entries themselves (a page that came as a map per entry)
        self.wire = wire  # the page in dir_columns' form, when the sender made it so (no entries made to send it)

    @classmethod
    def of(cls, entries: list[DirEntry]) -> ListingPage:
        """A page of entries already made."""
        return cls([e.name for e in entries], [], [], None, entries)

    @classmethod
    def from_columns(cls, columns: object) -> ListingPage:
        """Check a page by columns (every value's type, every column's length).

        Raises:
            StripefsError: EINVAL for a bad page (a missing, short or mistyped column, or
                an unknown one).
        """
        if type(columns) is not dict:
            raise _bad("listing columns must be a map")
        unknown = set(columns) - _ALL_COLUMNS
        if unknown:
            raise _bad(f"unknown listing columns {sorted(map(str, unknown))}")
        names = _column(columns, "name", None)
        n = len(names)
        if n and not set(map(type, names)) <= {str}:
            raise _bad("listing column 'name' holds a value that is not a string")
        inos, modes = _int_column(columns, "ino", n), _int_column(columns, "mode", n)
        if "nlink" not in columns:
            if len(columns) != len(_ENTRY_COLUMNS):
                raise _bad("listing columns: attribute columns without 'nlink'")
            return cls(names, inos, modes, None)
        ints = [_int_column(columns, name, n) for name in _ATTR_COLUMNS]
        targets = columns.get("target")
        if targets is None:
            targets = [None] * n
        else:
            targets = _column(columns, "target", n)
            if not set(map(type, targets)) <= {str, type(None)}:
                raise _bad("listing column 'target' holds a value that is neither a string nor nil")
        layouts = columns.get("layout")
        if layouts is None:
            layouts = [None] * n
        else:
            given = _column(columns, "layout", n)
            try:
                layouts = _layout_column(given)
            except StripefsError as exc:
                raise _bad(f"listing column 'layout': {exc.message}") from None
        return cls(names, inos, modes, (*ints, layouts, targets))

    @classmethod
    def of_rows(cls, names: list[str], inos: list[int], modes: list[int], ints: list[list[int]],
                layouts: list[Layout | None], targets: list[str | None]) -> ListingPage:
        """A page with attributes made by a sender from its own columns (a store's rows,
        or :func:`dir_columns`' entries): ``ints`` in :data:`_ATTR_COLUMNS`' order; its
        wire form made at once (``target`` and ``layout`` only when some entry has one)."""
        wire: dict[str, list] = {"name": names, "ino": inos, "mode": modes}
        if names:
            wire.update(zip(_ATTR_COLUMNS, ints))
            if any(t is not None for t in targets):
                wire["target"] = targets
            if any(lo is not None for lo in layouts):
                wire["layout"] = [None if lo is None else lo.to_wire() for lo in layouts]
        return cls(names, inos, modes, (*ints, layouts, targets) if names else None, wire=wire)

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[DirEntry]:
        return iter(self.entries())

    def file_inos(self) -> list[int]:
        """The inodes of the page's entries that are not directories."""
        if self._made is not None:
            return [e.ino for e in self._made if not _stat.S_ISDIR(e.mode)]
        return [ino for ino, mode in zip(self._inos, self._modes) if not _stat.S_ISDIR(mode)]

    def entries(self) -> list[DirEntry]:
        """Every entry of the page, in order."""
        if self._made is not None:
            return list(self._made)
        names, inos, modes, a = self.names, self._inos, self._modes, self._attrs
        if a is None:
            return list(map(_new_dir_entry, names, inos, modes, [None] * len(names)))
        nlink, uid, gid, size, atime, mtime, ctime, rdev, truncations, layouts, targets = a
        attrs = list(map(_new_attr, inos, modes, nlink, uid, gid, size, atime, mtime, ctime, layouts, targets,
                         rdev, truncations))
        return list(map(_new_dir_entry, names, inos, modes, attrs))

    def entry(self, i: int) -> DirEntry:
        """Entry ``i`` of the page (``names[i]``'s)."""
        if self._made is not None:
            return self._made[i]
        ino, mode, a = self._inos[i], self._modes[i], self._attrs
        if a is None:
            return _new_dir_entry(self.names[i], ino, mode, None)  # type: ignore[no-any-return]
        nlink, uid, gid, size, atime, mtime, ctime, rdev, truncations, layouts, targets = a
        attr = _new_attr(ino, mode, nlink[i], uid[i], gid[i], size[i], atime[i], mtime[i], ctime[i], layouts[i],
                         targets[i], rdev[i], truncations[i])
        return _new_dir_entry(self.names[i], ino, mode, attr)  # type: ignore[no-any-return]
