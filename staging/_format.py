"""The checkpoint format: raw aligned tensor bytes, a JSON manifest, no pickle on load.

A committed step is a directory::

    step-000100/
        data-00000.bin     tensor bytes, each tensor at an aligned offset (raw or zstd frames)
        data-00001.bin     ... (one file per ``shard_bytes`` of tensors)
        manifest.json      written last: files + checksums, tensor index, value tree

The manifest's ``tree`` encodes the state dict with tagged JSON nodes (see
:func:`encode_tree`); tensors are referenced by index into ``tensors``. Values
that have no JSON form fall back to ``torch.save`` bytes that are loaded with
``torch.load(weights_only=True)`` — the restricted unpickler — never with
plain ``pickle``. See ``docs/checkpoint-format.md``.
"""

from __future__ import annotations

import base64
import errno
import io
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch

__all__ = [
    "FORMAT", "VERSION", "CHECK_CHUNK", "MANIFEST", "ChecksumError", "CheckpointConflict",
    "TensorEntry", "Plan", "plan_state_dict", "decode_tree", "chunk_crcs", "dtype_from_name",
    "manifest_bytes", "parse_manifest", "plain_name",
]

FORMAT = "stripefs-checkpoint"
VERSION = 2  # 2: the manifest carries its own CRC32C (version 1, without it, is still read)
MANIFEST = "manifest.json"
CHECKSUM_KEY = "manifest_crc32c"
CHECK_CHUNK = 4 << 20  # granularity of per-chunk checksums (and of zstd frames)
PAGE = 4096
SMALL = 64 << 10  # tensors below this are 64-byte aligned, larger ones page aligned
DEFAULT_SHARD = 512 << 20


class ChecksumError(OSError):
    """Stored bytes do not match their recorded CRC32C (errno EIO); the data is not used."""

    def __init__(self, message: str, filename: str | None = None):
        super().__init__(errno.EIO, message, filename)


class CheckpointConflict(FileExistsError):
    """Another writer already committed a different checkpoint under this URL (errno EEXIST)."""

    def __init__(self, message: str, filename: str | None = None):
        super().__init__(errno.EEXIST, message, filename)


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def chunk_crcs(view: memoryview, chunk: int = CHECK_CHUNK) -> tuple[int, list[int]]:
    """CRC32C of the whole buffer and of each ``chunk``-sized piece of it."""
    total = 0
    crcs = []
    for off in range(0, len(view), chunk):
        piece = view[off : off + chunk]
        crcs.append(crc32c.crc32c(piece))
        total = crc32c.crc32c(piece, total)
    return total, crcs


_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"checkpoint uses unsupported dtype {name!r}") from None


@dataclass
class TensorEntry:
    """Where one tensor's bytes live: file index, offset in the file, dtype, shape."""

    tensor: torch.Tensor | None
    file: int
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    numpy: bool = False
    crc: int = 0

    def index_record(self) -> dict[str, Any]:
        return {"file": self.file, "offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype,
                "shape": self.shape, "numpy": self.numpy}


@dataclass
class Plan:
    """A state dict laid out into data files; ``file_sizes[i]`` bytes of file ``i``."""

    tree: Any
    tensors: list[TensorEntry] = field(default_factory=list)
    file_sizes: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.file_sizes)


def plan_state_dict(state: Any, shard_bytes: int = DEFAULT_SHARD) -> Plan:
    """Encode ``state`` into a tagged tree and assign every tensor an aligned slot.

    Raises:
        TypeError: for tensors that have no raw byte form (sparse, quantized, meta).
    """
    plan = Plan(tree=None, file_sizes=[0])
    seen: dict[int, int] = {}  # id(tensor) -> index: tied weights are stored once

    keep: list[Any] = []  # holds keys of ``seen`` alive so that ids stay unique

    def add(orig: Any, t: torch.Tensor, is_numpy: bool) -> dict[str, Any]:
        if id(orig) in seen:
            return {"t": seen[id(orig)]}
        keep.append(orig)
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise TypeError(f"cannot checkpoint a {t.layout} / quantized / meta tensor raw")
        nbytes = t.numel() * t.element_size()
        a = PAGE if nbytes >= SMALL else 64
        off = align_up(plan.file_sizes[-1], a)
        if off > 0 and off + nbytes > shard_bytes:
            plan.file_sizes[-1] = align_up(plan.file_sizes[-1], PAGE)
            plan.file_sizes.append(0)
            off = 0
        plan.file_sizes[-1] = off + nbytes
        idx = len(plan.tensors)
        plan.tensors.append(TensorEntry(t, len(plan.file_sizes) - 1, off, nbytes,
                                        str(t.dtype).removeprefix("torch."), list(t.shape), is_numpy))
        seen[id(orig)] = idx
        return {"t": idx}

    def enc(v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"f": repr(v)}
        if isinstance(v, torch.Tensor):
            return add(v, v.detach(), False)
        if type(v).__module__ == "numpy" and type(v).__name__ == "ndarray" and v.dtype != object:
            return add(v, torch.from_numpy(v), True)
        if isinstance(v, torch.Size):
            return {"sz": list(v)}
        if isinstance(v, torch.dtype):
            return {"dt": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"dev": str(v)}
        if isinstance(v, bytes):
            return {"b": base64.b64encode(v).decode()}
        if type(v) in (dict, OrderedDict):
            return {"od" if type(v) is OrderedDict else "d": [[enc(k), enc(x)] for k, x in v.items()]}
        if type(v) is list:
            return {"l": [enc(x) for x in v]}
        if type(v) is tuple:
            return {"u": [enc(x) for x in v]}
        # No JSON form: torch.save bytes, loaded only through the weights_only unpickler.
        buf = io.BytesIO()
        torch.save(v, buf)
        return {"p": base64.b64encode(buf.getvalue()).decode()}

    plan.tree = enc(state)
    plan.file_sizes = [align_up(s, PAGE) for s in plan.file_sizes] if plan.tensors else []
    return plan


def decode_tree(node: Any, tensors: list[Any]) -> Any:
    """Inverse of the encoding in :func:`plan_state_dict`; ``tensors`` by index.

    Raises:
        ValueError: for an unknown node tag (a corrupt or newer manifest).
        pickle.UnpicklingError: a fallback value needs a type the restricted loader refuses.
    """
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"malformed manifest tree node: {node!r:.80}")
    (tag, v), = node.items()
    if tag == "t":
        if type(v) is not int or not 0 <= v < len(tensors):
            raise ValueError(f"manifest tree names tensor {v!r:.40}, not one of its {len(tensors)}")
        return tensors[v]
    if tag in ("d", "od"):
        items = [(_hashable(decode_tree(k, tensors)), decode_tree(x, tensors)) for k, x in v]
        return OrderedDict(items) if tag == "od" else dict(items)
    if tag == "l":
        return [decode_tree(x, tensors) for x in v]
    if tag == "u":
        return tuple(decode_tree(x, tensors) for x in v)
    if tag == "f":
        return float(v)
    if tag == "sz":
        return torch.Size(v)
    if tag == "dt":
        return dtype_from_name(v)
    if tag == "dev":
        return torch.device(v)
    if tag == "b":
        return base64.b64decode(v)
    if tag == "p":
        return torch.load(io.BytesIO(base64.b64decode(v)), weights_only=True)
    raise ValueError(f"unknown manifest tree tag {tag!r}")


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """Serialize a manifest, its CRC32C appended as the last key.

    The CRC32C covers the exact bytes of the manifest without that key (``{...}``), so a reader
    checks the bytes it read, not a re-serialization: ``{...,"manifest_crc32c":N}``.
    """
    body = json.dumps({k: v for k, v in manifest.items() if k != CHECKSUM_KEY}, separators=(",", ":"),
                      allow_nan=False).encode()
    sep = b"," if body != b"{}" else b""
    return body[:-1] + sep + b'"%s":%d}' % (CHECKSUM_KEY.encode(), crc32c.crc32c(body))


_CHECKSUM_TAIL = re.compile(rb'(,?)"' + CHECKSUM_KEY.encode() + rb'":(\d+)\}\s*$')
_CKPT_ID = re.compile(r"[0-9a-f]{32}")


def plain_name(name: Any) -> bool:
    """True for a name that is safe to join below a directory: one path component, not special."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name
            and "\\" not in name and "\0" not in name)


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """Parse, check and validate a manifest; the returned dict has no checksum key.

    Every field that later becomes a path (``id``, file names) or a size, offset or index is
    checked here, so a damaged or hostile manifest never reaches a path join or an allocation.

    Raises:
        ChecksumError: not JSON, not a manifest of this format/version, its CRC32C does not match
            (or is missing from a version 2 manifest), or a field is malformed.
    """
    try:
        man = json.loads(raw)
    except ValueError as exc:
        raise ChecksumError(f"manifest is not valid JSON: {exc}", where) from exc
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise ChecksumError("not a stripefs checkpoint manifest", where)
    version = man.get("version", 0)
    if type(version) is not int or version > VERSION:
        raise ChecksumError(f"manifest version {version!r} is newer than this reader ({VERSION})", where)
    tail = _CHECKSUM_TAIL.search(raw)
    if CHECKSUM_KEY in man:
        if tail is None:
            raise ChecksumError("manifest checksum is not its last key", where)
        body = raw[: tail.start()] + b"}"
        if crc32c.crc32c(body) != int(tail.group(2)):
            raise ChecksumError("manifest checksum mismatch (the manifest was changed or damaged)", where)
        del man[CHECKSUM_KEY]
    elif version >= 2:
        raise ChecksumError("manifest has no checksum", where)
    _validate(man, where)
    return man


def _validate(man: dict[str, Any], where: str) -> None:
    """Raise ChecksumError unless every field a reader relies on has a sane type and range."""
    def bad(what: str) -> ChecksumError:
        return ChecksumError(f"malformed manifest: {what}", where)

    def count(x: Any) -> bool:
        return type(x) is int and x >= 0

    if not isinstance(man.get("id"), str) or not _CKPT_ID.fullmatch(man["id"]):
        raise bad(f"id {man.get('id')!r:.60} is not a checkpoint id (32 hex digits)")
    kind = man.get("kind", "state_dict")
    if kind not in ("state_dict", "dcp"):
        raise bad(f"unknown kind {kind!r:.40}")
    files = man.get("files")
    if not isinstance(files, list):
        raise bad("files is not a list")
    names: set[str] = set()
    limits: list[int] = []
    for rec in files:
        if not isinstance(rec, dict) or not plain_name(rec.get("name")):
            raise bad(f"file name {rec.get('name') if isinstance(rec, dict) else rec!r:.60} is not a plain relative name")
        name = rec["name"]
        if name in names:
            raise bad(f"file {name!r} is listed twice")
        names.add(name)
        size, chunk, crcs = rec.get("size"), rec.get("chunk"), rec.get("chunk_crc32c")
        if not count(size) or type(rec.get("crc32c")) is not int or not count(chunk) or chunk == 0:
            raise bad(f"file {name!r}: size, crc32c or chunk missing or invalid")
        if not isinstance(crcs, list) or len(crcs) != -(-size // chunk) or not all(type(c) is int for c in crcs):
            raise bad(f"file {name!r}: chunk_crc32c does not match its size")
        encoding = rec.get("encoding", "raw")
        if encoding == "zstd":
            frames = rec.get("frames")
            if not count(rec.get("raw_size")) or not isinstance(frames, list) or not all(
                    isinstance(f, list) and len(f) == 3 and all(count(x) for x in f) for f in frames):
                raise bad(f"file {name!r}: zstd raw_size or frames invalid")
            limits.append(rec["raw_size"])
        elif encoding == "raw":
            limits.append(size)
        else:
            raise bad(f"file {name!r}: unknown encoding {encoding!r:.20}")
    if kind == "dcp":
        return
    tensors = man.get("tensors")
    if not isinstance(tensors, list) or "tree" not in man:
        raise bad("tensors or tree missing")
    for i, e in enumerate(tensors):
        if not isinstance(e, dict) or type(e.get("file")) is not int or not 0 <= e["file"] < len(files):
            raise bad(f"tensor {i} names no listed file")
        off, nbytes, shape = e.get("offset"), e.get("nbytes"), e.get("shape")
        if not count(off) or not count(nbytes) or off + nbytes > limits[e["file"]] or type(e.get("crc32c")) is not int:
            raise bad(f"tensor {i}: offset, nbytes or crc32c invalid (past the end of its file?)")
        try:
            itemsize = dtype_from_name(e.get("dtype")).itemsize
        except (ValueError, TypeError):
            raise bad(f"tensor {i}: unsupported dtype {e.get('dtype')!r:.20}") from None
        if not isinstance(shape, list) or not all(count(d) for d in shape) or math.prod(shape) * itemsize != nbytes:
            raise bad(f"tensor {i}: shape {shape!r:.60} does not match nbytes")
