"""The mount's write-behind budget counts every buffer it sends (issue #27 item 8)."""

from __future__ import annotations

import trio

from stripefs.fsclient.fuse._openfile import OpenFile
from stripefs.fsclient.fuse._writebehind import WriteBudget


def test_a_send_that_reaps_a_finished_one_is_still_counted(client, testdir: str) -> None:
    """A full buffer is sent after the file object reaps its finished sends: the list of
    sends in flight shrinks by one while it gains the new one, and the budget must see it."""
    f = client.open(f"{testdir}/f", "wb")
    state = OpenFile(client, f)
    half = f.window // 2
    budget = WriteBudget(limit=1 << 40)

    async def main() -> None:
        assert await budget.write_on_loop(state, 0, b"a" * half) == half
        assert await budget.write_on_loop(state, half, b"b" * half) == half  # full: sent
        first = f.sending()
        assert len(first) == 1
        # The first send finishes between the checks (which reap finished sends) and the send
        # of the next full buffer (which reaps them too): staged by checks that reap nothing
        # and answer what they would have (the next write fits, the one after fills the
        # buffer, nothing blocks it).
        answers = iter([True, False])
        f.buffered_fits = lambda offset, n: next(answers)  # type: ignore[method-assign]
        f.send_blocker = lambda: None  # type: ignore[method-assign]
        first[0].result(timeout=30)  # acknowledged, not reaped yet
        await trio.sleep(0.05)  # its done callback gives the budget back on the loop
        assert budget.sending_bytes == 0 and first[0] in f.sending()
        await budget.write_on_loop(state, 2 * half, b"c" * half)
        await budget.write_on_loop(state, 3 * half, b"d" * half)  # full: reaps the first, sends
        assert f.sending() and first[0] not in f.sending()
        assert budget.sending_bytes == f.window, "a buffer in flight is not counted against the budget"

    try:
        trio.run(main)
    finally:
        f.close()
    assert client.read_bytes(f"{testdir}/f") == b"a" * half + b"b" * half + b"c" * half + b"d" * half
