"""Each role on a host of its own: ``stripefs serve metadata|storage``, ``token``, ``client-config``.

A cluster is made by its first ``stripefs serve metadata --state DIR``: it creates the
cluster secret once, in ``DIR/server.json`` (mode 0600), and never hands it out. Other
hosts join with a **token** (``stripefs token``) that carries what their role needs:

* a *join* token (storage servers): the cluster id and the ``client`` and ``server``
  role credentials (``wire._auth``) -- a storage server checks clients with the first
  and calls and checks its peers with the second; it never needs the secret;
* a *client* token: the cluster id and the ``client`` credential only, from which
  ``stripefs client-config ADDR`` writes a cluster.json.

A token reads ``stripefs-join-BODY.CHECK`` (or ``stripefs-client-``): BODY is the
base64url JSON of those fields, CHECK the first 8 hex digits of the SHA-256 of what
precedes it, so a mistyped or truncated token is "not a stripefs token" at once rather
than an authentication failure later. Addresses are not in it: ``--join`` names them, and
a token stays valid when the metadata service moves.

Errors say one line and exit 2 (it cannot work as given: a bad token, address or flag, a
port in use, a root of another cluster) or 1 (the cluster could not be reached or refused
the token: worth another try once the cluster is up).

Caveats:
    A join token holds the server credential: whoever has it can act as a server of the
    cluster (as anyone with the secret could). Keep it like a key (``--token-file`` with
    mode 0600, not ``--token`` on a shared host: arguments show in ``ps``). Changing the
    secret revokes every token; there is no revoking one token alone.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import os
import secrets
import socket
import sys
from dataclasses import dataclass
from typing import Any

from stripefs.wire import NEED_DATA, ClientConnection, ErrorCode, HandshakeComplete, StripefsError, new_secret
from stripefs.wire._auth import role_credential, role_keys

__all__ = ["main", "add_parsers", "Token", "TokenError", "encode_token", "decode_token"]

JOIN_TIMEOUT = 3.0  # seconds to reach and authenticate with the metadata service before giving up
SECRET_FILE = "server.json"  # in the metadata state directory: the cluster secret (mode 0600)
TOKEN_ENV = "STRIPEFS_TOKEN"
_PREFIX = {"join": "stripefs-join-", "client": "stripefs-client-"}
_ROLES = {"join": ("client", "server"), "client": ("client",)}  # the credentials each kind carries
_HEX = frozenset("0123456789abcdef")


class TokenError(ValueError):
    """Text that is not a token of the expected kind."""


@dataclass(frozen=True)
class Token:
    kind: str  # "join" or "client"
    cluster_id: str
    credentials: dict[str, str]  # role -> credential


def _check(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def encode_token(kind: str, cluster_id: str, credentials: dict[str, str]) -> str:
    """The token text of ``kind`` (its roles' credentials taken from ``credentials``)."""
    fields = {"v": 1, "cluster_id": cluster_id, **{role: credentials[role] for role in _ROLES[kind]}}
    body = base64.urlsafe_b64encode(json.dumps(fields, separators=(",", ":")).encode()).rstrip(b"=").decode()
    text = _PREFIX[kind] + body
    return f"{text}.{_check(text)}"


def decode_token(text: str, kind: str) -> Token:
    """Read a token, which must be of ``kind``.

    Raises:
        TokenError: not a stripefs token (prefix, checksum, content), or one of the other kind.
    """
    text = text.strip()
    found = next((k for k, prefix in _PREFIX.items() if text.startswith(prefix)), None)
    head, _, check = text.rpartition(".")
    if found is None or not head or not secrets.compare_digest(check, _check(head)):
        raise TokenError("not a stripefs token (mistyped or cut short? print it again with `stripefs token`)")
    if found != kind:
        raise TokenError(f"this is a {found} token; this command needs a {kind} token "
                         f"(`stripefs token{' --client' if kind == 'client' else ''}`)")
    body = head[len(_PREFIX[found]):]
    try:
        fields = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        credentials = {role: str(fields[role]) for role in _ROLES[kind]}
        cluster_id = str(fields["cluster_id"])
    except (binascii.Error, ValueError, KeyError, TypeError) as exc:
        raise TokenError("not a stripefs token (its content is unreadable)") from exc
    if any(len(c) != 64 or not set(c) <= _HEX for c in credentials.values()):
        raise TokenError("not a stripefs token (a credential is not 64 hex digits)")
    return Token(kind, cluster_id, credentials)


class _Refused(Exception):
    """The command cannot go on: ``args[0]`` is the one line to print, ``status`` the exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def _address(text: str, flag: str, default_port: int | None = None) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep and default_port is not None:
        host, port = text.strip(), str(default_port)
    if not host or not port.isdigit() or int(port) > 65535:
        raise _Refused(f"{flag} must be HOST:PORT, got {text!r}", 2)
    return host, int(port)


def _addresses(text: str, flag: str) -> list[tuple[str, int]]:
    return [_address(part, flag) for part in text.split(",")]


def _advertised(listen: tuple[str, int], advertise: str | None) -> tuple[str, int]:
    """What the server registers: ``--advertise`` (its port defaults to the listen port), or
    the listen address when it is one a peer can connect to."""
    if advertise:
        return _address(advertise, "--advertise", default_port=listen[1])
    if listen[0] in ("0.0.0.0", "", "::"):
        raise _Refused(f"listening on {listen[0]} needs --advertise HOST[:PORT]: the address other hosts reach "
                       "this one at", 2)
    return listen


def _handshake(address: tuple[str, int], credential: str, role: str) -> None:
    """Authenticate with the metadata service at ``address`` as ``role``, within JOIN_TIMEOUT.

    Raises:
        _Refused: unreachable, not a metadata service, or the credential refused.
    """
    where = f"{address[0]}:{address[1]}"
    machine = ClientConnection(credential, os.urandom(16), expect_role="metadata", role=role)
    try:
        with socket.create_connection(address, timeout=JOIN_TIMEOUT) as sock:
            while True:
                event = machine.next_event()
                out = machine.data_to_send()
                if out:
                    sock.sendall(out)
                if isinstance(event, HandshakeComplete):
                    return
                data = b"" if event is not NEED_DATA else sock.recv(max(machine.next_read_size(), 1))
                if not data:
                    raise _Refused(f"{where} closed the connection during the handshake: is it a stripefs "
                                   "metadata service?")
                machine.receive_data(data)
    except StripefsError as exc:  # before OSError: it is one
        if exc.code == ErrorCode.AUTH:
            raise _Refused(f"token refused by the cluster at {where} (a token of another cluster, or of an "
                           "old secret?)") from exc
        raise _Refused(f"{where} is not a stripefs metadata service: {exc.message}") from exc
    except TimeoutError as exc:
        raise _Refused(f"cannot reach the metadata service at {where}: no answer within {JOIN_TIMEOUT:g}s") from exc
    except OSError as exc:
        raise _Refused(f"cannot reach the metadata service at {where}: {exc.strerror or exc}") from exc


def _check_token(addresses: list[tuple[str, int]], credential: str, role: str) -> None:
    """Authenticate with each metadata service given; the first failure is the answer."""
    for address in addresses:
        _handshake(address, credential, role)


def _read_token(a: argparse.Namespace) -> str:
    if a.token_file:
        try:
            with open(a.token_file) as f:
                return f.read()
        except OSError as exc:
            raise _Refused(f"cannot read --token-file {a.token_file}: {exc.strerror or exc}", 2) from exc
    text = a.token or os.environ.get(TOKEN_ENV)
    if not text:
        raise _Refused(f"give the token: --token TOKEN, --token-file FILE or ${TOKEN_ENV}", 2)
    return text


def _decode(a: argparse.Namespace, kind: str) -> Token:
    try:
        return decode_token(_read_token(a), kind)
    except TokenError as exc:
        raise _Refused(str(exc), 2) from exc


# -- the cluster secret ---------------------------------------------------------------------
def _write_private(path: str, data: dict[str, Any], *, exclusive: bool = False) -> None:
    """Write JSON readable by its owner only (0600 from the start: never readable by others)."""
    tmp = path if exclusive else path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC), 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    if not exclusive:
        os.replace(tmp, path)


def _cluster_secret(state: str) -> dict[str, Any]:
    """``STATE/server.json``: created with a new secret and cluster id on first use, read after.

    Raises:
        _Refused: a file readable by others, one without a secret, or a namespace without its secret.
    """
    path = os.path.join(state, SECRET_FILE)
    os.makedirs(state, mode=0o700, exist_ok=True)
    if not os.path.exists(path) and os.path.exists(os.path.join(state, "meta.db")):
        # A new secret would lock every server and client of that namespace out.
        raise _Refused(f"{state} holds a namespace but no {SECRET_FILE}: restore that file (a `stripefs up` "
                       f"cluster keeps it in its ROOT, beside meta/)")
    try:
        _write_private(path, {"role": "server", "cluster_id": secrets.token_hex(8), "secret": new_secret()},
                       exclusive=True)
    except FileExistsError:
        pass  # an existing cluster: keep its secret
    return _read_secret_file(path)


def _read_secret_file(path: str) -> dict[str, Any]:
    try:
        if os.stat(path).st_mode & 0o077:
            raise _Refused(f"{path} holds the cluster secret and is readable by others: chmod 600 {path}")
        with open(path) as f:
            raw: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as exc:
        raise _Refused(f"cannot read the cluster secret in {path}: {exc}") from exc
    if not isinstance(raw.get("secret"), str):
        raise _Refused(f"{path} holds no cluster secret (a cluster.json gives only client tokens: --client)")
    return raw


def _client_file(raw: dict[str, Any], services: list[tuple[str, int]]) -> dict[str, Any]:
    """A cluster.json for clients: addresses and the client credential, never the secret."""
    out: dict[str, Any] = {"cluster_id": raw.get("cluster_id", ""),
                           "metadata": {"host": services[0][0], "port": services[0][1]},
                           "client_secret": raw["client_secret"]}
    if len(services) > 1:
        out["metadata_services"] = [{"host": h, "port": p} for h, p in services]
    return out


# -- commands ---------------------------------------------------------------------------------
def cmd_serve_metadata(a: argparse.Namespace) -> int:
    a.host, a.port = _address(a.listen, "--listen")
    shown = _advertised((a.host, a.port), a.advertise)
    a.state = os.path.abspath(a.state)
    raw = _cluster_secret(a.state)
    if shown[1]:  # STATE/cluster.json: `stripefs status --cluster STATE` works on this host
        client = {**raw, "client_secret": role_credential(raw["secret"], "client")}
        _write_private(os.path.join(a.state, "cluster.json"), _client_file(client, [shown]))
    from stripefs.metadata.__main__ import run  # the service's imports only where it runs

    return run(a, raw["secret"], str(raw.get("cluster_id", "")), raw)


def cmd_serve_storage(a: argparse.Namespace) -> int:
    token = _decode(a, "join")
    addresses = _addresses(a.join, "--join")
    a.host, a.port = _address(a.listen, "--listen")
    a.advertise = _advertised((a.host, a.port), a.advertise)
    _check_token(addresses, token.credentials["server"], "server")
    a.metadata = a.join
    from stripefs.storage.__main__ import run

    return run(a, role_keys(token.credentials), token.cluster_id)


def cmd_token(a: argparse.Namespace) -> int:
    kind = "client" if a.client else "join"
    path = a.cluster_file or os.path.join(a.state, SECRET_FILE)
    if os.path.isdir(path):
        path = os.path.join(path, SECRET_FILE if os.path.exists(os.path.join(path, SECRET_FILE)) else "cluster.json")
    if kind == "client" and not _holds_secret(path):  # a cluster.json holds the client credential
        try:
            with open(path) as f:
                raw = json.load(f)
            credentials = {"client": str(raw["client_secret"])}
        except (OSError, ValueError, KeyError) as exc:
            raise _Refused(f"cannot read a client credential from {path}: {exc}") from exc
        print(encode_token(kind, str(raw.get("cluster_id", "")), credentials))
        return 0
    raw = _read_secret_file(path)
    credentials = {role: role_credential(raw["secret"], role) for role in _ROLES[kind]}
    print(encode_token(kind, str(raw.get("cluster_id", "")), credentials))
    return 0


def _holds_secret(path: str) -> bool:
    try:
        with open(path) as f:
            return "secret" in json.load(f)
    except (OSError, ValueError):
        return False


def cmd_client_config(a: argparse.Namespace) -> int:
    token = _decode(a, "client")
    addresses = _addresses(a.address, "ADDR")
    _check_token(addresses, token.credentials["client"], "client")
    config = _client_file({"cluster_id": token.cluster_id, "client_secret": token.credentials["client"]}, addresses)
    if a.output:
        _write_private(a.output, config)
    else:
        json.dump(config, sys.stdout, indent=2)
        print()
    return 0


def _guarded(fn: Any) -> Any:
    """Run a command; a :class:`_Refused` becomes its one line on stderr and its exit status."""
    def run(a: argparse.Namespace) -> int:
        try:
            return int(fn(a))
        except _Refused as exc:
            print(f"stripefs {a.cmd}{' ' + a.role if getattr(a, 'role', None) else ''}: {exc}", file=sys.stderr)
            return exc.status
    return run


def _token_options(sp: argparse.ArgumentParser, kind: str) -> None:
    sp.add_argument("--token", help=f"the {kind} token (visible in ps: prefer --token-file or ${TOKEN_ENV})")
    sp.add_argument("--token-file", help="a file holding the token (mode 0600)")


def _serve_parser() -> argparse.ArgumentParser:
    # The services' modules are imported here only: `stripefs ls` never loads them.
    from stripefs.metadata.__main__ import add_service_options as metadata_options
    from stripefs.storage.__main__ import add_service_options as storage_options

    sp = argparse.ArgumentParser(prog="stripefs serve", description="Run one role of a cluster on this host; "
                                                                    "see docs/deploy.md.")
    sp.set_defaults(cmd="serve")
    roles = sp.add_subparsers(dest="role", required=True, metavar="ROLE")
    mp = roles.add_parser("metadata", help="The metadata service: a new cluster, or the one whose state is in --state")
    mp.set_defaults(fn=_guarded(cmd_serve_metadata))
    mp.add_argument("--state", required=True, help=f"state directory: the cluster secret ({SECRET_FILE}, created "
                                                   "once, mode 0600) and the SQLite namespace")
    mp.add_argument("--store", help="postgresql://... to keep the namespace in PostgreSQL (shows in ps: prefer "
                                    f"metadata_store_url in STATE/{SECRET_FILE})")
    mp.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to bind (0.0.0.0: every interface)")
    mp.add_argument("--advertise", metavar="HOST[:PORT]", help="the address other hosts reach this one at "
                                                                "(default: --listen)")
    metadata_options(mp)
    stp = roles.add_parser("storage", help="A storage server joining the cluster at --join with a join token")
    stp.set_defaults(fn=_guarded(cmd_serve_storage))
    stp.add_argument("--join", required=True, metavar="ADDR", help="the metadata service, HOST:PORT[,HOST:PORT...]")
    _token_options(stp, "join")
    stp.add_argument("--root", required=True, help="the data directory (records its cluster on first use)")
    stp.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to bind (0.0.0.0: every interface)")
    stp.add_argument("--advertise", metavar="HOST[:PORT]",
                     help="the address registered with the cluster, which clients connect to (default: --listen)")
    storage_options(stp)
    return sp


def main(argv: list[str]) -> int:
    """``stripefs serve ROLE ...`` (``argv`` starts with "serve"); runs until the service stops."""
    a = _serve_parser().parse_args(argv[1:])
    return int(a.fn(a))


def add_parsers(sub: Any) -> None:
    """``token`` and ``client-config`` (``serve`` is :func:`main`, loaded only when run)."""
    tp = sub.add_parser("token", help="Print a join token for storage servers (--client: a client token)",
                        description="Print a token: a join token (storage servers: the server and client "
                                    "credentials) or, with --client, a client token. Never the cluster secret.")
    tp.set_defaults(fn=_guarded(cmd_token))
    where = tp.add_mutually_exclusive_group(required=True)
    where.add_argument("--state", help="the metadata service's state directory")
    where.add_argument("--cluster", dest="cluster_file",
                       help=f"a {SECRET_FILE} (`stripefs up`'s ROOT/{SECRET_FILE}), or a cluster.json for --client")
    tp.add_argument("--client", action="store_true", help="a client token (the client credential only)")
    cp = sub.add_parser("client-config", help="Write a cluster.json for clients from ADDR and a client token")
    cp.set_defaults(fn=_guarded(cmd_client_config))
    cp.add_argument("address", metavar="ADDR", help="the metadata service, HOST:PORT[,HOST:PORT...]")
    _token_options(cp, "client")
    cp.add_argument("-o", "--output", help="write it here (mode 0600) instead of stdout")
