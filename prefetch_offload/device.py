"""The device layer: which tensors the engine may take, and how they reach host memory.

The engine only ever moves host (CPU) memory: into slab files for target
"disk", or nowhere for target "cpu". A device layer turns a saved tensor into
host memory with the same shape and strides at pack time, and turns host
memory back into a tensor on the original device at unpack time.

- :class:`HostDevice`: CPU tensors are already host memory; both directions
  are the identity. This is the whole path for CPU training.
- :class:`SpanCopyDevice`: copies a tensor's storage span (NOTE [packed
  layout]) to host memory and back, preserving shape and strides. For
  ``"cuda"`` it uses pinned host memory and blocking copies; built with
  ``device_type="cpu"`` it is the CPU twin that CI runs, exercising the same
  span arithmetic without a GPU.

# NOTE [cuda path status]
# The asynchronous CUDA path (side streams, events, a pinned staging pool) is
# its own piece of work. Until it lands, CUDA tensors are copied with blocking
# copies: correct and race-free by construction, but without overlap.
"""

from __future__ import annotations

import torch

from .packed import span_bytes

__all__ = ["DeviceLayer", "HostDevice", "RoutingDevice", "SpanCopyDevice", "default_device_layer"]


class DeviceLayer:
    """Interface between saved tensors of one device type and host memory."""

    #: The ``torch.device.type`` this layer handles.
    device_type: str = ""

    def accepts(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can be offloaded by this layer."""
        return t.device.type == self.device_type

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Host memory with ``t``'s shape, strides and values, readable when this returns."""
        raise NotImplementedError

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The restored tensor on ``device``, ready to use on the current stream."""
        raise NotImplementedError


class HostDevice(DeviceLayer):
    """CPU tensors: the host memory is the tensor itself."""

    device_type = "cpu"

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host


def _span_elems(t: torch.Tensor) -> int:
    return span_bytes(tuple(t.shape), t.stride(), 1)


class SpanCopyDevice(DeviceLayer):
    """Copies the storage span of ``device_type`` tensors to host memory and back."""

    def __init__(self, device_type: str, *, pin_memory: bool | None = None) -> None:
        self.device_type = device_type
        self.pin_memory = device_type == "cuda" if pin_memory is None else pin_memory

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        n = _span_elems(t)
        span = t.as_strided((n,), (1,), t.storage_offset())
        host = torch.empty((n,), dtype=t.dtype, pin_memory=self.pin_memory)
        host.copy_(span)  # blocking: NOTE [cuda path status]
        return host.as_strided(tuple(t.shape), t.stride(), 0)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        n = _span_elems(host)
        span = host.as_strided((n,), (1,), host.storage_offset())
        out = torch.empty((n,), dtype=host.dtype, device=device)
        out.copy_(span)
        return out.as_strided(tuple(host.shape), host.stride(), 0)


class RoutingDevice(DeviceLayer):
    """Dispatches each tensor to the layer for its device type."""

    def __init__(self, layers: list[DeviceLayer]) -> None:
        self._by_type = {layer.device_type: layer for layer in layers}

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device.type in self._by_type

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return self._by_type[t.device.type].to_host(t)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return self._by_type[device.type].to_device(host, device)


def default_device_layer(target: str) -> DeviceLayer:
    """The layer an engine uses for ``target``: "cpu" moves only CUDA tensors (CPU
    tensors are host memory already); "disk" takes CPU and CUDA tensors."""
    layers: list[DeviceLayer] = [SpanCopyDevice("cuda")]
    if target == "disk":
        layers.append(HostDevice())
    return RoutingDevice(layers)
