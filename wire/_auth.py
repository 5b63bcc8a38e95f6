"""Challenge-response authentication with role credentials (never sent on the wire).

A cluster has one secret, kept by its servers only. Each peer role has its own
credential derived from it (:func:`role_credential`): ``client`` (what a
cluster.json hands to applications) and ``server`` (storage servers and the
metadata service talking to each other). The derivation is one-way, so a
client cannot compute the server credential from its own.

On connect the server sends :class:`~wire.Challenge` with a fresh 32-byte
nonce. The peer answers :class:`~wire.Authenticate` with the role it claims,
its own nonce and ``HMAC-SHA256(credential, b"client" + server_nonce +
client_nonce)``, keyed with that role's credential; the server checks it and
answers with ``HMAC-SHA256(credential, b"server" + client_nonce +
server_nonce)``, so the peer knows the server holds that credential too
(mutual). Fresh nonces on both sides make a recorded exchange useless for replay.

A server may also run without the cluster secret, from its role credentials alone
(:func:`role_keys`: what a storage server admitted by a join token holds). Every
function that takes the secret to derive a credential accepts those keys instead:
:func:`role_credential` reads the role's credential out of them, so a server given
keys checks each role's proof with that role's own credential.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["NONCE_LEN", "ROLES", "new_nonce", "new_secret", "role_credential", "role_keys", "client_proof",
           "server_proof", "check_proof"]

NONCE_LEN = 32
# Role keys start so; a cluster secret (hex text) never does.
KEYS_PREFIX = "stripefs-role-keys:"
# The roles a peer may claim in Authenticate: an application, or a server of the cluster.
ROLES = ("client", "server")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_LEN)


def new_secret() -> str:
    """A new cluster secret (hex text, as stored in cluster.json)."""
    return secrets.token_hex(32)


def role_credential(secret: str, role: str) -> str:
    """The credential of ``role`` derived from the cluster secret (hex text), or read
    from role keys (:func:`role_keys`) given in its place.

    Raises:
        ValueError: an unknown role, or keys that hold no credential for it.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
    if secret.startswith(KEYS_PREFIX):
        held = dict(part.partition("=")[::2] for part in secret[len(KEYS_PREFIX):].split(","))
        if not held.get(role):
            raise ValueError(f"these role keys hold no {role} credential")
        return held[role]
    return hmac.new(secret.encode(), b"stripefs-role:" + role.encode(), hashlib.sha256).hexdigest()


def role_keys(credentials: dict[str, str]) -> str:
    """Key material holding role credentials instead of the cluster secret: pass it
    wherever a server takes ``secret=`` (it never reveals the secret itself).

    A server needs every role's credential (:data:`ROLES`): the ``client`` one to
    check applications, the ``server`` one to call and check its peers.

    Raises:
        ValueError: an unknown role, or a credential that is not hex text.
    """
    for role, credential in credentials.items():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if not credential or any(c not in "0123456789abcdef" for c in credential):
            raise ValueError(f"the {role} credential must be lowercase hex text")
    return KEYS_PREFIX + ",".join(f"{role}={credentials[role]}" for role in sorted(credentials))


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
