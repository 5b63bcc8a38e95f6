"""The message table, validation, error mapping and auth proofs."""

from __future__ import annotations

import errno
import pickle

import pytest
from hypothesis import given, settings, strategies as st

import wire
from wire import ErrorCode, StripefsError, decode_message, messages as m


def test_message_ids_are_unique_and_stable() -> None:
    assert m.ReadChunk.MSG_ID == 41 and m.WriteChunk.MSG_ID == 40 and m.Create.MSG_ID == 14
    assert len({cls.MSG_ID for cls in wire.MESSAGES.values()}) == len(wire.MESSAGES)


def test_roundtrip_through_header() -> None:
    msg = m.Create(parent=1, name="x", mode=0o644, exclusive=True)
    assert decode_message(msg.MSG_ID, msg.to_header()) == msg
    assert m.Create.MUTATES and not m.GetAttr.MUTATES


@pytest.mark.parametrize(
    "msg_type, header",
    [
        (11, {}),  # missing field
        (11, {"ino": "1"}),  # wrong type
        (11, {"ino": True}),  # bool is not an int here
        (11, {"ino": 1, "extra": 2}),  # unknown field
        (11, {"ino": 2**70}),  # out of range
        (23, {"ino": 1, "size": "big"}),
    ],
)
def test_invalid_fields(msg_type: int, header: dict) -> None:
    with pytest.raises(StripefsError) as exc:
        decode_message(msg_type, header)
    assert exc.value.errno == errno.EINVAL


def test_unknown_message_type() -> None:
    with pytest.raises(StripefsError) as exc:
        decode_message(9999, {})
    assert exc.value.code == ErrorCode.PROTOCOL


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(wire.MESSAGES)), st.dictionaries(st.text(max_size=10), st.one_of(st.none(), st.integers(), st.text(max_size=5), st.booleans(), st.binary(max_size=5))))
def test_fuzz_decode_message(msg_type: int, header: dict) -> None:
    try:
        decode_message(msg_type, header)
    except StripefsError as exc:
        assert exc.code in (ErrorCode.INVALID, ErrorCode.PROTOCOL)


@pytest.mark.parametrize(
    "code, builtin",
    [
        (ErrorCode.NOT_FOUND, FileNotFoundError),
        (ErrorCode.EXISTS, FileExistsError),
        (ErrorCode.IS_DIR, IsADirectoryError),
        (ErrorCode.NOT_DIR, NotADirectoryError),
        (ErrorCode.PERMISSION, PermissionError),
        (ErrorCode.TIMEOUT, TimeoutError),
    ],
)
def test_errors_are_builtin_oserrors(code: ErrorCode, builtin: type) -> None:
    exc = StripefsError(code, "boom", "/p")
    assert isinstance(exc, builtin) and isinstance(exc, StripefsError)
    assert exc.errno == code.errno and exc.filename == "/p"
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and again.code == code
    wired = StripefsError.from_wire(exc.to_wire())
    assert wired.code == code and wired.message == "boom"


def test_every_code_has_an_errno() -> None:
    for code in ErrorCode:
        assert isinstance(code.errno, int)
    assert ErrorCode.NOT_EMPTY.errno == errno.ENOTEMPTY and ErrorCode.NAME_TOO_LONG.errno == errno.ENAMETOOLONG
    assert wire.error_from_oserror(OSError(errno.ENOSPC, "full")).code == ErrorCode.NO_SPACE


def test_auth_proofs() -> None:
    s, c = wire.new_nonce(), wire.new_nonce()
    proof = wire.client_proof("secret", s, c)
    assert wire.check_proof(wire.client_proof("secret", s, c), proof)
    assert not wire.check_proof(wire.client_proof("other", s, c), proof)
    assert not wire.check_proof(wire.server_proof("secret", s, c), proof)  # roles differ
    assert not wire.check_proof(proof, "not bytes")
