"""The packed-tensor format: which bytes of a tensor go to disk, and how it comes back.

# NOTE [packed layout]
# A strided tensor is fully described by (dtype, shape, stride) plus the bytes
# of the storage span it covers: from its first element to its last, i.e.
# ``1 + sum((size_i - 1) * stride_i)`` elements (0 for an empty tensor). Only
# that span is written, so a slice of a huge buffer costs its own bytes, and an
# expanded stride-0 tensor costs its real (not logical) size. Restoring builds a
# fresh storage holding the span and views it with the same shape and strides,
# so values, shape, strides, dtype and device are equal; storage_offset may differ.
#
# NOTE [alignment]
# O_DIRECT needs the memory address, the file offset and the length of every
# request aligned to the device block size (4096 covers every common device).
# Rather than copying each tensor into an aligned staging buffer, the extent on
# disk mirrors the tensor's in-page position: the span lands at
# ``extent.offset + pad`` where ``pad = data_ptr % 4096``, and the write covers
# whole pages from ``data_ptr - pad``. Those pages are mapped (they hold the
# tensor's own first and last bytes); the extra bytes around the span are
# ignored. On read, the fresh buffer is placed so that its data also starts
# ``pad`` bytes into a page, which keeps every element dtype-aligned
# (itemsize divides 4096). Writes and reads are therefore zero-copy.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ALIGN", "PackedLayout", "describe", "new_read_buffer", "source_buffer", "span_bytes"]

ALIGN = 4096


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def span_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes of storage a strided view covers (see NOTE [packed layout])."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))) * itemsize


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Everything needed to rebuild a tensor from its packed bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    # Bytes of the storage span the tensor covers.
    span_bytes: int
    # Offset of the span inside its first 4096-byte page (NOTE [alignment]).
    pad: int

    @property
    def extent_bytes(self) -> int:
        """Bytes of slab space the packed tensor occupies (whole pages)."""
        return _round_up(self.pad + self.span_bytes, ALIGN)


def describe(t: torch.Tensor) -> PackedLayout:
    """Describe a strided tensor for packing. The caller checks eligibility first."""
    shape = tuple(t.shape)
    stride = tuple(t.stride())
    return PackedLayout(
        dtype=t.dtype,
        shape=shape,
        stride=stride,
        span_bytes=span_bytes(shape, stride, t.element_size()),
        pad=t.data_ptr() % ALIGN,
    )


def source_buffer(t: torch.Tensor, layout: PackedLayout) -> memoryview:
    """A read-only byte view of the whole pages holding ``t``'s span.

    The view aliases ``t``'s memory: the caller must keep ``t`` alive until every
    request reading from the view has finished.
    """
    start = t.data_ptr() - layout.pad
    raw = (ctypes.c_char * layout.extent_bytes).from_address(start)
    return memoryview(raw).cast("B").toreadonly()


def new_read_buffer(layout: PackedLayout) -> tuple[torch.Tensor, memoryview]:
    """Allocate the tensor a read lands in, and the page-aligned region to read into.

    Returns ``(tensor, region)``: once ``region`` (``layout.extent_bytes`` bytes,
    page-aligned) holds the extent's bytes, ``tensor`` equals the packed tensor.
    """
    n = layout.extent_bytes
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    lead = (-raw.data_ptr()) % ALIGN
    region: np.ndarray = raw[lead : lead + n].numpy()
    itemsize = layout.dtype.itemsize
    out = torch.empty((0,), dtype=layout.dtype)
    out.set_(raw.untyped_storage(), (lead + layout.pad) // itemsize, layout.shape, layout.stride)
    return out, memoryview(region)
