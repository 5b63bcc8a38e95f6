"""The metadata service's memory of answers to recent mutations (for retries) stays bounded
when the answers are batches: an answer counts by the attributes it holds."""

from __future__ import annotations

from stripefs.metadata._replay import Replies
from stripefs.wire import Attr, ErrorCode, Layout, StripefsError, messages as m

ATTR = Attr(7, 0o100644, 1, 0, 0, 0, 1, 2, 3, Layout(1 << 20, tuple(range(16))))


def test_batch_answers_count_by_their_attributes() -> None:
    replies = Replies(entries=100, attrs=1000)
    big = m.StatManyReply([ATTR] * 200, [], []).to_header()
    for i in range(20):
        replies.put((b"c", i), big)
    assert [i for i in range(20) if replies.get((b"c", i)) is not None] == list(range(15, 20))  # 5 x 200 attributes
    for i in range(20, 120):  # single answers: bounded by their count
        replies.put((b"c", i), m.AttrReply(ATTR).to_header())
    assert [i for i in range(120) if replies.get((b"c", i)) is not None] == list(range(20, 120))


def test_errors_and_empty_batches_count_once() -> None:
    replies = Replies(entries=3, attrs=10)
    replies.put((b"c", 1), StripefsError(ErrorCode.EXISTS, "x"))
    replies.put((b"c", 2), m.StatManyReply([], [0, 1], [2, 2]).to_header())
    replies.put((b"c", 3), m.EmptyReply().to_header())
    assert all(replies.get((b"c", i)) is not None for i in (1, 2, 3))
    replies.put((b"c", 2), m.EmptyReply().to_header())  # a key put again replaces its answer
    replies.put((b"c", 4), m.StatManyReply([ATTR] * 10, [], []).to_header())
    assert [i for i in (1, 2, 3, 4) if replies.get((b"c", i)) is not None] == [4]
