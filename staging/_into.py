"""``load(url, into=state)``: a checkpoint restored into memory the caller already has.

A restart builds its model (and often its optimizer state) before it loads: the parameters
exist, initialised and touched. Loading into fresh tensors and then copying them into the
model (``model.load_state_dict(load(url))``) moves every byte twice and faults in as much
fresh memory as the state holds, which the kernel must zero first. With ``into``, each stored
tensor whose place in ``into`` (same keys, same list positions) holds a tensor of the stored
dtype and shape is read straight into that tensor's memory, and the returned state holds that
very object.

* Host tensors that are contiguous are filled in place by the load's readers (a parameter is
  written through ``detach()``: its autograd state is left as it is).
* Other matching targets (on a device, strided, or overlapping another target's memory) get
  the loaded value with one ``copy_`` after the load has checked it.
* numpy arrays are targets as well, when contiguous and writable.
* A target of another dtype or shape is an error raised before any byte is read: nothing of
  ``into`` has been written then.

A tensor that fails its CRC32C check raises :class:`ChecksumError` as any load does; the
targets written so far then hold bytes of the failed load (as a DCP load into a state dict
leaves it), so the caller reloads or discards them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._format import dtype_from_name

__all__ = ["Targets", "pair"]


class Targets:
    """What ``into`` gives for a load: tensor index -> the caller's object, and how each is filled."""

    def __init__(self) -> None:
        self.given: dict[int, Any] = {}  # index -> the object returned (the caller's tensor or array)
        self.direct: dict[int, torch.Tensor] = {}  # index -> host memory the readers fill
        self.copied: dict[int, torch.Tensor] = {}  # index -> a target filled by copy_ once loaded

    def prefill(self, out: list[Any]) -> None:
        """Put the in-place targets where the readers look for their destinations."""
        for i, t in self.direct.items():
            out[i] = t

    def finish(self, tensors: list[Any]) -> None:
        """After the load (and its checks): copy into the other targets."""
        with torch.no_grad():
            for i, t in self.copied.items():
                src = tensors[i]
                if not (src.data_ptr() == t.data_ptr() and src.stride() == t.stride() and src.device == t.device):
                    t.copy_(src)  # a view loaded onto the target's own memory needs none


def pair(tree: Any, into: Any, index: list[dict[str, Any]], mine: range | list[int]) -> Targets:
    """Match the stored tensors of manifest ``tree`` with the tensors at the same places in
    ``into``.

    Raises:
        ValueError: a target's dtype or shape is not the stored tensor's.
        TypeError: ``into`` is not a dict, list or tuple.
    """
    if not isinstance(into, (Mapping, list, tuple)):
        raise TypeError(f"load(into=...) takes the state to fill (a dict, list or tuple), not {type(into).__name__}")
    found: dict[int, tuple[str, Any]] = {}
    _walk(tree, into, "", found)
    wanted = set(mine)
    targets = Targets()
    spans: list[tuple[int, int, int]] = []
    bases: dict[int, torch.Tensor] = {}
    for i, (where, obj) in sorted(found.items()):
        if i not in wanted:
            continue  # another rank's tensor (load(rank=...))
        t = _as_tensor(obj)
        if t is None:
            continue  # not a tensor there: the stored one loads into fresh memory
        e = index[i]
        dtype = dtype_from_name(e["dtype"])
        if t.dtype != dtype or list(t.shape) != list(e["shape"]):
            raise ValueError(f"load(into=...): {where or '<root>'} holds a {t.dtype} tensor of shape {list(t.shape)}; "
                             f"the checkpoint stores {dtype} of shape {list(e['shape'])}")
        targets.given[i] = obj
        host = t.device.type == "cpu" and t.is_contiguous()
        if "base" in e:  # a view of a stored storage: copied into, unless it lands in place below
            targets.copied[i] = t
            b = e["base"]
            if host and b not in found and b not in bases and _covers(t, e, index[b]):
                bases[b] = t.reshape(-1).view(torch.uint8)
        elif host:
            targets.direct[i] = t
        else:
            targets.copied[i] = t
    # A storage shared by views (tied weights: one parameter under two keys) is read straight
    # into the memory of the first target that covers it whole; its views then show it in
    # place (finish() finds nothing to copy).
    for b, t in bases.items():
        if b in wanted:
            targets.direct[b] = t
    for i, t in targets.direct.items():
        if t.numel():
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i))
    # Two targets sharing memory (one tensor under two keys, stored twice) must not be filled
    # by two readers at once: the later ones are copied into after the load.
    spans.sort()
    end = -1
    for lo, hi, i in spans:
        if lo < end:
            targets.copied[i] = targets.direct.pop(i)
        end = max(end, hi)
    return targets


def _covers(t: torch.Tensor, e: dict[str, Any], base: dict[str, Any]) -> bool:
    """Whether view entry ``e`` spans all of its base, a plain byte storage, as ``t`` lays it out."""
    return (base["dtype"] == "uint8" and len(base["shape"]) == 1 and e.get("byte_offset", 0) == 0
            and t.numel() * t.element_size() == base["nbytes"]
            and (e.get("stride") is None or list(e["stride"]) == list(t.stride())))


def _as_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        # Sparse, quantized and nested tensors are not plain memory to read into.
        return obj.detach() if obj.layout == torch.strided and not obj.is_quantized and not obj.is_nested else None
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch
        return None
    if isinstance(obj, np.ndarray) and obj.flags.writeable and obj.flags.c_contiguous:
        try:
            return torch.from_numpy(obj)
        except TypeError:  # a dtype torch has no tensor for: the stored value loads fresh
            return None
    return None


def _walk(node: Any, target: Any, where: str, found: dict[int, tuple[str, Any]]) -> None:
    if not isinstance(node, dict) or len(node) != 1:
        return
    (tag, v), = node.items()
    if tag == "t":
        if type(v) is int:
            found[v] = (where, target)
        return
    if tag in ("d", "od", "dd") and isinstance(target, Mapping):
        items = v[1] if tag == "dd" else v
        for k, x in items:
            key = _key(k)
            if key is not None and key in target:
                _walk(x, target[key], f"{where}[{key!r}]", found)
    elif tag in ("l", "u") and isinstance(target, (list, tuple)):
        for n, (x, t) in enumerate(zip(v, target)):
            _walk(x, t, f"{where}[{n}]", found)


def _key(node: Any) -> Any:
    """A mapping key as stored: plain values (the keys of a state dict) or None."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (tag, v), = node.items()
        if tag == "u" and isinstance(v, list):
            parts = [_key(x) for x in v]
            return None if any(p is None for p in parts) else tuple(parts)
        if tag == "f" and isinstance(v, (int, float, str)):
            return float(v)
    return None
