"""The fault harness's history checker judges hand-made histories (no cluster)."""

from __future__ import annotations

from stripefs.fsclient.testing.history import Op, check

S = (0, 0)


def w(who: str, crc: int, t0: float, t1: float, ok: bool = True) -> Op:
    return Op("w", who, S, crc, t0, t1, ok, None if ok else "EIO")


def r(crc: int | None, t0: float, t1: float, ok: bool = True) -> Op:
    return Op("r", "r0", S, crc, t0, t1, ok, None if ok else "EIO")


INIT = Op("i", "init", S, 100, 0.0, 0.1, True)


def test_a_good_history_passes() -> None:
    ops = [INIT, w("a", 1, 1, 2), r(100, 0.5, 0.6), r(1, 1.5, 1.6), r(1, 3, 4), w("b", 2, 5, 6, ok=False), r(2, 5.5, 5.7)]
    v = check(ops, {S: 2})  # a failed write may have landed, and may be read
    assert v.ok, v.violations
    assert (v.acked_writes, v.failed_writes, v.reads) == (1, 1, 4)


def test_phantom_bytes_are_caught() -> None:
    v = check([INIT, w("a", 1, 1, 2), r(7, 3, 4)], {S: 1})
    assert not v.ok and "no write had produced" in v.violations[0]
    v = check([INIT, w("a", 1, 5, 6), r(1, 3, 4)], {S: 1})  # bytes of a write that started later
    assert not v.ok


def test_a_stale_read_is_caught() -> None:
    v = check([INIT, w("a", 1, 1, 2), r(100, 3, 4)], {S: 1})
    assert not v.ok and "stale" in v.violations[0]


def test_a_lost_acknowledged_write_is_caught() -> None:
    assert not check([INIT, w("a", 1, 1, 2), w("b", 2, 3, 4)], {S: 1}).ok
    # Overlapping writes: either may be last.
    assert check([INIT, w("a", 1, 1, 3), w("b", 2, 2, 4)], {S: 1}).ok
    assert check([INIT, w("a", 1, 1, 3), w("b", 2, 2, 4)], {S: 2}).ok
    # An unacknowledged write after an acknowledged one may or may not have landed.
    assert check([INIT, w("a", 1, 1, 2), w("b", 2, 3, 4, ok=False)], {S: 1}).ok


def test_errors_count_when_none_were_promised() -> None:
    ops = [INIT, w("a", 1, 1, 2, ok=False)]
    assert check(ops, {S: 100}).ok
    v = check(ops, {S: 100}, expect_no_errors=True)
    assert not v.ok and len(v.errors) == 1
