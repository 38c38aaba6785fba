"""The packed format: any dtype, shape, stride and offset survives the trip to a slab."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefetch_offload import OffloadConfig, OffloadEngine
from prefetch_offload.io_pool import InlineIOPool
from prefetch_offload.packed import (
    ALIGN,
    Span,
    ViewMeta,
    is_dense,
    make_view,
    new_read_buffer,
    source_address,
    source_buffer,
    span_bytes,
    view_span,
)
from prefetch_offload.slab import SlabStore, direct_io_supported

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _random_storage(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if n else torch.empty(0, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise image of a tensor's logical values (NaN payloads included)."""
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return dense.reshape(-1).view(torch.uint8)


@st.composite
def strided_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    # Strides 0 (expanded), 1, and larger (slices, transposes); overlap allowed.
    stride = tuple(draw(st.lists(st.integers(0, 40), min_size=ndim, max_size=ndim)))
    offset = draw(st.integers(0, 50))
    span = span_bytes(shape, stride, 1)
    base = _random_storage(offset + span + draw(st.integers(0, 9)), dtype, draw(st.integers(0, 9)))
    return base.as_strided(shape, stride, offset)


@contextlib.contextmanager
def _store(tmp: Path, io_method: str) -> Iterator[SlabStore]:
    if io_method == "direct" and not direct_io_supported(str(tmp)):
        pytest.skip("filesystem without O_DIRECT")
    store = SlabStore(str(tmp), slab_bytes=1 << 20, io_method=io_method)
    try:
        yield store
    finally:
        store.close()


@pytest.mark.parametrize("io_method", ["direct", "buffered", "mmap"])
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(t=strided_tensors())
def test_round_trip_through_a_slab(tmp_path: Path, io_method: str, t: torch.Tensor) -> None:
    start, nbytes = view_span(t)
    storage = t.untyped_storage()
    span = Span(nbytes, (storage.data_ptr() + start) % ALIGN)
    meta = ViewMeta(t.dtype, tuple(t.shape), t.stride(), 0)
    if nbytes == 0:
        assert span.extent_bytes in (0, ALIGN)
        return
    with _store(tmp_path, io_method) as store:
        extent = store.allocate(span.extent_bytes)
        assert extent is not None
        store.write(extent, 0, source_buffer(source_address(storage, start, span), span))
        buf, base, region = new_read_buffer(span)
        store.read(extent, 0, region)
        store.free(extent)
    out = make_view(buf.untyped_storage(), base, meta)
    assert out.dtype == t.dtype
    assert out.shape == t.shape
    assert out.stride() == t.stride()
    assert out.data_ptr() % ALIGN == t.data_ptr() % ALIGN
    assert torch.equal(_bits(out), _bits(t))


def test_expanded_tensor_costs_its_real_bytes() -> None:
    row = torch.randn(1, 1024)
    wide = row.expand(4096, 1024)
    assert view_span(wide) == (0, 1024 * 4)
    sliced = torch.randn(1000, 1000)[10:20, 5:7]
    assert view_span(sliced) == ((10 * 1000 + 5) * 4, (9 * 1000 + 2) * 4)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(t=strided_tensors())
def test_round_trip_through_the_engine(tmp_path: Path, t: torch.Tensor) -> None:
    """pack -> write -> unpack reads from disk and returns equal bits, shape and strides."""
    cfg = OffloadConfig(target="disk", save_dir=str(tmp_path), min_offload_bytes=0)
    engine = OffloadEngine(cfg, pool=InlineIOPool())
    try:
        handle = engine.pack(t)
        engine.flush()
        out = engine.unpack(handle)
    finally:
        engine.close()
    assert out.shape == t.shape and out.stride() == t.stride() and out.dtype == t.dtype
    assert torch.equal(_bits(out), _bits(t))
    if t.numel():
        assert out is not t  # went through the disk
        nbytes, whole = view_span(t)[1], t.untyped_storage().nbytes()
        if nbytes < whole <= 2 * nbytes:  # NOTE [whole storage]
            nbytes = whole
        assert engine.stats().bytes_read == nbytes
        assert out.data_ptr() % ALIGN == t.data_ptr() % ALIGN


def test_is_dense_counts_each_element_of_the_span_once() -> None:
    x = torch.randn(50000)
    dense = [x[:6000], x.view(100, 500).t(), x.view(10, 50, 100).permute(2, 0, 1), x[:1]]
    dense += [x.view(100, 500)[:, :0], x.view(100, 1, 500)]
    for t in dense:
        assert is_dense(tuple(t.shape), t.stride()), (t.shape, t.stride())
    gappy = [x[::2], x.view(100, 500)[:, :10], x[::101][:100].unsqueeze(1).expand(100, 100)]
    gappy += [x[:3].unsqueeze(0).expand(4, 3), x.as_strided((3, 3), (2, 1))]
    for t in gappy:
        assert not is_dense(tuple(t.shape), t.stride()), (t.shape, t.stride())
    # the expanded strided view has as many elements as its span, and is still not dense
    t = gappy[2]
    assert t.numel() * t.element_size() == view_span(t)[1]
