"""The storage server's line to the metadata services: every address, failing over.

With several metadata services (``stripefs up --metadata-services N``) a storage server
knows all their addresses. Registration, heartbeats and ``SyncDone`` must reach the
one that leads (the others answer UNAVAILABLE); routing reads may go to any. The link
stays on the address that last answered and moves to the next one on UNAVAILABLE or
TIMEOUT, trying each address once per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stripefs.rpc import TrioConnection
from stripefs.wire import ErrorCode, Message, StripefsError

__all__ = ["MetadataLink", "parse_addresses"]


def parse_addresses(spec: str) -> list[tuple[str, int]]:
    """``host:port[,host:port...]`` as a list of addresses.

    Raises:
        StripefsError: INVALID for an entry that is not ``host:port``.
    """
    out = []
    for part in spec.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise StripefsError(ErrorCode.INVALID, f"metadata address must be host:port, got {part!r}")
        out.append((host, int(port)))
    return out


class MetadataLink:
    """:class:`rpc.TrioConnection`'s ``call``, over several metadata addresses.

    Args:
        addresses: the metadata services (one or more).
        secret: the credential of ``role``.
        role: what the connections authenticate as.
    """

    def __init__(self, addresses: Sequence[tuple[str, int]], secret: str, *, role: str = "client") -> None:
        if not addresses:
            raise StripefsError(ErrorCode.INVALID, "no metadata address")
        self.conns = [TrioConnection(tuple(a), secret, role=role) for a in addresses]  # type: ignore[arg-type]
        self.current = 0

    @property
    def address(self) -> tuple[str, int]:
        return self.conns[self.current].address

    async def call(self, msg: Message, payload: bytes | memoryview = b"", **kw: Any) -> tuple[dict[str, Any], Any]:
        """One call; on UNAVAILABLE or TIMEOUT the next address is tried (each once).

        Raises:
            StripefsError: the last address's error when none answered.
        """
        for attempt in range(len(self.conns)):
            conn = self.conns[self.current]
            try:
                return await conn.call(msg, payload, **kw)
            except StripefsError as exc:
                if exc.code not in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT) or attempt == len(self.conns) - 1:
                    raise
                self.current = (self.current + 1) % len(self.conns)
        raise AssertionError("unreachable")
