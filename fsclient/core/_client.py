"""The native client: a path API over the metadata service and the striped data path.

``Client`` is synchronous and thread-safe; ``AsyncClient`` exposes the same
operations to trio code (the FUSE daemon) by running them on worker threads,
sharing one :class:`~fsclient.core._core.ClientCore`, which stays private.

Besides the path API, ``Client`` has a small interface by inode for the front
ends (FUSE, fsspec, batch reads, staging, the CLI, benchmarks): typed metadata
calls, attributes and file objects by inode, chunk reads and writes into and
from caller buffers, length commits, the routing table, storage connections and
the shared buffer pool (docs/architecture.md, "The client interface front ends
use").
"""

from __future__ import annotations

import io
import os
import posixpath
import stat as _stat  # Client.stat is a method
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence, TypeVar

import trio

from stripefs.rpc import BufferPool, Connection
from stripefs.wire import MAX_PATH, Attr, DirEntry, ErrorCode, Layout, Message, ReplyMessage, Routing, StripefsError, messages as m

from ._config import ClusterConfig, find_cluster
from ._acall import acall, acall_header, aread_into
from ._attrcache import LISTING_MAX, LISTING_PAGE, AttrCache, DirStreaks
from ._core import ClientCore, seconds_setting
from . import _lease
from ._file import StripeFile, mode_flags
from ._lease import Lease
from ._pending import DEFER
from ._observe import ACCESS_LOG_ENV, CLIENT_METRICS_ENV, observe_client
from ._wholefiles import Reservations, write_files

__all__ = ["Client", "AsyncClient", "normpath", "ROOT_INO"]

ROOT_INO = 1
STAT_MANY_MAX = 200  # paths per StatMany request (the service's limit: both frames fit in 1 MiB)
BATCH_LISTINGS = 4  # listings one stat_many fetches at most (its latency: a few round trips each)
CREATE_MANY_MAX = 200  # paths per CreateMany / UnlinkMany request (the service's limit, likewise)
PREFIX = "stripefs://"
ATTR_TIMEOUT_ENV = "STRIPEFS_ATTR_TIMEOUT"  # the attr_timeout of clients that do not pass one
LEASES_ENV = "STRIPEFS_LEASES"  # the leases setting of clients that do not pass one ("0": off)
R = TypeVar("R", bound=ReplyMessage)


def normpath(path: str) -> str:
    """Canonical absolute path inside the file system.

    Accepts ``stripefs://a/b``, ``/a/b`` and ``a/b``. Raises EINVAL for NUL
    bytes and for ``..`` that would climb above the root.
    """
    if not isinstance(path, str):
        path = os.fspath(path)
    if path.startswith(PREFIX):
        path = path[len(PREFIX):]
    if "\x00" in path:
        raise StripefsError(ErrorCode.INVALID, "path contains NUL", path)
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise StripefsError(ErrorCode.INVALID, "'..' escapes the file system root", path)
            parts.pop()
        else:
            parts.append(part)
    return "/" + "/".join(parts)


_UMASK_LOCK = threading.Lock()
_STATUS: tuple[int, int] | None = None  # (pid, descriptor of that process's /proc status)


def _status_fd() -> int:
    """A descriptor of ``/proc/self/status`` kept open (one per process: ``self`` names the
    process that opened it, so a forked child opens its own)."""
    global _STATUS
    status, pid = _STATUS, os.getpid()
    if status is not None and status[0] == pid:
        return status[1]
    with _UMASK_LOCK:
        if _STATUS is None or _STATUS[0] != pid:
            _STATUS = (pid, os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC))
        return _STATUS[1]


def _umask() -> int:
    """The process umask, read without changing it.

    ``os.umask`` can only read the mask by setting another one, and a file that
    another thread creates in between would get the wrong mode; Linux (4.7+)
    shows the mask in ``/proc/self/status``, read afresh at each call (one
    ``pread`` of a descriptor kept open: half the CPU of opening it each time,
    which every create paid). The set-and-restore fallback is serialised at
    least against this module's own readers.
    """
    try:
        data = os.pread(_status_fd(), 8192, 0)
        at = data.index(b"Umask:") + 6
        return int(data[at:data.index(b"\n", at)], 8) & 0o777
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _collected(core: ClientCore) -> None:
    """A :class:`Client` was collected without ``close()``: close its core on a thread of its
    own (the collection may run on any thread, even one inside a lock the close takes)."""
    try:
        threading.Thread(target=core.close, name="stripefs-client-close", daemon=True).start()
    except RuntimeError:  # the interpreter is going away: no new thread
        core.close()


class Client:
    """Connect to a stripefs cluster.

    Args:
        cluster: a ``cluster.json`` path, ``host:port`` (with ``secret``), or
            None to use ``STRIPEFS_CLUSTER`` / the last ``stripefs up``.
        conns_per_server: pipelined connections per storage server.
        max_inflight: chunk requests in flight per read/write call.
        attr_timeout: seconds ``stat`` (and ``exists``, ``isdir``, ``isfile``) may answer
            from this client's cache when the service grants no lease; 0 asks the
            metadata service every time. None: ``$STRIPEFS_ATTR_TIMEOUT``, else 0. This
            client's own changes show at once; another client's after at most this
            long, or at ``open`` (close-to-open).
        leases: answer ``stat`` (and ``open``) from this client's cache under leases
            the metadata service grants: coherent, every change by any client is seen
            by the next ``stat`` once it returned (a watch thread with a connection of
            its own hears of them). None: ``$STRIPEFS_LEASES`` (``0`` turns them
            off), else on. A service that grants none (``--lease-ttl 0``, several
            services on PostgreSQL) leaves ``attr_timeout`` in charge.
        retry_for: seconds a failing chunk read or write keeps retrying (a server
            down, a chain with no serving target while a server returns) before the
            error reaches the caller, and a metadata request of a client that reached
            the cluster before (a service restarting); None: ``$STRIPEFS_RETRY_FOR``,
            else 30. A client that never reached the cluster and finds nobody at any
            metadata address fails in about a second instead.
        access_log: a file to log every call of the path API to (``stripefs profile``);
            None: ``$STRIPEFS_ACCESS_LOG``, else none. ``$STRIPEFS_CLIENT_METRICS=HOST:PORT``
            serves this process's client metrics (``_observe.py``).
        qos: the traffic class of this client's chunk writes at the storage servers
            (storage/_qos.py): ``interactive`` (the default: writes of 1 MiB and more
            are bulk, smaller ones go first), ``bulk`` (every write yields to small
            ones: a checkpoint writer) or ``background`` (as bulk, and a server runs
            few of them at once: uploads, copies). :attr:`queue_delay` then says how
            long the servers held its writes.
    """

    def __init__(self, cluster: "str | os.PathLike[str] | ClusterConfig | None" = None, *, secret: str | None = None,
                 conns_per_server: int = 2, max_inflight: int = 32, attr_timeout: float | None = None,
                 retry_for: float | None = None, leases: bool | None = None, access_log: str | None = None,
                 qos: str = "interactive"):
        if qos not in m.QOS_CLASSES:
            raise StripefsError(ErrorCode.INVALID, f"qos must be one of {', '.join(m.QOS_CLASSES)}, not {qos!r}")
        self.config = find_cluster(cluster, secret)
        self._core = ClientCore(self.config, conns_per_server=conns_per_server, max_inflight=max_inflight,
                                retry_for=retry_for)
        self._core.qos = m.QOS_CLASSES[qos]
        attr_timeout = seconds_setting(attr_timeout, ATTR_TIMEOUT_ENV, 0.0, "attr_timeout")
        if leases is None:
            leases = os.environ.get(LEASES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
        if attr_timeout > 0 or leases:
            self._core.attrs = AttrCache(attr_timeout)
            self._core.leases = leases
        self._session = os.urandom(16)  # owner of this client's leases
        self._leases: weakref.WeakSet[Lease] = self._core.locks  # released by close, at exit or once collected
        self._reservations = Reservations()  # inode numbers reserved ahead for whole files
        self._streaks = DirStreaks()  # directories read file by file: their files leased by listing
        # Dropped without close(): its watch thread, sockets and leases go when it is
        # collected (nothing of the client's own is kept by them: the finalizer holds the core);
        # at interpreter exit _core's hook gives back the leases of every client still open.
        self._finalizer = weakref.finalize(self, _collected, self._core)
        self._finalizer.atexit = False
        self._core.owner = weakref.ref(self)  # a held Lease keeps its client (_lease.Lease)
        if access_log or os.environ.get(ACCESS_LOG_ENV) or os.environ.get(CLIENT_METRICS_ENV):
            observe_client(self, access_log)  # opt-in: an access log, Prometheus metrics (_observe.py)

    @property
    def queue_delay(self) -> float:
        """Seconds this client's recent chunk writes waited for their slots at the storage
        servers (a moving average of what they reported; 0 for ``qos="interactive"``,
        whose writes are not told): how busy the servers' bulk lanes are for it."""
        return self._core.queue_delay.seconds

    def close(self) -> None:
        """Release this client's leases (locks and attribute leases) and close its connections."""
        self._finalizer.detach()
        self._core.close()

    def lease(self, key: str, ttl: float = 10.0, *, wait: bool = True, timeout: float | None = None) -> Lease:
        """Take the advisory lease lock ``key`` (any text, e.g. a path), renewed while held.

        Args:
            key: what the lease is for; every client naming it competes for it.
            ttl: seconds the lease outlives a holder that stopped renewing (0.1 s-1 h).
            wait: keep trying while another client holds it (else fail at once).
            timeout: give up after this many seconds of waiting (None: forever).

        Returns:
            A :class:`~fsclient.core.Lease` (a context manager) with a fencing ``token``.

        Raises:
            BlockingIOError: held by another client (``wait=False`` or ``timeout`` passed).
        """
        lease = _lease.acquire(self._core, key, self._session, ttl, wait, timeout)
        self._leases.add(lease)
        return lease

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lookups ------------------------------------------------------------------------
    def stat(self, path: str, *, follow: bool = True) -> Attr:
        p = normpath(path)
        cache = self._core.attrs if follow else None
        if cache is not None:
            hit = cache.get(p)
            if hit is not None:
                return hit
        return self._fresh_stat(p, follow)

    def _fresh_stat(self, p: str, follow: bool = True, *, leased_ok: bool = False) -> Attr:
        """``stat`` from the metadata service, or (``leased_ok``) from a leased entry, which
        is current: what ``open`` uses (close-to-open: never a timed entry's length)."""
        cache = self._core.lease_cache() if follow else None
        if cache is None:
            try:
                return self._core.attr(m.Resolve(path=p, follow=follow))
            except StripefsError as exc:
                raise StripefsError(exc.code, exc.message, p) from None
        if leased_ok:
            hit = cache.get(p, leased=True)
            if hit is not None:
                return hit
        token, lease, sent = cache.token(), cache.leasing, time.monotonic()
        try:
            reply = self._core.call(m.Resolve(path=p, follow=follow, lease=lease))
        except StripefsError as exc:
            raise StripefsError(exc.code, exc.message, p) from None
        cache.put(p, reply.attr, token, reply.lease_id, reply.lease_ms, sent)
        if reply.lease_id and reply.attr.is_file:
            directory = posixpath.dirname(p)
            if self._streaks.hit(directory):
                self._lease_files(cache, directory)
        return reply.attr

    def _lease_files(self, cache: AttrCache, directory: str) -> None:
        """Remember the files of ``directory``, whose files are being opened one after
        another, from its listing with attributes and layouts, page by page
        (``LISTING_PAGE`` entries, up to ``LISTING_MAX``), each page under a lease of its own
        (the service leases it on the directory and each file it shows): the opens of the
        others then ask nothing. A page is kept only if nothing changed since the first
        page was asked for (``AttrCache.put_files``, all with the token taken then: what an
        invalidation meanwhile could have made stale is not kept); nothing after an
        error, and no further page of a listing larger than ``LISTING_MAX``."""
        more = False
        try:
            d = self.stat(directory)
            token, after, listed = cache.token(), "", 0
            while True:
                sent = time.monotonic()
                reply = self._core.call(m.Readdir(ino=d.ino, after=after, limit=LISTING_PAGE, plus=True,
                                                  layouts=True, lease=cache.leasing, lease_each_page=cache.leasing))
                cache.put_files(directory, [(e.name, e.attr) for e in reply.entries if e.attr is not None],
                                token, reply.lease_id, reply.lease_ms, sent)
                listed += len(reply.entries)
                if not reply.more or not reply.entries or not reply.lease_id or cache.token() != token:
                    return  # the whole listing, or no page after this one would be kept
                if listed >= LISTING_MAX:
                    more = True
                    return
                after = reply.entries[-1].name
        except StripefsError:
            pass  # the opens ask for their files one by one, as before
        finally:
            self._streaks.done(directory, too_big=more)

    def _from_listings(self, cache: AttrCache, norm: list[str], todo: list[int],
                       out: list[Attr | StripefsError | None]) -> list[int]:
        """``todo`` (indexes of ``norm`` the cache missed) less those a directory's leased
        listing answers now. A batch that misses k files of one directory counts as k
        lookups there (``DirStreaks``, the opens' rule in :meth:`_fresh_stat`), so a
        dataloader's batches over a directory's files cost its listing once instead of a
        ``StatMany`` entry each. At most :data:`BATCH_LISTINGS` listings per call, those
        with the most misses first; a directory due beyond them is fetched no sooner than
        the streaks allow again. Nothing before the client's lease watch is up (a listing
        then would not be kept, and its directory not fetched again for a while)."""
        if not cache.leasing:
            return todo
        dirs = [posixpath.dirname(norm[i]) for i in todo]
        misses: dict[str, int] = {}
        for directory in dirs:
            misses[directory] = misses.get(directory, 0) + 1
        due = [d for d in sorted(misses, key=misses.__getitem__, reverse=True) if self._streaks.hit(d, misses[d])]
        if not due:
            return todo
        for directory in due[BATCH_LISTINGS:]:
            self._streaks.done(directory)
        listed = set(due[:BATCH_LISTINGS])
        for directory in listed:
            self._lease_files(cache, directory)
        left = []
        for i, directory in zip(todo, dirs):
            hit = cache.get(norm[i]) if directory in listed else None
            if hit is None:
                left.append(i)
            else:
                out[i] = hit
        return left

    def stat_many(self, paths: "Sequence[str]", *, follow: bool = True) -> list[Attr | StripefsError]:
        """Attributes of many paths in few round trips (200 paths per request).

        Returns:
            Per path, in order: its :class:`Attr`, or the error (an ``OSError``
            subclass such as ``FileNotFoundError``, not raised) resolving it gave.
        """
        norm = [normpath(p) for p in paths]
        cache = self._core.lease_cache() if follow else None
        out: list[Attr | StripefsError | None] = [None] * len(norm)
        todo = list(range(len(norm)))
        if cache is not None:  # what the cache holds needs no request (as stat)
            hits = [cache.get(p) for p in norm]
            out = list(hits)
            todo = [i for i, hit in enumerate(hits) if hit is None]
            if todo:
                todo = self._from_listings(cache, norm, todo, out)
        for start in range(0, len(todo), STAT_MANY_MAX):
            index = todo[start:start + STAT_MANY_MAX]
            part = [norm[i] for i in index]
            token, lease, sent = (cache.token(), cache.leasing, time.monotonic()) if cache is not None else ((0, 0), False, 0.0)
            reply = self._core.call(m.StatMany(paths=part, follow=follow, lease=lease))
            if (len(reply.attrs) + len(reply.failed) != len(part) or len(reply.codes) != len(reply.failed)
                    or len(set(reply.failed)) != len(reply.failed) or not all(0 <= i < len(part) for i in reply.failed)
                    or (reply.lease_ids is not None and len(reply.lease_ids) != len(reply.attrs))):
                raise StripefsError(ErrorCode.PROTOCOL, "StatMany: answer does not match the paths asked")
            attrs, errors = iter(reply.attrs), dict(zip(reply.failed, reply.codes))
            leases = iter(reply.lease_ids or ())
            for k, i in enumerate(index):
                if k in errors:
                    out[i] = StripefsError(errors[k], "", part[k])
                    continue
                attr = out[i] = next(attrs)
                if cache is not None:
                    cache.put(part[k], attr, token, next(leases, 0), reply.lease_ms, sent)
        return out  # type: ignore[return-value]  # every index was answered

    def create_many(self, paths: "Sequence[str]", mode: int = 0o644, *,
                    exclusive: bool = True) -> list[Attr | StripefsError]:
        """Create many empty files in few round trips (200 paths per request, one
        metadata transaction each), with ``mode`` minus the process umask.

        Args:
            exclusive: an existing name fails with ``FileExistsError``; otherwise an
                existing file is answered as it is (not truncated).

        Returns:
            Per path, in order: the new (or existing) file's :class:`Attr`, or the
            error (``FileExistsError``, ``FileNotFoundError`` for a missing parent...,
            not raised) creating it gave.

        Raises:
            StripefsError: EINVAL for a path :func:`normpath` refuses, before any request.

        Caveats:
            * Each request of 200 paths commits on its own: a failure between two of
              them (the service unreachable) leaves the earlier ones created.
        """
        norm = [normpath(p) for p in paths]
        perm = mode & 0o7777 & ~_umask()
        uid, gid = os.getuid(), os.getgid()
        return self._many(norm, lambda part: m.CreateMany(paths=part, mode=perm, uid=uid, gid=gid,
                                                          exclusive=exclusive))

    def unlink_many(self, paths: "Sequence[str]") -> list[Attr | StripefsError]:
        """Remove many non-directories in few round trips (as :meth:`create_many`).

        Returns:
            Per path, in order: the attributes with the new link count (0: gone), or
            the error (not raised) removing it gave.
        """
        return self._many([normpath(p) for p in paths], lambda part: m.UnlinkMany(paths=part))

    def _many(self, norm: list[str],
              request: "Callable[[list[str]], Message[m.StatManyReply]]") -> list[Attr | StripefsError]:
        """Send ``request(part)`` for each run of ``CREATE_MANY_MAX`` paths; per path, its answer.

        A path over ``MAX_PATH`` bytes fails here (ENAMETOOLONG, as the service would
        answer), so that a full request of paths always fits in one frame.
        """
        too_long = {i for i, p in enumerate(norm) if len(p.encode("utf-8", "surrogateescape")) > MAX_PATH}
        if too_long:
            answers = iter(self._many([p for i, p in enumerate(norm) if i not in too_long], request))
            return [StripefsError(ErrorCode.NAME_TOO_LONG, f"path longer than {MAX_PATH} bytes", p)
                    if i in too_long else next(answers) for i, p in enumerate(norm)]
        out: list[Attr | StripefsError] = []
        for start in range(0, len(norm), CREATE_MANY_MAX):
            part = norm[start:start + CREATE_MANY_MAX]
            msg = request(part)
            out.extend(self._core.call(msg).per_item(part, type(msg).__name__))
        return out

    def lstat(self, path: str) -> Attr:
        return self.stat(path, follow=False)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def isdir(self, path: str) -> bool:
        try:
            return self.stat(path).is_dir
        except (FileNotFoundError, NotADirectoryError):
            return False

    def isfile(self, path: str) -> bool:
        try:
            return self.stat(path).is_file
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _parent(self, path: str) -> tuple[Attr, str, str]:
        p = normpath(path)
        if p == "/":
            raise StripefsError(ErrorCode.INVALID, "the root has no parent", p)
        head, name = posixpath.split(p)
        parent = self.stat(head)
        if not parent.is_dir:
            raise StripefsError(ErrorCode.NOT_DIR, "parent is not a directory", p)
        return parent, name, p

    def _leaf(self, path: str) -> str:
        """``path`` normalised, refused if it names the root (which has no parent)."""
        p = normpath(path)
        if p == "/":
            raise StripefsError(ErrorCode.INVALID, "the root has no parent", p)
        return p

    def _wrap(self, fn: Callable[[], Any], path: str) -> Any:
        try:
            return fn()
        except StripefsError as exc:
            if exc.filename is None:
                raise StripefsError(exc.code, exc.message, path) from None
            raise

    # -- directories --------------------------------------------------------------------
    def scandir(self, path: str = "/", *, attrs: bool = True) -> Iterator[DirEntry]:
        """Entries of a directory (paginated underneath), with attributes by default."""
        d = self.stat(path)
        if not d.is_dir:
            raise StripefsError(ErrorCode.NOT_DIR, "not a directory", normpath(path))
        after = ""
        while True:
            reply = self._core.call(m.Readdir(ino=d.ino, after=after, limit=1000, plus=attrs))
            entries = reply.entries
            yield from entries
            if not reply.more or not entries:
                return
            after = entries[-1].name

    def listdir(self, path: str = "/") -> list[str]:
        """Names in a directory, in name order (one round trip per 2000 names)."""
        p = normpath(path)
        cache = self._core.lease_cache()
        token, lease, sent = (0, 0), False, 0.0
        if cache is not None:  # a whole listing held under a lease is current
            kept = cache.get_names(p)
            if kept is not None:
                return kept
            token, lease, sent = cache.token(), cache.leasing, time.monotonic()
        names: list[str] = []
        while True:
            reply = self._wrap(lambda: self._core.call(m.ListNames(path=p, after=names[-1] if names else "",
                                                                   limit=2000, lease=lease and not names)), p)
            if not all(type(n) is str for n in reply.names):
                raise StripefsError(ErrorCode.PROTOCOL, "ListNames: a name is not text")
            if cache is not None and not names and not reply.more and reply.lease_ms:
                cache.put_names(p, reply.names, token, reply.lease_id, reply.lease_ms, sent)
            names.extend(reply.names)
            if not reply.more or not reply.names:
                return names

    def mkdir(self, path: str, mode: int = 0o777, *, exist_ok: bool = False) -> Attr:
        """Make a directory with ``mode`` minus the process umask, as ``os.mkdir``."""
        parent, name, p = self._parent(path)
        mode = mode & 0o7777 & ~_umask()
        try:
            return self._wrap(lambda: self._core.attr(m.Mkdir(parent=parent.ino, name=name, mode=mode,
                                                              uid=os.getuid(), gid=os.getgid())), p)
        except FileExistsError:
            if exist_ok and self.isdir(p):
                return self.stat(p)
            raise

    def makedirs(self, path: str, mode: int = 0o777, *, exist_ok: bool = True) -> None:
        """Make a directory and its missing parents (each ``mode`` minus the umask)."""
        p = normpath(path)
        if p == "/":
            return
        if self.exists(p):
            if not exist_ok or not self.isdir(p):
                raise StripefsError(ErrorCode.EXISTS, "already exists", p)
            return
        self.makedirs(posixpath.dirname(p), mode, exist_ok=True)
        self.mkdir(p, mode, exist_ok=True)

    def rmdir(self, path: str) -> None:
        parent, name, p = self._parent(path)
        self._reservations.forget(p)
        self._wrap(lambda: self._core.call(m.Rmdir(parent=parent.ino, name=name)), p)

    # -- files ----------------------------------------------------------------------------
    def open(self, path: str, mode: str = "rb", *, encoding: str | None = None, newline: str | None = None,
             defer: bool = True) -> Any:
        """Open a file; modes as the builtin (``rb wb ab xb r+b`` and text modes).

        A new file gets mode 0666 minus the process umask, as the builtin's;
        an existing one keeps its mode.

        ``"wb"`` (``"w"``) of a name this client does not know as a file makes the name at
        the file's first ``fsync``/``close``, with its length, in one request (``defer``;
        see ``fsclient/core/_pending.py``): other clients see the file from then on, this
        process at once; an error about the name (a directory there, the parent removed
        meanwhile) comes at ``fsync``/``close``. ``defer=False`` makes the name at open.
        """
        flags = mode_flags(mode)
        if flags["create"]:
            p = self._leaf(path)
            perm = 0o666 & ~_umask()
            if (defer and DEFER and flags["truncate"] and not flags["read"] and not flags["exclusive"]
                    and not self._known_file(p)):
                # A new file's name is made with its length at its first fsync/close (_pending).
                res = self._wrap(lambda: self._reservations.take(self, posixpath.dirname(p) or "/"), p)
                pending = self._core.pending.new(p, res, perm, os.getuid(), os.getgid())
                f = StripeFile(self, p, pending.attr(), readable=False, writable=True, pending=pending)
                return io.TextIOWrapper(f, encoding=encoding or "utf-8", newline=newline) if flags["text"] else f
            # One round trip: the service resolves the parent and creates in the same batch.
            reply = self._wrap(lambda: self._core.call(m.CreatePath(
                path=p, mode=perm, uid=os.getuid(), gid=os.getgid(),
                exclusive=flags["exclusive"], truncate=flags["truncate"],
            )), p)
            attr = reply.attr
        else:
            p = normpath(path)
            attr = self._fresh_stat(p, leased_ok=True)  # close-to-open: a leased entry is current, a timed one is not
        if attr.is_dir:
            raise StripefsError(ErrorCode.IS_DIR, "is a directory", p)
        f = self.open_inode(attr, name=p, readable=flags["read"], writable=flags["write"], append=flags["append"])
        if flags["text"]:
            return io.TextIOWrapper(f, encoding=encoding or "utf-8", newline=newline)  # type: ignore[arg-type]
        return f

    def remove(self, path: str) -> None:
        p = self._leaf(path)
        self._wrap(lambda: self._core.call(m.UnlinkPath(path=p)), p)

    unlink = remove

    def rename(self, src: str, dst: str, *, noreplace: bool = False, exchange: bool = False) -> None:
        """Atomic rename (POSIX replace semantics unless ``noreplace``)."""
        sp, sname, s = self._parent(src)
        dp, dname, d = self._parent(dst)
        flags = (1 if noreplace else 0) | (2 if exchange else 0)
        self._reservations.forget(s)
        if exchange:
            self._reservations.forget(d)
        self._wrap(lambda: self._core.call(m.Rename(parent=sp.ino, name=sname, new_parent=dp.ino, new_name=dname, flags=flags)), s)

    def symlink(self, target: str, path: str) -> Attr:
        parent, name, p = self._parent(path)
        return self._wrap(lambda: self._core.attr(m.Symlink(parent=parent.ino, name=name, target=target,
                                                            uid=os.getuid(), gid=os.getgid())), p)

    def mknod(self, path: str, mode: int = _stat.S_IFREG | 0o666, rdev: int = 0) -> Attr:
        """Make a FIFO, socket, device node or empty regular file, as ``os.mknod``.

        Args:
            mode: type bits (``stat.S_IFIFO``, ``S_IFSOCK``, ``S_IFCHR``, ``S_IFBLK``,
                ``S_IFREG``) and permission bits (the process umask is taken off them).
            rdev: device number (``os.makedev``) for character and block devices.

        Raises:
            FileExistsError, FileNotFoundError, NotADirectoryError; OSError(EINVAL)
            for a directory or symlink type.
        """
        parent, name, p = self._parent(path)
        mode &= ~_umask()
        return self._wrap(lambda: self._core.attr(m.Mknod(parent=parent.ino, name=name, mode=mode, rdev=rdev,
                                                           uid=os.getuid(), gid=os.getgid())), p)

    def mkfifo(self, path: str, mode: int = 0o666) -> Attr:
        """Make a FIFO (named pipe), as ``os.mkfifo`` (``mode`` minus the umask)."""
        return self.mknod(path, _stat.S_IFIFO | (mode & 0o7777))

    # -- extended attributes (as os.getxattr & co.; follow_symlinks like os) -----------------
    def getxattr(self, path: str, name: str | bytes, *, follow_symlinks: bool = True) -> bytes:
        """The value of extended attribute ``name``. Raises ``OSError(ENODATA)`` when absent."""
        ino = self.stat(path, follow=follow_symlinks).ino
        return self._wrap(lambda: self._core.call(m.GetXattr(ino=ino, name=os.fsencode(name))).value, normpath(path))

    def setxattr(self, path: str, name: str | bytes, value: bytes, flags: int = 0, *,
                 follow_symlinks: bool = True) -> None:
        """Set extended attribute ``name``; ``flags`` as ``os.XATTR_CREATE``/``os.XATTR_REPLACE``.

        Raises:
            OSError: EEXIST/ENODATA for the flags, E2BIG (value over 64 KiB), ERANGE
                (name over 255 bytes), ENOSPC (over 1 MiB per inode), EOPNOTSUPP (a
                namespace other than user., trusted., security.), EPERM (user.* on a
                symlink or special file).
        """
        ino = self.stat(path, follow=follow_symlinks).ino
        self._wrap(lambda: self._core.call(m.SetXattr(ino=ino, name=os.fsencode(name), value=bytes(value),
                                                      flags=flags)), normpath(path))

    def listxattr(self, path: str, *, follow_symlinks: bool = True) -> list[str]:
        """Names of the extended attributes, as ``os.listxattr``."""
        ino = self.stat(path, follow=follow_symlinks).ino
        return [os.fsdecode(n) for n in self._core.call(m.ListXattr(ino=ino)).names]

    def removexattr(self, path: str, name: str | bytes, *, follow_symlinks: bool = True) -> None:
        """Remove extended attribute ``name``. Raises ``OSError(ENODATA)`` when absent."""
        ino = self.stat(path, follow=follow_symlinks).ino
        self._wrap(lambda: self._core.call(m.RemoveXattr(ino=ino, name=os.fsencode(name))), normpath(path))

    def readlink(self, path: str) -> str:
        attr = self.lstat(path)
        return self._core.call(m.Readlink(ino=attr.ino)).target

    def link(self, src: str, dst: str) -> Attr:
        attr = self.lstat(src)
        parent, name, p = self._parent(dst)
        return self._wrap(lambda: self._core.attr(m.Link(ino=attr.ino, new_parent=parent.ino, new_name=name)), p)

    def truncate(self, path: str, size: int) -> Attr:
        attr = self.stat(path)
        return self._core.attr(m.SetAttr(ino=attr.ino, size=size))

    def chmod(self, path: str, mode: int) -> Attr:
        return self._core.attr(m.SetAttr(ino=self.stat(path).ino, mode=mode & 0o7777))

    def chown(self, path: str, uid: int, gid: int) -> Attr:
        return self._core.attr(m.SetAttr(ino=self.stat(path).ino, uid=uid, gid=gid))

    def utime(self, path: str, ns: tuple[int, int] | None = None) -> Attr:
        now = time.time_ns()
        atime, mtime = ns if ns is not None else (now, now)
        return self._core.attr(m.SetAttr(ino=self.stat(path).ino, atime_ns=atime, mtime_ns=mtime))

    def set_layout(self, path: str, *, chunk_size: int | None = None, stripe: int | None = None) -> None:
        """Set a directory's default layout; files created below inherit it."""
        self._core.call(m.SetLayout(ino=self.stat(path).ino, chunk_size=chunk_size, stripe=stripe))

    # -- whole-file helpers -------------------------------------------------------------
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        with self.open(path, "rb") as f:
            size = f.size if length is None else min(length, max(0, f.size - offset))
            return f.pread(size, offset)

    def write_bytes(self, path: str, data: bytes | memoryview, *, exclusive: bool = False) -> None:
        """Write a whole file. A new file: its bytes first, then its name and length in
        one metadata transaction (``_wholefiles``), so it appears whole or not at all. An
        existing one is written in place, as ``open(path, "wb")`` does.

        Raises:
            StripefsError: EEXIST (``exclusive``), EISDIR, ENOENT/ENOTDIR (parent), and
                the storage servers' errors.
        """
        p = self._leaf(path)
        (result,) = write_files(self, [(p, data)], mode=0o666 & ~_umask(), exclusive=exclusive,
                                pool=self._reservations, known=self._known_file)
        if isinstance(result, StripefsError):
            raise result

    def write_files(self, files: "Sequence[tuple[str, bytes | bytearray | memoryview]] | dict[str, Any]", *,
                    mode: int = 0o644, exclusive: bool = False) -> list[Attr | StripefsError]:
        """Write many whole files at once: every new file's bytes in parallel, then names
        and lengths in one metadata transaction per 200 files; files that exist are
        written in place (see :meth:`write_bytes`). The fast way to upload many small
        files (datasets, checkpoint shards).

        Args:
            files: ``{path: bytes}`` or ``(path, bytes)`` pairs; each path at most once.
            mode: permission bits, minus the process umask.
            exclusive: an existing name fails that file with ``FileExistsError``.

        Returns:
            Per file, in order: its :class:`Attr`, or the error (not raised) it met: a
            write that failed, ``FileNotFoundError`` for a missing parent,
            ``FileExistsError`` (``exclusive``) or ``IsADirectoryError``...

        Raises:
            StripefsError: EINVAL for a path :func:`normpath` refuses or given twice.
        """
        pairs = list(files.items()) if isinstance(files, dict) else list(files)
        norm = [(self._leaf(p), data) for p, data in pairs]
        if len({p for p, _ in norm}) != len(norm):
            raise StripefsError(ErrorCode.INVALID, "write_files: a path is given twice")
        return write_files(self, norm, mode=mode & 0o7777 & ~_umask(), exclusive=exclusive, known=self._known_file)

    def _known_file(self, path: str) -> bool:
        """Does this client's attribute cache hold ``path`` as a regular file (see write_files)?"""
        cache = self._core.attrs
        attr = cache.get(path) if cache is not None else None
        return attr is not None and _stat.S_ISREG(attr.mode)

    def copy(self, src: str, dst: str, *, callback: Callable[[int], None] | None = None) -> None:
        """Copy through a reused aligned buffer, window by window (no per-chunk bytes objects)."""
        with self.open(src, "rb") as fin, self.open(dst, "wb") as fout:
            buf = self._core.buffers.get(fin.window * 2)
            try:
                view = memoryview(buf)
                while True:
                    n = fin.readinto(view)
                    if not n:
                        break
                    fout.write(view[:n])
                    if callback:
                        callback(n)
            finally:
                view.release()
                self._core.buffers.put(buf)

    # -- the interface front ends use (by inode; docs/architecture.md) -----------------------
    def call(self, msg: Message[R], *, timeout: float = 60.0) -> R:
        """Send one request to the metadata service and return its typed reply.

        Retried across reconnects with the same request id, so a mutation is
        never applied twice (the service replays its first answer).

        Args:
            msg: any metadata request, e.g. ``messages.Readdir(ino=..., after="")``.
            timeout: seconds before giving up on an unreachable service.

        Returns:
            The request's reply type (``type(msg).Reply``), e.g. a ``ReaddirReply``.

        Raises:
            StripefsError: the service's error (``FileNotFoundError`` etc.);
                UNAVAILABLE/TIMEOUT after ``timeout``; PROTOCOL for a malformed reply.
        """
        return self._core.call(msg, timeout)

    def stat_inode(self, ino: int) -> Attr:
        """The attributes of inode ``ino`` (``GetAttr``), without a path.

        Raises:
            StripefsError: NOT_FOUND when the inode is gone.
        """
        return self._core.attr(m.GetAttr(ino=ino))

    def open_inode(self, attr: Attr, *, name: str | None = None, readable: bool = True, writable: bool = False,
                   append: bool = False) -> StripeFile:
        """A file object on an inode whose attributes the caller already has.

        For front ends that address files by inode (the FUSE daemon). No
        metadata request is sent: the layout and size come from ``attr``.

        Args:
            attr: the inode's attributes (from :meth:`stat_inode`, a lookup or a create).
            name: shown in errors and ``repr``; defaults to ``<inode N>``.
            readable, writable, append: the open mode.

        Returns:
            A :class:`StripeFile` (binary, buffered, not thread-safe).

        Raises:
            StripefsError: INVALID when ``attr`` is not a regular file.
        """
        return StripeFile(self, name or f"<inode {attr.ino}>", attr, readable=readable, writable=writable, append=append)

    def read_into(self, ino: int, layout: Layout, file_size: int, offset: int, dest: memoryview) -> int:
        """Read a file's bytes at ``offset`` straight into ``dest``, all chunks in parallel.

        Thread-safe and stateless (no readahead): what dataloaders, range reads
        and parallel FUSE reads use. Holes and short chunks read as zeros.

        Args:
            ino, layout: the file (from its :class:`Attr`).
            file_size: the length to read up to (``attr.size``, or a writer's own view).
            offset: where to start.
            dest: a writable byte buffer; up to ``len(dest)`` bytes are read.

        Returns:
            Bytes read: ``min(len(dest), file_size - offset)``, 0 at or past the end.

        Raises:
            StripefsError: CHECKSUM (EIO) when no replica has good bytes,
                UNAVAILABLE when a chain stays unreachable, TIMEOUT.
        """
        return self._core.read_into(ino, layout, file_size, offset, dest)

    def write_from(self, ino: int, layout: Layout, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset``, all chunks in parallel; returns once every chunk is acknowledged.

        The length is not committed: call :meth:`commit_length` (as ``close`` does).

        Raises:
            StripefsError: the storage servers' errors after retries (UNAVAILABLE,
                NO_SPACE, ...).
        """
        self._core.write_from(ino, layout, offset, data)

    def submit_write(self, ino: int, layout: Layout, offset: int, data: memoryview) -> "Future[None]":
        """Start writing ``data`` at ``offset`` in the background.

        The caller must keep ``data`` unchanged until the future resolves. The
        length is not committed: call :meth:`commit_length` once all are done.

        Returns:
            A future resolving (to None) when every chunk is acknowledged, or
            raising the write's :class:`StripefsError`.
        """
        (done,) = self._core.submit_write(ino, layout, offset, data)
        return done

    def commit_length(self, ino: int, length: int, *, mtime_ns: int | None = None,
                      truncations: int | None = None) -> Attr:
        """Publish a file's length after its writes were acknowledged (``close``/``fsync`` do this).

        The size becomes ``max(size, length)``: commits of concurrent or retried
        writers never shrink a file (truncation is ``SetAttr``'s job).

        Args:
            ino: the file.
            length: the end of the bytes written.
            mtime_ns: the modification time to record; None records the
                service's clock only when the size grows.
            truncations: ``Attr.truncations`` as the writer last saw it; if the
                file was truncated since, the size is not extended (the servers
                dropped the writer's bytes past the truncation).

        Returns:
            The inode's attributes after the commit.
        """
        return self._core.attr(m.CommitLength(ino=ino, length=length, mtime_ns=mtime_ns, truncations=truncations))

    def routing(self, refresh: bool = False) -> Routing:
        """The chain table: which storage servers serve each chain, head first.

        Cached; ``refresh=True`` asks the metadata service again (after a server
        failed or moved). Connections to servers that moved are dropped.
        """
        return self._core.routing(refresh)

    @property
    def retry_for(self) -> float:
        """Seconds a failing request keeps retrying (``retry_for=``, ``$STRIPEFS_RETRY_FOR``, 30)."""
        return self._core.retry_for

    def read_target(self, ino: int, layout: Layout, index: int, attempt: int = 0) -> int:
        """The storage server to read chunk ``index`` of inode ``ino`` from: the native read policy.

        For front ends that schedule chunk reads themselves (the batch read
        ring), so that they spread and fail over as :meth:`read_into` does:
        reads go to any serving replica of the chunk's chain, spread by chunk,
        and retry ``attempt`` goes to the next replica (after a checksum
        mismatch or an unavailable server).

        Raises:
            StripefsError: UNAVAILABLE when the chain has no serving target.
        """
        return self._core._replica(layout.chain_of(index), ino + index, attempt)

    def data_connection(self, server_id: int) -> Connection:
        """A pipelined connection to storage server ``server_id``, shared with the data path.

        For front ends that schedule chunk requests themselves (the batch read
        ring, scrub): ``submit(msg, dest=view)`` receives a payload straight into
        ``view``; decode the reply with ``wire.decode_reply(msg, reply.header)``.

        Raises:
            StripefsError: UNAVAILABLE for a server the routing table does not know
                or that does not answer.
        """
        return self._core.data_conn(server_id)

    def call_storage(self, server_id: int, msg: Message[R], *, timeout: float | None = 120.0) -> R:
        """Send one request to a storage server (e.g. ``Scrub``) and return its typed reply.

        Not retried: the caller chose the server, and after a failure it may no
        longer be the right one (see :meth:`routing` with ``refresh=True``).

        Raises:
            StripefsError: the server's error, UNAVAILABLE, TIMEOUT after
                ``timeout`` seconds, PROTOCOL for a malformed reply.
        """
        return m.decode_reply(msg, self._core.data_conn(server_id).call(msg, timeout=timeout).header)

    @property
    def buffers(self) -> BufferPool:
        """The client's pool of page-aligned buffers (``get(n)``/``put(buf)``), shared by its files."""
        return self._core.buffers

    @property
    def pid(self) -> int:
        """The process whose connections this client holds (a forked child reconnects under its own)."""
        return self._core.pid

    # -- cluster --------------------------------------------------------------------------
    def statfs(self) -> m.StatfsReply:
        """Usable capacity, usage and file count of the cluster (serving storage servers).

        Bytes are usable bytes: raw sums divided by the replica count (the
        metadata service computes them; do not divide again).
        """
        return self._core.call(m.Statfs())

    def status(self) -> m.ClusterStatusReply:
        """The metadata service, every storage server with its state, and the chain table."""
        return self._core.call(m.ClusterStatus())

    def placement(self, path: str) -> list[dict[str, Any]]:
        """Where each chunk of a file lives.

        Returns ``[{index, chain, server, host, port, replicas, states}]``:
        ``server`` is the chain's first target (the head when serving),
        ``replicas``/``states`` every target of the chain with its state.
        """
        attr = self.stat(path)
        if attr.layout is None:
            raise StripefsError(ErrorCode.IS_DIR, "not a regular file", normpath(path))
        routing = self._core.routing(refresh=True)
        out = []
        nchunks = -(-attr.size // attr.layout.chunk_size)
        for index in range(nchunks):
            chain = attr.layout.chain_of(index)
            members = routing.members.get(chain) or tuple((t, "serving") for t in routing.chains.get(chain, ()))
            sid = members[0][0]
            info = routing.servers[sid]
            out.append({"index": index, "chain": chain, "server": sid, "host": info.host, "port": info.port,
                        "replicas": [t for t, _ in members], "states": [st for _, st in members]})
        return out


class AsyncClient:
    """Trio face of :class:`Client`: every method runs the sync one on a worker thread.

    The data path is threads anyway (see ``_core``); this keeps blocking calls
    off the trio loop (the FUSE daemon's) while sharing the client's connections.
    Any :class:`Client` method is available as a coroutine (``await aio.stat(p)``).

    Args:
        client: the client whose connections are used.
        limiter: bounds the worker threads in use at once (32 by default).
    """

    def __init__(self, client: Client, *, limiter: trio.CapacityLimiter | None = None):
        self.sync = client
        self.limiter = limiter or trio.CapacityLimiter(32)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a blocking function on a worker thread (under the limiter)."""
        return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=self.limiter)

    async def call(self, msg: Message[R]) -> R:
        """:meth:`Client.call`: the typed reply of a metadata request, awaited on the
        loop (no worker thread per request; see ``_acall.py``)."""
        return await acall(self.sync._core, msg)

    async def call_header(self, msg: Message[Any]) -> dict[str, Any]:
        """:meth:`call` of a read, the reply's header returned unchecked (the caller builds
        the reply from it, e.g. ``ReaddirReply.with_page``)."""
        return await acall_header(self.sync._core, msg)

    async def attr(self, msg: Message[m.AttrReply]) -> Attr:
        """A metadata request answered with attributes (``GetAttr``, ``Lookup``, ``Mkdir``, ...): its ``attr``."""
        reply: m.AttrReply = await self.call(msg)
        return reply.attr

    async def read_into(self, ino: int, layout: Layout, file_size: int, offset: int, dest: memoryview) -> int:
        """:meth:`Client.read_into`, on the loop when one request on an open connection
        answers it (a sample, a page-cache fill), else on a worker thread."""
        return await aread_into(self.sync._core, ino, layout, file_size, offset, dest, self.limiter)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.sync, name)
        if not callable(fn):
            raise AttributeError(name)

        async def method(*args: Any, **kwargs: Any) -> Any:
            return await self.run(fn, *args, **kwargs)

        method.__name__ = name
        return method
