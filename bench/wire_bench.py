"""CPU cost of the wire codec per message, against msgpack alone, measured in one run.

    python -m stripefs.bench.wire_bench [--rounds N] [--min-time S] [--json FILE | --json -]

For each common message (requests as the service receives them, replies as the
client receives them) it times, in microseconds per operation:

* ``encode``: ``to_header()`` and the frame prefix (``encode_prefix``), what a sender pays;
* ``decode``: feeding the frame to a :class:`wire.FrameDecoder`, ``next_head()`` and the
  typed decode (``decode_message`` / ``decode_reply``), what a receiver pays;
* ``floor``: ``msgpack.packb`` + ``unpackb`` of the same header map -- the part no
  codec in Python can drop, so ``(encode + decode) / floor`` is the codec's overhead
  and the figure to compare between runs on a loaded machine.

The ``roundtrip`` rows drive the two connection state machines through one whole
call, as the transports in ``rpc`` do (client ``send_request``; server
``receive_data``, ``next_event``, ``send_response``; client ``receive_data``,
``next_event``, ``decode_reply``); ``call_us`` is the wire's CPU per call, against
msgpack alone on both headers.

Each figure is the best of ``--rounds`` rounds (the least disturbed by other load) of
as many repetitions as fill ``--min-time`` seconds. Nothing is sent over a socket.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import msgpack

from stripefs import wire
from stripefs.bench._report import write_json
from stripefs.wire import messages as m

_LAYOUT = wire.Layout(4 << 20, (3, 1, 2, 7))
_FILE = wire.Attr(12345, 0o100644, 1, 1000, 1000, 1 << 20, 1_700_000_000_000_000_000, 1_700_000_000_000_000_001,
                  1_700_000_000_000_000_002, _LAYOUT, None, 0, 1)
_DIR = wire.Attr(2, 0o40755, 3, 0, 0, 0, 1_700_000_000_000_000_000, 1_700_000_000_000_000_000, 1_700_000_000_000_000_000)


def _entries(n: int) -> list[wire.DirEntry]:
    return [wire.DirEntry(f"file-{i:05d}.bin", 1000 + i, 0o100644,
                          wire.Attr(1000 + i, 0o100644, 1, 1000, 1000, 4096 + i, 10**18 + i, 10**18 + i, 10**18 + i,
                                    _LAYOUT, None, 0, 0)) for i in range(n)]


def requests() -> list[tuple[str, m.Message[Any]]]:
    """The requests the metadata service and storage servers see most."""
    return [
        ("Lookup", m.Lookup(parent=1, name="model.safetensors")),
        ("GetAttr", m.GetAttr(ino=12345)),
        ("Resolve", m.Resolve(path="/ckpt/step-001000/rank-0003.pt")),
        ("Create", m.Create(parent=1, name="rank-0003.pt", mode=0o100644, uid=1000, gid=1000, exclusive=True)),
        ("CreatePath", m.CreatePath(path="/ckpt/step-001000/rank-0003.pt", mode=0o100644, uid=1000, gid=1000)),
        ("Unlink", m.Unlink(parent=1, name="rank-0003.pt")),
        ("Readdir", m.Readdir(ino=1, after="file-00499.bin", limit=500, plus=True)),
        ("ReadChunk", m.ReadChunk(ino=12345, index=7, offset=0, length=1 << 20, chain=3, routing_version=9)),
        ("WriteChunk", m.WriteChunk(ino=12345, index=7, offset=0, crc=0x1234ABCD, chunk_size=4 << 20, chain=3,
                                    routing_version=9)),
    ]


def replies() -> list[tuple[str, type[m.Message[Any]], m.ReplyMessage]]:
    """The replies clients decode most, with the request class each answers."""
    return [
        ("AttrReply", m.GetAttr, m.AttrReply(attr=_FILE)),
        ("AttrReply(dir)", m.GetAttr, m.AttrReply(attr=_DIR)),
        ("CreateReply", m.Create, m.CreateReply(attr=_FILE, created=True)),
        ("ReaddirReply(500 plus)", m.Readdir, m.ReaddirReply(entries=_entries(500), more=False)),
        ("ReadChunkReply", m.ReadChunk, m.ReadChunkReply(length=1 << 20, chunk_length=4 << 20, crcs=list(range(16)))),
        ("WriteChunkReply", m.WriteChunk, m.WriteChunkReply(length=4 << 20, version=3)),
    ]


def _connected() -> tuple[wire.ClientConnection, wire.ServerConnection]:
    """A client and a server machine that have completed the handshake (bytes passed by hand)."""
    server = wire.ServerConnection("secret", "metadata", "bench")
    client = wire.ClientConnection(wire.role_credential("secret", "client"), b"c" * 16, "metadata")
    client.receive_data(server.start())
    assert client.next_event() is wire.NEED_DATA
    server.receive_data(client.data_to_send())
    assert isinstance(server.next_event(), wire.HandshakeComplete)
    client.receive_data(server.data_to_send())
    assert isinstance(client.next_event(), wire.HandshakeComplete)
    return client, server


def _roundtrips(rounds: int, min_time: float) -> list[dict[str, Any]]:
    """One whole call through both machines, for a few request/reply pairs."""
    pairs: list[tuple[str, m.Message[Any], m.ReplyMessage | wire.StripefsError]] = [
        ("GetAttr", m.GetAttr(ino=12345), m.AttrReply(attr=_FILE)),
        ("Create", m.Create(parent=1, name="rank-0003.pt", mode=0o100644, uid=1000, gid=1000, exclusive=True),
         m.CreateReply(attr=_FILE, created=True)),
        ("Unlink", m.Unlink(parent=1, name="rank-0003.pt"), m.AttrReply(attr=_FILE)),
        ("ReadChunk", m.ReadChunk(ino=12345, index=7, offset=0, length=4096, chain=3, routing_version=9),
         m.ReadChunkReply(length=4096, chunk_length=4 << 20, crcs=[1])),
        ("Lookup ENOENT", m.Lookup(parent=1, name="missing"),
         wire.StripefsError(wire.ErrorCode.NOT_FOUND, "no such file: 'missing'")),
    ]
    rows = []
    for name, msg, rep in pairs:
        client, server = _connected()
        request_header, reply_header = msg.to_header(), rep.to_wire() if isinstance(rep, Exception) else rep.to_header()

        def call(msg: m.Message[Any] = msg, rep: m.ReplyMessage | wire.StripefsError = rep,
                 client: wire.ClientConnection = client, server: wire.ServerConnection = server) -> object:
            _, data = client.send_request(msg)
            server.receive_data(data)
            ev = server.next_event()
            assert isinstance(ev, wire.RequestReceived)
            if isinstance(rep, wire.StripefsError):  # the service's answer to a failed request
                client.receive_data(server.send_error(ev.head, rep))
                failed = client.next_event()
                assert isinstance(failed, wire.ErrorReceived)
                return failed.error.code
            client.receive_data(server.send_response(ev.head, rep.to_header()))
            got = client.next_event()
            assert isinstance(got, wire.ResponseReceived)
            return wire.decode_reply(ev.message, got.header)

        assert call() == (rep.code if isinstance(rep, wire.StripefsError) else rep)

        def floor(request: dict[str, Any] = request_header, reply: dict[str, Any] = reply_header) -> object:
            return (msgpack.unpackb(msgpack.packb(request, use_bin_type=True), raw=False),
                    msgpack.unpackb(msgpack.packb(reply, use_bin_type=True), raw=False))

        total = _best_us(call, rounds, min_time)
        flo = _best_us(floor, rounds, min_time)
        rows.append({"message": f"{name} call", "kind": "roundtrip", "call_us": round(total, 2),
                     "floor_us": round(flo, 2), "ratio": round(total / flo, 2)})
    return rows


def _best_us(fn: Callable[[], object], rounds: int, min_time: float) -> float:
    """Best-of-``rounds`` µs per call of ``fn``, each round at least ``min_time`` seconds."""
    n = 1
    while True:  # calibrate: enough calls that one round lasts min_time
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time / 4:
            n = max(1, int(n * min_time / dt))
            break
        n *= 4
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def _decode_head(frame: bytes) -> wire.FrameHead:
    dec = wire.FrameDecoder()
    dec.feed(frame)
    head = dec.next_head()
    assert isinstance(head, wire.FrameHead)
    return head


def _row(name: str, kind: str, header: dict[str, Any], encode: Callable[[], object], decode: Callable[[], object],
         rounds: int, min_time: float) -> dict[str, Any]:
    body = msgpack.packb(header, use_bin_type=True)

    def floor() -> object:
        return msgpack.unpackb(msgpack.packb(header, use_bin_type=True), raw=False)

    enc = _best_us(encode, rounds, min_time)
    dec = _best_us(decode, rounds, min_time)
    flo = _best_us(floor, rounds, min_time)
    return {"message": name, "kind": kind, "header_bytes": len(body), "encode_us": round(enc, 2),
            "decode_us": round(dec, 2), "floor_us": round(flo, 2), "ratio": round((enc + dec) / flo, 2)}


def run(rounds: int = 5, min_time: float = 0.2) -> list[dict[str, Any]]:
    """One row per message: ``encode_us``, ``decode_us``, ``floor_us`` and their ratio."""
    rows = []
    for name, msg in requests():
        frame = wire.encode_prefix(msg.MSG_ID, 7, msg.to_header())
        assert wire.decode_message(msg.MSG_ID, _decode_head(frame).header) == msg

        def encode(msg: m.Message[Any] = msg) -> object:
            return wire.encode_prefix(msg.MSG_ID, 7, msg.to_header())

        def decode(frame: bytes = frame) -> object:
            head = _decode_head(frame)
            return wire.decode_message(head.msg_type, head.header)

        rows.append(_row(name, "request", msg.to_header(), encode, decode, rounds, min_time))
    for name, request, rep in replies():
        frame = wire.encode_prefix(request.MSG_ID, 7, rep.to_header(), 0, wire.FLAG_RESPONSE)
        assert wire.decode_reply(request, _decode_head(frame).header) == rep

        def encode_reply(rep: m.ReplyMessage = rep, msg_id: int = request.MSG_ID) -> object:
            return wire.encode_prefix(msg_id, 7, rep.to_header(), 0, wire.FLAG_RESPONSE)

        def decode_reply(frame: bytes = frame, request: type[m.Message[Any]] = request) -> object:
            return wire.decode_reply(request, _decode_head(frame).header)

        rows.append(_row(name, "reply", rep.to_header(), encode_reply, decode_reply, rounds, min_time))
    return rows + _roundtrips(rounds, min_time)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.wire_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds per figure; the best is kept (default 5)")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds per round (default 0.2)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout only)")
    args = p.parse_args(argv)
    rows = run(args.rounds, args.min_time)
    out = {"bench": "wire", "unit": "us_per_op", "python": sys.version.split()[0], "rows": rows}
    if args.json == "-":
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'message':<24}{'kind':<9}{'bytes':>7}{'encode µs':>11}{'decode µs':>11}{'msgpack µs':>12}{'ratio':>7}")
    for r in rows:
        if r["kind"] == "roundtrip":
            print(f"{r['message']:<24}{r['kind']:<9}{'':>7}{'whole call':>11}{r['call_us']:>11.2f}"
                  f"{r['floor_us']:>12.2f}{r['ratio']:>7.2f}")
        else:
            print(f"{r['message']:<24}{r['kind']:<9}{r['header_bytes']:>7}{r['encode_us']:>11.2f}{r['decode_us']:>11.2f}"
                  f"{r['floor_us']:>12.2f}{r['ratio']:>7.2f}")
    if args.json:
        write_json(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
