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


# -- truncate + extend (zeros, written by many) and renames (a name register) --------------

ZERO = 0xDEAD  # the CRC of a region of zeros, the same for every truncate


def t(who: str, t0: float, t1: float, ok: bool = True) -> Op:
    return Op("t", who, S, ZERO, t0, t1, ok, None if ok else "EIO")


def test_a_cut_whose_bytes_come_back_is_caught() -> None:
    """Issue #27 item 1: the truncate answered EIO but its cut was committed, the extend
    was acknowledged, and a later read shows the bytes from before the cut."""
    ops = [INIT, w("a", 1, 1, 2), t("a", 3, 5), r(1, 6, 7)]
    v = check(ops, {S: ZERO})
    assert not v.ok and "stale" in v.violations[0] and v.truncates == 1
    v = check([INIT, w("a", 1, 1, 2), t("a", 3, 5)], {S: 1})  # the final bytes too
    assert not v.ok and "lost" in v.violations[0]


def test_zeros_of_many_truncates_are_credited_to_the_right_one() -> None:
    """Two truncates write the same bytes (zeros); zeros read after a write that followed the
    first truncate are the second truncate's, not stale bytes of the first."""
    ops = [INIT, t("a", 1, 2), w("b", 1, 3, 4), t("a", 5, 6), r(ZERO, 7, 8), r(1, 4.5, 4.6)]
    v = check(ops, {S: ZERO})
    assert v.ok, v.violations
    v = check([INIT, t("a", 1, 2), w("b", 1, 3, 4), r(ZERO, 7, 8)], {S: 1})  # no later truncate: stale zeros
    assert not v.ok and "stale" in v.violations[0]


def test_a_failed_truncate_may_or_may_not_have_cut() -> None:
    ops = [INIT, t("a", 1, 2, ok=False), r(100, 3, 4), r(ZERO, 5, 6)]
    assert check(ops, {S: 100}).ok and check(ops, {S: ZERO}).ok


def test_a_rename_is_a_write_of_the_name_register() -> None:
    n = lambda crc, t0, t1: Op("n", "w0", S, crc, t0, t1, True)  # noqa: E731
    v = check([INIT, n(5, 1, 2), r(100, 3, 4)], {S: 5})  # the old name after the rename's answer
    assert not v.ok and "stale" in v.violations[0] and v.renames == 1
    assert check([INIT, n(5, 1, 2), r(100, 1.5, 1.6), r(5, 3, 4)], {S: 5}).ok
