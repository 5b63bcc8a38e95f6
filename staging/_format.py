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

import argparse
import base64
import datetime
import errno
import io
import json
import math
import re
import sys
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch

__all__ = [
    "FORMAT", "VERSION", "BASE_VERSION", "CHECK_CHUNK", "MANIFEST", "ChecksumError", "CheckpointConflict",
    "TensorEntry", "Plan", "plan_state_dict", "decode_tree", "chunk_crcs", "dtype_from_name",
    "manifest_bytes", "manifest_with", "parse_manifest", "plain_name",
]

FORMAT = "stripefs-checkpoint"
VERSION = 4  # the newest version this reader knows
# 2: the manifest carries its own CRC32C (version 1, without it, is still read). 3: shared
# storages (view entries), more dtypes and tree tags. 4: tensor entries say ``param``
# (an nn.Parameter) and ``requires_grad``. A writer writes the lowest version whose features
# it uses, so that older readers still read every checkpoint they can.
BASE_VERSION = 2
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


class CheckpointSuperseded(CheckpointConflict):
    """A later save of the same step from the same staging directory took this one's place
    (a resumed run saved again the step its dead predecessor left behind)."""


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def chunk_crcs(view: memoryview, chunk: int = CHECK_CHUNK) -> tuple[int, list[int]]:
    """CRC32C of the whole buffer and of each ``chunk``-sized piece of it, in one pass.

    The whole-file CRC is combined from the pieces' (:func:`crc_combine`) instead of being a
    second pass over the bytes; only a short last piece is read twice.
    """
    total = 0
    crcs = []
    for off in range(0, len(view), chunk):
        piece = view[off : off + chunk]
        crcs.append(crc32c.crc32c(piece))
        total = crc_combine(total, crcs[-1], len(piece)) if len(piece) == chunk else crc32c.crc32c(piece, total)
    return total, crcs


_SHIFTS: dict[int, list[int]] = {}


def _shift(n: int) -> list[int]:
    """Columns of the linear map taking a CRC32C value to its value after ``n`` more zero bytes,
    less the constant part: ``shift(x) = crc32c(zeros(n), x) ^ crc32c(zeros(n), 0)``."""
    cols = _SHIFTS.get(n)
    if cols is None:
        zeros = bytes(n)
        base = crc32c.crc32c(zeros, 0)
        cols = _SHIFTS[n] = [crc32c.crc32c(zeros, 1 << i) ^ base for i in range(32)]
    return cols


def crc_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)`` (zlib's crc32_combine idea).

    ``crc(a + b) = S(crc(a)) ^ crc(b)`` where ``S`` is linear over GF(2) and depends only on
    ``len(b)``; its 32 columns are computed once per length and cached (use a few lengths).
    """
    cols, r, i = _shift(len_b), 0, 0
    while crc_a:
        if crc_a & 1:
            r ^= cols[i]
        crc_a >>= 1
        i += 1
    return r ^ crc_b


_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)}
# Stored raw like the others, but newer (version 3): a reader older than that refuses the
# manifest as a whole instead of failing on the dtype. Only the names this torch has.
_DTYPES_V3 = {n: getattr(torch, n) for n in (
    "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
) if isinstance(getattr(torch, n, None), torch.dtype)}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES.get(name) or _DTYPES_V3[name]
    except (KeyError, TypeError):
        raise ValueError(f"checkpoint uses unsupported dtype {name!r}") from None


@dataclass
class TensorEntry:
    """One tensor of the index: its own bytes (file, offset) or a view of a stored storage.

    A view (``base`` set) has no bytes of its own: it is ``shape``/``stride`` over the bytes of
    entry ``base`` from ``byte_offset`` on, which is how tensors sharing one storage (tied
    weights, a weight and its transpose) are written once and come back sharing it.
    """

    tensor: torch.Tensor | None
    file: int
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    numpy: bool = False
    crc: int = 0
    base: int | None = None
    byte_offset: int = 0
    stride: list[int] | None = None
    param: bool = False  # an nn.Parameter (version 4)
    requires_grad: bool = False  # (version 4)

    def index_record(self) -> dict[str, Any]:
        if self.base is not None:
            rec = {"base": self.base, "byte_offset": self.byte_offset, "nbytes": self.nbytes, "dtype": self.dtype,
                   "shape": self.shape, "stride": self.stride, "numpy": False}
        else:
            rec = {"file": self.file, "offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype,
                   "shape": self.shape, "numpy": self.numpy, "crc32c": self.crc}
        if self.param:  # only when set: a checkpoint without them stays readable by older readers
            rec["param"] = True
        if self.requires_grad:
            rec["requires_grad"] = True
        return rec


@dataclass
class Plan:
    """A state dict laid out into data files; ``file_sizes[i]`` bytes of file ``i``.

    ``version`` is the manifest version the plan needs: 2 unless it uses something newer.
    """

    tree: Any
    tensors: list[TensorEntry] = field(default_factory=list)
    file_sizes: list[int] = field(default_factory=list)
    version: int = 2

    @property
    def nbytes(self) -> int:
        return sum(self.file_sizes)


def _where(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


_FACTORIES: dict[str, Any] = {"None": None, "list": list, "dict": dict, "set": set, "int": int, "float": float,
                              "str": str, "bytes": bytes, "tuple": tuple, "frozenset": frozenset,
                              "OrderedDict": OrderedDict}
_NUMPY_KINDS = "biufcmM"  # scalars stored as raw bytes + dtype string; never object or structured


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)``: the bytes of its storage that ``t`` can reach (strides are never negative)."""
    isz = t.element_size()
    lo = int(t.storage_offset()) * isz
    return lo, lo + (sum(int(n - 1) * int(st) for n, st in zip(t.shape, t.stride())) + 1) * isz


def _keeps_layout(t: torch.Tensor) -> bool:
    """Whether ``t`` is stored as the bytes of its storage it spans, with its strides, instead of
    contiguously: it is not contiguous, and that span is no larger than its own bytes (a dense
    permutation such as channels_last or a transpose, or stride-0 dimensions). A slice with
    gaps is stored contiguously: its span would store bytes nobody saved."""
    if t.is_contiguous() or not t.numel():
        return False
    lo, hi = _byte_span(t)
    return hi - lo <= t.numel() * t.element_size()


def plan_state_dict(state: Any, shard_bytes: int = DEFAULT_SHARD) -> Plan:
    """Encode ``state`` into a tagged tree and assign every tensor an aligned slot.

    Everything written must load: a value with no tagged form is stored with ``torch.save``
    only after ``torch.load(weights_only=True)`` gave it back as the same type. Tensors that
    overlap in one storage are stored once, as that part of the storage, and indexed as views
    of it; conjugate and negative-bit views are stored resolved.

    Raises:
        TypeError: naming the key, for a value that could not be loaded back: a tensor with no
            raw form (sparse, quantized, meta) or an unsupported dtype, a numpy array torch cannot
            hold, or a value the restricted unpickler refuses (a class, a namedtuple, ...).
    """
    plan = Plan(tree=None)
    objects: list[tuple[torch.Tensor, bool]] = []  # (tensor as stored, from numpy), by tree index
    autograd: dict[int, tuple[bool, bool]] = {}  # tree index -> (nn.Parameter, requires_grad)
    seen: dict[int, int] = {}  # id(tensor) -> index: the very same object is stored once
    keep: list[Any] = []  # holds keys of ``seen`` alive so that ids stay unique
    np = sys.modules.get("numpy")  # no numpy imported: no numpy values to handle

    def bad(path: tuple[Any, ...], why: str) -> TypeError:
        return TypeError(f"cannot checkpoint {_where(path)}: {why}")

    def add(orig: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        if id(orig) in seen:
            return {"t": seen[id(orig)]}
        if isinstance(orig, torch.Tensor):
            t, is_numpy = orig.detach(), False
            if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
                raise bad(path, f"a {t.layout} / quantized / meta tensor has no raw form")
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()  # lazy bits have no byte view: store the values
        else:
            if not orig.dtype.isnative:  # torch holds native byte order only; the load would differ
                raise bad(path, f"numpy array in non-native byte order {orig.dtype.str} (convert it with "
                                "arr.astype(arr.dtype.newbyteorder('=')))")
            try:
                t, is_numpy = torch.from_numpy(orig), True
            except ValueError:  # negative strides: torch cannot view them, a copy it can
                t, is_numpy = torch.from_numpy(sys.modules["numpy"].ascontiguousarray(orig)), True
            except TypeError as exc:
                raise bad(path, f"numpy dtype {orig.dtype} has no torch equivalent ({exc})") from None
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES and name not in _DTYPES_V3:
            raise bad(path, f"dtype {name} is not supported by the checkpoint format")
        if name in _DTYPES_V3:
            plan.version = max(plan.version, 3)
        keep.append(orig)
        seen[id(orig)] = len(objects)
        if not is_numpy and (type(orig) is torch.nn.Parameter or orig.requires_grad):
            autograd[len(objects)] = (type(orig) is torch.nn.Parameter, bool(orig.requires_grad))
            plan.version = max(plan.version, 4)
        objects.append((t, is_numpy))
        return {"t": len(objects) - 1}

    def checked(path: tuple[Any, ...], v: Any, node: dict[str, Any]) -> dict[str, Any]:
        """A leaf encoded with a newer tag, kept only when it decodes to an equal value of its type."""
        try:
            back = decode_tree(node, [])
        except (ValueError, TypeError, OverflowError) as exc:
            raise bad(path, f"{type(v).__name__} does not round-trip ({exc})") from None
        if np is not None and isinstance(v, np.generic):  # by bytes: a NaN is not equal to itself
            same = type(back) is type(v) and back.dtype == v.dtype and back.tobytes() == v.tobytes()
        else:  # a datetime equal in UTC but with another zone would not be the same value
            same = type(back) is type(v) and back == v and getattr(back, "tzinfo", None) == getattr(v, "tzinfo", None) \
                and (getattr(v, "tzinfo", None) is None or back.tzname() == v.tzname())
        if not same:
            raise bad(path, f"{type(v).__name__} {v!r:.60} does not round-trip")
        plan.version = max(plan.version, 3)
        return node

    def items(v: Any, path: tuple[Any, ...]) -> list[list[Any]]:
        return [[enc(k, path + (k,)), enc(x, path + (k,))] for k, x in v.items()]

    def enc(v: Any, path: tuple[Any, ...]) -> Any:
        if np is not None and isinstance(v, np.generic) and v.dtype.kind in _NUMPY_KINDS:
            return checked(path, v, {"nps": [v.dtype.str, base64.b64encode(v.tobytes()).decode()]})
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"f": repr(v)}
        if isinstance(v, torch.Tensor):
            return add(v, path)
        if np is not None and type(v) is np.ndarray and v.dtype != object:
            return add(v, path)
        if isinstance(v, torch.Size):
            return {"sz": list(v)}
        if isinstance(v, torch.dtype):
            return {"dt": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"dev": str(v)}
        if isinstance(v, bytes):
            return {"b": base64.b64encode(v).decode()}
        if type(v) in (dict, OrderedDict):
            return {"od" if type(v) is OrderedDict else "d": items(v, path)}
        if type(v) is list:
            return {"l": [enc(x, path + (i,)) for i, x in enumerate(v)]}
        if type(v) is tuple:
            return {"u": [enc(x, path + (i,)) for i, x in enumerate(v)]}
        if type(v) is defaultdict:
            factory = next((n for n, f in _FACTORIES.items() if f is v.default_factory), None)
            if factory is None:
                raise bad(path, f"defaultdict with default_factory {v.default_factory!r:.40} (only builtin types load back)")
            plan.version = max(plan.version, 3)
            return {"dd": [factory, items(v, path)]}
        if type(v) is argparse.Namespace:
            plan.version = max(plan.version, 3)
            return {"ns": items(vars(v), path)}
        if type(v) is slice:
            plan.version = max(plan.version, 3)
            return {"sl": [enc(v.start, path + ("start",)), enc(v.stop, path + ("stop",)), enc(v.step, path + ("step",))]}
        if type(v) is range:
            plan.version = max(plan.version, 3)
            return {"rg": [v.start, v.stop, v.step]}
        if type(v) is frozenset:
            plan.version = max(plan.version, 3)
            return {"fz": [enc(x, path + (i,)) for i, x in enumerate(v)]}
        if type(v) is datetime.datetime:
            return checked(path, v, {"dtm": [v.isoformat(), v.fold]})
        if type(v) is datetime.date:
            return checked(path, v, {"dat": v.isoformat()})
        if type(v) is datetime.time:
            return checked(path, v, {"tim": [v.isoformat(), v.fold]})
        if type(v) is datetime.timedelta:
            return checked(path, v, {"tdl": [v.days, v.seconds, v.microseconds]})
        # No JSON form: torch.save bytes, loaded only through the weights_only unpickler — so
        # try that now: a value it refuses would make the whole checkpoint unloadable.
        buf = io.BytesIO()
        try:
            torch.save(v, buf)
            back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - pickling and the restricted unpickler raise many kinds
            raise bad(path, f"{type(v).__module__}.{type(v).__qualname__} cannot be loaded back with "
                            f"torch.load(weights_only=True): {str(exc).splitlines()[0]:.200}") from None
        if type(back) is not type(v):
            raise bad(path, f"{type(v).__qualname__} loads back as {type(back).__qualname__}")
        return {"p": base64.b64encode(buf.getvalue()).decode()}

    plan.tree = enc(state, ())
    _lay_out(plan, objects, shard_bytes)
    for i, (param, grad) in autograd.items():  # plan.tensors[i] is tree object i
        plan.tensors[i].param, plan.tensors[i].requires_grad = param, grad
    return plan


def _lay_out(plan: Plan, objects: list[tuple[torch.Tensor, bool]], shard_bytes: int) -> None:
    """Fill ``plan.tensors`` (index i: object i of the tree, then shared storages) and the files.

    Tensors whose bytes overlap in one storage form a group, stored once as the storage bytes
    they span (an entry of its own, after the objects) and indexed as views of it. So is a
    tensor alone in its storage whose layout is not contiguous but spans no more bytes than it
    holds (:func:`_keeps_layout`: channels_last, a transpose, an expanded tensor), so that it
    loads with its strides: its memory format, or its stride-0 dimensions, unexpanded.
    """
    entries: list[TensorEntry | None] = [None] * len(objects)
    by_storage: dict[tuple[Any, int], list[int]] = {}
    for i, (t, is_numpy) in enumerate(objects):
        if not is_numpy and t.numel() and t.element_size():
            try:
                key = (t.device, t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a wrapper subclass with no storage of its own
                continue
            by_storage.setdefault(key, []).append(i)
    bases: list[TensorEntry] = []
    for members in by_storage.values():
        if len(members) < 2 and not _keeps_layout(objects[members[0]][0]):
            continue
        spans = sorted((_byte_span(objects[i][0]), i) for i in members)
        groups: list[tuple[int, int, list[int]]] = []
        for (lo, hi), i in spans:
            if groups and lo < groups[-1][1]:  # overlaps the group so far: the same bytes
                glo, ghi, g = groups[-1]
                groups[-1] = (glo, max(ghi, hi), g + [i])
            else:
                groups.append((lo, hi, [i]))
        for lo, hi, g in groups:
            if len(g) < 2 and not _keeps_layout(objects[g[0]][0]):
                continue
            lo -= lo % 16  # every view's offset stays a multiple of its item size (at most 16)
            src = objects[g[0]][0]
            whole = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src.untyped_storage(), lo, (hi - lo,), (1,))
            j = len(objects) + len(bases)
            bases.append(TensorEntry(whole, 0, 0, hi - lo, "uint8", [hi - lo]))
            for i in g:
                t = objects[i][0]
                entries[i] = TensorEntry(None, 0, 0, t.numel() * t.element_size(), str(t.dtype).removeprefix("torch."),
                                         list(t.shape), base=j, byte_offset=int(t.storage_offset()) * t.element_size() - lo,
                                         stride=list(t.stride()))
            plan.version = max(plan.version, 3)
    for i, (t, is_numpy) in enumerate(objects):
        if entries[i] is None:
            entries[i] = TensorEntry(t, 0, 0, t.numel() * t.element_size(), str(t.dtype).removeprefix("torch."),
                                     list(t.shape), is_numpy)
    plan.tensors = [e for e in entries if e is not None] + bases
    sizes = [0]
    for e in plan.tensors:
        if e.base is not None:
            continue
        a = PAGE if e.nbytes >= SMALL else 64
        off = align_up(sizes[-1], a)
        if off > 0 and off + e.nbytes > shard_bytes:
            sizes[-1] = align_up(sizes[-1], PAGE)
            sizes.append(0)
            off = 0
        sizes[-1] = off + e.nbytes
        e.file, e.offset = len(sizes) - 1, off
    plan.file_sizes = [align_up(n, PAGE) for n in sizes] if plan.tensors else []


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
    return _decode_v3(tag, v, tensors)


def _decode_v3(tag: str, v: Any, tensors: list[Any]) -> Any:
    """The tags of version 3: values that load exactly without any unpickling."""
    if tag == "nps":
        import numpy as np

        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)):
            raise ValueError("malformed numpy scalar node")
        try:  # only byte-order + kind + size strings ("<f4", "|b1", "<M8[s]") reach np.dtype
            dt = np.dtype(v[0]) if v[0][:1] in ("<", ">", "|", "=") and v[0][1:2] in tuple(_NUMPY_KINDS) else None
        except TypeError:
            dt = None
        raw = base64.b64decode(v[1])
        if dt is None or dt.kind not in _NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None or len(raw) != dt.itemsize:
            raise ValueError(f"malformed numpy scalar node {v!r:.60}")
        return np.frombuffer(raw, dtype=dt)[0]
    if tag == "dd":
        if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and v[0] in _FACTORIES):
            raise ValueError(f"malformed defaultdict node {v!r:.60}")
        return defaultdict(_FACTORIES[v[0]], [(_hashable(decode_tree(k, tensors)), decode_tree(x, tensors)) for k, x in v[1]])
    if tag == "ns":
        return argparse.Namespace(**{str(decode_tree(k, tensors)): decode_tree(x, tensors) for k, x in v})
    if tag == "sl":
        return slice(*(decode_tree(x, tensors) for x in v))
    if tag == "rg":
        if not (isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v)):
            raise ValueError(f"malformed range node {v!r:.60}")
        return range(*v)
    if tag == "fz":
        return frozenset(_hashable(decode_tree(x, tensors)) for x in v)
    if tag == "dtm":
        return datetime.datetime.fromisoformat(v[0]).replace(fold=v[1])
    if tag == "dat":
        return datetime.date.fromisoformat(v)
    if tag == "tim":
        return datetime.time.fromisoformat(v[0]).replace(fold=v[1])
    if tag == "tdl":
        return datetime.timedelta(days=v[0], seconds=v[1], microseconds=v[2])
    raise ValueError(f"unknown manifest tree tag {tag!r}")


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def step_order(name: str) -> tuple[int, str]:
    """How steps of a series rank, newest last: the trailing number of the directory's name
    (``step-000200`` is 200; none: -1), then the name. ``latest()`` picks the greatest and
    retention keeps the greatest, so the two can never disagree about which step is newest."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    found = re.search(r"(\d+)$", base)
    return (int(found.group(1)) if found else -1, base)


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """Serialize a manifest, its CRC32C appended as the last key.

    The CRC32C covers the exact bytes of the manifest without that key (``{...}``), so a reader
    checks the bytes it read, not a re-serialization: ``{...,"manifest_crc32c":N}``.
    """
    body = json.dumps({k: v for k, v in manifest.items() if k != CHECKSUM_KEY}, separators=(",", ":"),
                      allow_nan=False).encode()
    sep = b"," if body != b"{}" else b""
    return body[:-1] + sep + b'"%s":%d}' % (CHECKSUM_KEY.encode(), crc32c.crc32c(body))


def manifest_with(raw: bytes, key: str, value: Any) -> bytes:
    """``raw`` (a checksummed manifest) with ``key`` set to ``value``, its checksum recomputed.

    For what only the commit knows (``durability``): the bytes before are kept as they are, the
    key is appended (replacing one already there), no tensor index is re-encoded.
    """
    tail = _CHECKSUM_TAIL.search(raw)
    if tail is None:
        raise ValueError("manifest has no checksum")
    body = raw[: tail.start()] + b"}"
    if b'"%s":' % key.encode() in body and key in json.loads(body):  # parsed only when it may be there
        man = json.loads(body)
        man.pop(key)
        body = json.dumps(man, separators=(",", ":"), allow_nan=False).encode()
    extra = json.dumps({key: value}, separators=(",", ":"), allow_nan=False).encode()
    body = body[:-1] + (b"," if body != b"{}" else b"") + extra[1:]
    return body[:-1] + b',"%s":%d}' % (CHECKSUM_KEY.encode(), crc32c.crc32c(body))


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
    if "ranks" in man:  # saved by several ranks: how many files, tensors and keys are each rank's
        ranks, tree = man["ranks"], man["tree"]
        if not isinstance(ranks, list) or not ranks or not all(
                isinstance(r, dict) and all(count(r.get(k)) for k in ("files", "tensors", "keys")) for r in ranks):
            raise bad("ranks is not a list of file, tensor and key counts")
        if not (isinstance(tree, dict) and isinstance(tree.get("d"), list)) or [
                sum(r[k] for r in ranks) for k in ("files", "tensors", "keys")] != [len(files), len(tensors),
                                                                                     len(tree["d"])]:
            raise bad("ranks do not add up to the files, tensors and keys of the step")
    for i, e in enumerate(tensors):
        if isinstance(e, dict):
            _validate_autograd(i, e, bad)
        if isinstance(e, dict) and "base" in e:
            _validate_view(i, e, tensors, bad)
            continue
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


def _validate_autograd(i: int, e: dict[str, Any], bad: Any) -> None:
    """``param`` / ``requires_grad`` (version 4): booleans; gradients only for float/complex tensors."""
    for key in ("param", "requires_grad"):
        if key in e and type(e[key]) is not bool:
            raise bad(f"tensor {i}: {key} is not a boolean")
    if (e.get("param") or e.get("requires_grad")) and e.get("numpy"):
        raise bad(f"tensor {i}: a numpy array cannot be a parameter")
    if e.get("requires_grad"):
        try:
            dt = dtype_from_name(e.get("dtype") if isinstance(e.get("dtype"), str) else "")
        except ValueError:
            return  # reported as an unsupported dtype by the caller
        if not (dt.is_floating_point or dt.is_complex):
            raise bad(f"tensor {i}: requires_grad on a {e.get('dtype')} tensor")


def _validate_view(i: int, e: dict[str, Any], tensors: list[Any], bad: Any) -> None:
    """A view entry (version 3) must stay inside the bytes of the stored entry it names."""
    def count(x: Any) -> bool:
        return type(x) is int and x >= 0

    j, shape, stride, off = e.get("base"), e.get("shape"), e.get("stride"), e.get("byte_offset")
    if type(j) is not int or not 0 <= j < len(tensors) or not isinstance(tensors[j], dict) or "base" in tensors[j] \
            or not count(tensors[j].get("nbytes")):
        raise bad(f"tensor {i} is a view of {j!r:.20}, not of a stored tensor")
    name = e.get("dtype")
    try:
        itemsize = dtype_from_name(name if isinstance(name, str) else "").itemsize
    except ValueError:
        raise bad(f"tensor {i}: unsupported dtype {name!r:.20}") from None
    if not isinstance(shape, list) or not isinstance(stride, list) or len(shape) != len(stride) or not all(
            count(d) for d in shape + stride) or type(off) is not int or off < 0 or off % itemsize or e.get("numpy"):
        raise bad(f"tensor {i}: view shape, stride or byte_offset invalid")
    if math.prod(shape) * itemsize != e.get("nbytes"):
        raise bad(f"tensor {i}: shape {shape!r:.60} does not match nbytes")
    if math.prod(shape) and off + (sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * itemsize > tensors[j]["nbytes"]:
        raise bad(f"tensor {i}: view reaches past the end of tensor {j}")
