"""Many metadata requests in flight at once, from synchronous code.

The page store publishes one index entry per page (``Symlink``), retires segments
(``Rename``) and touches them (``SetAttr``): requests of one round trip each that do not
depend on each other. Sent one after another they would cost a round trip and a
metadata commit each; in flight together, the service takes them in one pass and its
commit worker makes them durable together (group commit). ``AsyncClient.call`` awaits a
request on a trio loop without a thread per request, so a short ``trio.run`` carries them.
"""

from __future__ import annotations

from typing import Any, Sequence

import trio

from stripefs.fsclient import AsyncClient, Client
from stripefs.wire import Message, StripefsError

__all__ = ["call_all", "IN_FLIGHT"]

IN_FLIGHT = 48  # requests on the wire at once (the service stops reading a connection at 64)


def call_all(client: Client, msgs: Sequence[Message[Any]], *, limit: int = IN_FLIGHT) -> list[Any]:
    """Send every request, at most ``limit`` in flight; per request, in order, its reply or
    the :class:`StripefsError` it met (returned, not raised).

    Caveats:
        * Runs a trio loop of its own: call it from plain threads, not from trio code.
    """
    if not msgs:
        return []
    if len(msgs) == 1:  # no loop for one request
        try:
            return [client.call(msgs[0])]
        except StripefsError as exc:
            return [exc]
    out: list[Any] = [None] * len(msgs)
    aio = AsyncClient(client)

    async def one(i: int, gate: trio.Semaphore) -> None:
        async with gate:
            try:
                out[i] = await aio.call(msgs[i])
            except StripefsError as exc:
                out[i] = exc

    async def main() -> None:
        gate = trio.Semaphore(limit)
        async with trio.open_nursery() as nursery:
            for i in range(len(msgs)):
                nursery.start_soon(one, i, gate)

    trio.run(main)
    return out
