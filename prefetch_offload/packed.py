"""The packed-tensor format: which bytes of a tensor go to disk, and how views come back.

# NOTE [packed layout]
# A strided tensor is a view: (dtype, shape, stride) over a byte range of its
# storage, from its first element to its last, i.e. ``1 + sum((size_i - 1) *
# stride_i)`` elements (0 for an empty tensor). Only that span is written, so a
# slice of a huge buffer costs its own bytes, and an expanded stride-0 tensor
# costs its real (not logical) size. What is offloaded is the span (a record);
# each saved view keeps its own ViewMeta (dtype, shape, stride, byte offset into
# the span), so several views of one storage share one record (NOTE [dedup] in
# records.py). Restoring builds a view with the same shape and strides over a
# buffer holding the span: values, shape, strides, dtype and device are equal;
# the storage offset may differ.
#
# NOTE [alignment]
# O_DIRECT needs the memory address, the file offset and the length of every
# request aligned to the device block size (4096 covers every common device).
# Rather than copying each span into an aligned staging buffer, the extent on
# disk mirrors the span's in-page position: the span lands at
# ``extent.offset + pad`` where ``pad = address % 4096``, and the write covers
# whole pages from ``address - pad``. Those pages are mapped (they hold the
# span's own first and last bytes); the extra bytes around the span are never
# read back. On read, the fresh buffer is placed so that the span also starts
# ``pad`` bytes into a page, so every view lands at the same address modulo
# 4096 as the original, which keeps elements dtype-aligned (itemsize divides
# 4096). Writes and reads are therefore zero-copy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "ALIGN",
    "Span",
    "ViewMeta",
    "is_dense",
    "make_view",
    "new_read_buffer",
    "source_address",
    "source_buffer",
    "span_bytes",
    "span_part",
    "view_span",
]

ALIGN = 4096


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def span_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes of storage a strided view covers (see NOTE [packed layout])."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))) * itemsize


def view_span(t: torch.Tensor) -> tuple[int, int]:
    """``(start, nbytes)``: the byte range of ``t``'s storage that ``t`` covers."""
    itemsize = t.element_size()
    return t.storage_offset() * itemsize, span_bytes(tuple(t.shape), t.stride(), itemsize)


def is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view of ``shape`` and ``stride`` holds every element of its span once:
    no gaps, no element twice (a permutation of a contiguous layout). Counting elements
    is not enough: an expanded strided view can hold as many as its span while
    repeating some and skipping the rest."""
    if 0 in shape:
        return True  # no element: nothing spanned
    expected = 1
    for step, size in sorted((st, sz) for sz, st in zip(shape, stride, strict=True) if sz != 1):
        if step != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True, slots=True)
class ViewMeta:
    """How one saved tensor views its record's span."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    # Byte offset of the view's first element from the start of the span.
    offset: int


@dataclass(frozen=True, slots=True)
class Span:
    """A record's bytes: their count and their position in the first page."""

    nbytes: int
    # ``address % 4096`` of the span's first byte (NOTE [alignment]).
    pad: int

    @property
    def extent_bytes(self) -> int:
        """Bytes of slab space the span occupies (whole pages)."""
        return _round_up(self.pad + self.nbytes, ALIGN)


def source_address(storage: torch.UntypedStorage, base: int, span: Span) -> int:
    """Where the whole pages holding ``span`` (at ``base`` in ``storage``) begin now."""
    return storage.data_ptr() + base - span.pad


def source_buffer(start: int, span: Span) -> memoryview:
    """A read-only byte view of the whole pages holding ``span``, from ``start`` (its
    :func:`source_address`).

    The view aliases the storage's memory: the caller keeps the storage alive, and
    at that address, until every request reading from the view has finished (NOTE
    [moved storages] in writer.py).
    """
    raw = (ctypes.c_char * span.extent_bytes).from_address(start)
    return memoryview(raw).cast("B").toreadonly()


def new_read_buffer(
    span: Span, lease: Callable[[int], tuple[torch.Tensor, memoryview]] | None = None
) -> tuple[torch.Tensor, int, memoryview]:
    """A buffer for reading ``span`` back (NOTE [alignment]).

    Args:
        span: the span to read.
        lease: returns a page-aligned uint8 tensor of at least the given size and
            a memoryview of its first bytes (the read buffer pool); None
            allocates a fresh buffer.

    Returns:
        ``(buffer, base, region)``: once ``region`` (``span.extent_bytes``
        page-aligned bytes) holds the extent, the span starts at byte ``base``
        of ``buffer``'s storage.
    """
    n = span.extent_bytes
    if lease is not None:
        raw, region = lease(n)
        return raw, span.pad, region
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    lead = (-raw.data_ptr()) % ALIGN
    return raw, lead + span.pad, memoryview(raw[lead : lead + n].numpy())


def make_view(storage: torch.UntypedStorage, base: int, meta: ViewMeta) -> torch.Tensor:
    """The tensor ``meta`` describes, over the span that starts at byte ``base``."""
    out = torch.empty((0,), dtype=meta.dtype, device=storage.device)
    itemsize = meta.dtype.itemsize
    return out.set_(storage, (base + meta.offset) // itemsize, meta.shape, meta.stride)


def span_part(span: Span, lo: int, hi: int) -> tuple[int, int]:
    """The part of ``[lo, hi)`` (extent offsets) that holds the span's own bytes."""
    a = min(max(lo, span.pad), hi)
    return a, max(a, min(hi, span.pad + span.nbytes))
