"""Page buffers as flat byte views, without copies: memoryview, bytearray, numpy arrays and
CPU torch tensors of any dtype (bfloat16 included: a tensor is viewed as its bytes).

torch is used only if it is importable; nothing here imports it.

Caveats:
    * CUDA tensors are refused (EINVAL): a get would need a pinned host staging buffer
      and a device copy, which this first version does not have.
"""

from __future__ import annotations

from typing import Any

from stripefs.wire import ErrorCode, StripefsError

__all__ = ["page_view"]


def _tensor_bytes(t: Any) -> Any:
    """A contiguous CPU tensor as a 1-d uint8 numpy array sharing its memory."""
    if t.device.type != "cpu":
        raise StripefsError(ErrorCode.INVALID, f"page buffers must be CPU tensors, got one on {t.device}")
    if not t.is_contiguous():
        raise StripefsError(ErrorCode.INVALID, "page tensors must be contiguous")
    import torch  # only reached with a tensor in hand, so torch is there

    return t.reshape(-1).view(torch.uint8).numpy()


def page_view(buf: Any, page_size: int, *, writable: bool) -> memoryview:
    """A 1-d byte view of exactly ``page_size`` bytes of ``buf``.

    Raises:
        StripefsError: EINVAL for a buffer of another size, a read-only one where
            ``writable``, a non-contiguous or non-CPU one.
    """
    if hasattr(buf, "is_contiguous") and hasattr(buf, "device"):  # a torch.Tensor
        buf = _tensor_bytes(buf)
    try:
        view = memoryview(buf)
    except TypeError as exc:
        raise StripefsError(ErrorCode.INVALID, f"a page buffer must expose a buffer, got {type(buf).__name__}") from exc
    if not view.c_contiguous:
        raise StripefsError(ErrorCode.INVALID, "page buffers must be contiguous")
    if writable and view.readonly:
        raise StripefsError(ErrorCode.INVALID, "batch_get_into needs writable buffers")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if len(view) != page_size:
        raise StripefsError(ErrorCode.INVALID, f"a page buffer holds {len(view)} bytes, the page size is {page_size}")
    return view
