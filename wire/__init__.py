"""stripefs wire protocol: sans-IO frames, the numbered message table, typed errors, auth,
and the connection state machines every transport drives (``ClientConnection``, ``ServerConnection``).

Nothing in this package touches a socket (sans-IO, in the style of h11). Transports live in ``rpc``.
"""

from . import _messages as messages
from ._auth import (
    ROLES,
    check_proof,
    client_proof,
    new_nonce,
    new_secret,
    role_credential,
    server_proof,
)
from ._checksums import CRC_BLOCK, check_segments, segments
from ._connection import ClientConnection, ConnState, ServerConnection
from ._errors import ErrorCode, StripefsError, error_from_oserror
from ._events import (
    BadRequest,
    ConnectionClosed,
    ErrorReceived,
    Event,
    HandshakeComplete,
    RequestReceived,
    ResponseCancelled,
    ResponseReceived,
)
from ._frames import (
    FLAG_ERROR,
    FLAG_RESPONSE,
    MAGIC,
    MAX_HEADER,
    MAX_PAYLOAD,
    NEED_DATA,
    PREFIX,
    VERSION,
    Frame,
    FrameDecoder,
    FrameHead,
    encode_frame,
    encode_prefix,
)
from ._messages import MESSAGES, Message, ReplyMessage, decode_message, decode_reply
from ._types import (
    MAX_CHUNK,
    MAX_FILE_SIZE,
    MAX_NAME,
    MAX_PATH,
    MAX_STRIPE,
    MIN_CHUNK,
    Attr,
    DirEntry,
    Layout,
    Routing,
    ServerInfo,
    validate_name,
)

__all__ = [
    "CRC_BLOCK", "check_segments", "segments",
    "messages", "ROLES", "check_proof", "client_proof", "new_nonce", "new_secret", "role_credential", "server_proof",
    "ClientConnection", "ConnState", "ServerConnection",
    "BadRequest", "ConnectionClosed", "ErrorReceived", "Event", "HandshakeComplete", "RequestReceived",
    "ResponseCancelled", "ResponseReceived",
    "ErrorCode", "StripefsError", "error_from_oserror",
    "FLAG_ERROR", "FLAG_RESPONSE", "MAGIC", "MAX_HEADER", "MAX_PAYLOAD", "NEED_DATA", "PREFIX",
    "VERSION", "Frame", "FrameDecoder", "FrameHead", "encode_frame", "encode_prefix",
    "MESSAGES", "Message", "ReplyMessage", "decode_message", "decode_reply",
    "MAX_CHUNK", "MAX_FILE_SIZE", "MAX_NAME", "MAX_PATH", "MAX_STRIPE", "MIN_CHUNK",
    "Attr", "DirEntry", "Layout", "Routing", "ServerInfo", "validate_name",
]
