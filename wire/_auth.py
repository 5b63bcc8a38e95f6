"""Challenge-response authentication with the cluster secret (never sent on the wire).

On connect the server sends :class:`~wire.Challenge` with a fresh 32-byte
nonce. The client answers :class:`~wire.Authenticate` with its own nonce and
``HMAC-SHA256(secret, b"client" + server_nonce + client_nonce)``; the server
checks it and answers with ``HMAC-SHA256(secret, b"server" + client_nonce +
server_nonce)``, so the client knows the server holds the secret too (mutual).
Fresh nonces on both sides make a recorded exchange useless for replay.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["NONCE_LEN", "new_nonce", "new_secret", "client_proof", "server_proof", "check_proof"]

NONCE_LEN = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_LEN)


def new_secret() -> str:
    """A new cluster secret (hex text, as stored in cluster.json)."""
    return secrets.token_hex(32)


def _mac(secret: str | bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, label + a + b, hashlib.sha256).digest()


def client_proof(secret: str | bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _mac(secret, b"client", server_nonce, client_nonce)


def server_proof(secret: str | bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _mac(secret, b"server", client_nonce, server_nonce)


def check_proof(expected: bytes, got: object) -> bool:
    """Constant-time comparison; anything that is not bytes fails."""
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)
