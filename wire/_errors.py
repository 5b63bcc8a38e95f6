"""Typed error codes: the one table shared by every boundary.

Every failure that crosses the wire carries an :class:`ErrorCode`. The code is
mapped to an ``errno`` exactly once, here, and every front end (native client,
fsspec, FUSE, CLI) raises or returns that errno:

* the native client and fsspec raise ``OSError(errno, message)`` -- Python turns
  that into the matching subclass (``FileNotFoundError`` for ``ENOENT``,
  ``FileExistsError`` for ``EEXIST``, ...);
* the FUSE daemon raises ``pyfuse3.FUSEError(errno)``;
* the CLI prints the message and exits with status 1.

Exception tree::

    OSError
     └── StripefsError          (has .code, .errno, .message)
"""

from __future__ import annotations

import enum
import errno as _errno

__all__ = ["ErrorCode", "StripefsError", "error_from_oserror"]


class ErrorCode(enum.IntEnum):
    """Wire error codes. Numbers are stable: never renumber, only append."""

    OK = 0
    NOT_FOUND = 1
    EXISTS = 2
    NOT_DIR = 3
    IS_DIR = 4
    NOT_EMPTY = 5
    INVALID = 6
    NAME_TOO_LONG = 7
    IO = 8
    TIMEOUT = 9
    PERMISSION = 10
    NO_SPACE = 11
    CHECKSUM = 12
    AUTH = 13
    PROTOCOL = 14
    TOO_BIG = 15
    UNAVAILABLE = 16
    STALE_ROUTING = 17
    BUSY = 18
    CROSS_DEVICE = 19
    NOT_SUPPORTED = 20
    LOOP = 21
    BAD_FD = 22
    FILE_TOO_BIG = 23
    ACCESS = 24
    NO_DATA = 25
    RANGE = 26
    ARG_TOO_BIG = 27
    WOULD_BLOCK = 28
    STALE_FILE = 29  # the file is gone for good (removed after its grace period): ESTALE
    # A truncate's cut of the file has not reached every storage server yet, or reached them
    # after this writer's bytes: a length over them would show zeros as data (EIO).
    CUT_PENDING = 30

    @property
    def errno(self) -> int:
        return _ERRNO[self]


_ERRNO: dict[ErrorCode, int] = {
    ErrorCode.OK: 0,
    ErrorCode.NOT_FOUND: _errno.ENOENT,
    ErrorCode.EXISTS: _errno.EEXIST,
    ErrorCode.NOT_DIR: _errno.ENOTDIR,
    ErrorCode.IS_DIR: _errno.EISDIR,
    ErrorCode.NOT_EMPTY: _errno.ENOTEMPTY,
    ErrorCode.INVALID: _errno.EINVAL,
    ErrorCode.NAME_TOO_LONG: _errno.ENAMETOOLONG,
    ErrorCode.IO: _errno.EIO,
    ErrorCode.TIMEOUT: _errno.ETIMEDOUT,
    ErrorCode.PERMISSION: _errno.EPERM,
    ErrorCode.NO_SPACE: _errno.ENOSPC,
    ErrorCode.CHECKSUM: _errno.EIO,
    ErrorCode.AUTH: _errno.EACCES,
    ErrorCode.PROTOCOL: _errno.EPROTO,
    ErrorCode.TOO_BIG: _errno.EMSGSIZE,
    ErrorCode.UNAVAILABLE: _errno.EHOSTUNREACH,
    ErrorCode.STALE_ROUTING: _errno.ESTALE,
    ErrorCode.BUSY: _errno.EBUSY,
    ErrorCode.CROSS_DEVICE: _errno.EXDEV,
    ErrorCode.NOT_SUPPORTED: _errno.EOPNOTSUPP,
    ErrorCode.LOOP: _errno.ELOOP,
    ErrorCode.BAD_FD: _errno.EBADF,
    ErrorCode.FILE_TOO_BIG: _errno.EFBIG,
    ErrorCode.ACCESS: _errno.EACCES,
    ErrorCode.NO_DATA: _errno.ENODATA,
    ErrorCode.RANGE: _errno.ERANGE,
    ErrorCode.ARG_TOO_BIG: _errno.E2BIG,
    ErrorCode.WOULD_BLOCK: _errno.EAGAIN,
    ErrorCode.STALE_FILE: _errno.ESTALE,
    ErrorCode.CUT_PENDING: _errno.EIO,
}

_FROM_ERRNO: dict[int, ErrorCode] = {}
for _code, _no in _ERRNO.items():
    _FROM_ERRNO.setdefault(_no, _code)
# Code value -> (code, errno, default message), once: an error is built for every failed
# request (a lookup's ENOENT) on both sides of the wire, and ErrorCode(value) is slow.
_CODES: dict[int, tuple[ErrorCode, int, str]] = {
    c.value: (c, _ERRNO[c], c.name.lower().replace("_", " ")) for c in ErrorCode
}


class StripefsError(OSError):
    """An error with a wire code. It *is* an ``OSError`` with the mapped errno.

    ``StripefsError(ErrorCode.NOT_FOUND, "no such file", path)`` builds an
    instance of a subclass that also derives from the matching builtin
    (``FileNotFoundError`` here), so callers catch it the way they catch local
    file errors, and ``errno`` is ``ENOENT``.
    """

    def __new__(cls, code: "ErrorCode | int" = ErrorCode.IO, message: str = "", path: str | None = None):
        known = _CODES.get(code)  # an unknown code is an I/O error
        no = known[1] if known is not None else _errno.EIO
        if cls is StripefsError:
            cls = _SUBCLASSES.get(no, cls)
        if not message:
            message = known[2] if known is not None else "i/o error"
        # OSError parses errno/strerror/filename in __new__ when __new__ is overridden.
        if path is None:
            return super().__new__(cls, no, message)
        return super().__new__(cls, no, message, path)

    def __init__(self, code: ErrorCode | int, message: str = "", path: str | None = None):
        resolved, no, default = _CODES.get(code) or _CODES[ErrorCode.IO]
        self.code: ErrorCode = resolved
        self.message = message or default
        if path is None:
            super().__init__(no, self.message)
        else:
            super().__init__(no, self.message, path)

    def as_oserror(self) -> OSError:
        """The builtin ``OSError`` subclass for this errno (FileNotFoundError, ...)."""
        if self.filename is None:
            exc = OSError(self.errno, self.message)
        else:
            exc = OSError(self.errno, self.message, self.filename)
        exc.__cause__ = self
        return exc

    def to_wire(self) -> dict[str, object]:
        return {"code": int(self.code), "message": self.message}

    @classmethod
    def from_wire(cls, header: dict[str, object]) -> "StripefsError":
        code = header.get("code", ErrorCode.IO)
        msg = header.get("message", "")
        return cls(int(code) if isinstance(code, int) else ErrorCode.IO, str(msg))

    def __reduce__(self):  # keep pickling (multiprocessing) working
        return (type(self), (self.code, self.message, self.filename))


_BUILTINS: dict[int, type[OSError]] = {
    _errno.ENOENT: FileNotFoundError,
    _errno.EEXIST: FileExistsError,
    _errno.EISDIR: IsADirectoryError,
    _errno.ENOTDIR: NotADirectoryError,
    _errno.EPERM: PermissionError,
    _errno.EACCES: PermissionError,
    _errno.ETIMEDOUT: TimeoutError,
    _errno.ECONNREFUSED: ConnectionRefusedError,
    _errno.EAGAIN: BlockingIOError,
}
_BY_BASE: dict[type[OSError], type[StripefsError]] = {
    base: type(f"Stripefs{base.__name__}", (StripefsError, base), {"__module__": __name__})
    for base in dict.fromkeys(_BUILTINS.values())
}
_SUBCLASSES: dict[int, type[StripefsError]] = {no: _BY_BASE[base] for no, base in _BUILTINS.items()}
globals().update({c.__name__: c for c in _BY_BASE.values()})  # picklable by name


def error_from_oserror(exc: OSError, message: str | None = None) -> StripefsError:
    """Translate a local ``OSError`` (from a server's disk, say) into a wire error."""
    if isinstance(exc, StripefsError):
        return exc
    code = _FROM_ERRNO.get(exc.errno or 0, ErrorCode.IO)
    return StripefsError(code, message or exc.strerror or str(exc))
