"""The device layer: which tensors the engine may take, and how they reach host memory.

The engine only ever moves host (CPU) memory: into slab files for target
"disk", or nowhere for target "cpu". A device layer turns a saved tensor into
host memory with the same shape and strides at pack time, and turns host
memory back into a tensor on the original device at unpack time.

- :class:`HostDevice`: CPU tensors are already host memory; both directions
  are the identity. This is the whole path for CPU training.
- :class:`SpanCopyDevice`: copies a storage span (NOTE [packed layout]) to
  host memory and back; views are rebuilt over the copy. For
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

__all__ = ["DeviceLayer", "HostDevice", "RoutingDevice", "SpanCopyDevice", "default_device_layer"]


def _bytes(storage: torch.UntypedStorage, base: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` bytes of ``storage`` from ``base``."""
    out = torch.empty((0,), dtype=torch.uint8, device=storage.device)
    return out.set_(storage, base, (nbytes,), (1,))


class DeviceLayer:
    """Moves byte spans of one device type's storages to host memory and back.

    A span is ``(storage, base)`` plus a byte count: the bytes ``[base, base +
    nbytes)`` of an untyped storage. Views are rebuilt over the returned span.
    """

    #: The ``torch.device.type`` this layer handles.
    device_type: str = ""

    def accepts(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can be offloaded by this layer."""
        return t.device.type == self.device_type

    def to_host(
        self, storage: torch.UntypedStorage, base: int, nbytes: int
    ) -> tuple[torch.UntypedStorage, int]:
        """The span in host memory, readable when this returns."""
        raise NotImplementedError

    def to_device(
        self, storage: torch.UntypedStorage, base: int, nbytes: int, device: torch.device
    ) -> tuple[torch.UntypedStorage, int]:
        """The host span on ``device``, ready to use on the current stream."""
        raise NotImplementedError


class HostDevice(DeviceLayer):
    """CPU storages: host memory already, so both directions are the identity."""

    device_type = "cpu"

    def to_host(
        self, storage: torch.UntypedStorage, base: int, nbytes: int
    ) -> tuple[torch.UntypedStorage, int]:
        return storage, base

    def to_device(
        self, storage: torch.UntypedStorage, base: int, nbytes: int, device: torch.device
    ) -> tuple[torch.UntypedStorage, int]:
        return storage, base


class SpanCopyDevice(DeviceLayer):
    """Copies spans of ``device_type`` storages to (pinned) host memory and back."""

    def __init__(self, device_type: str, *, pin_memory: bool | None = None) -> None:
        self.device_type = device_type
        self.pin_memory = device_type == "cuda" if pin_memory is None else pin_memory

    def to_host(
        self, storage: torch.UntypedStorage, base: int, nbytes: int
    ) -> tuple[torch.UntypedStorage, int]:
        host = torch.empty((nbytes,), dtype=torch.uint8, pin_memory=self.pin_memory)
        host.copy_(_bytes(storage, base, nbytes))  # blocking: NOTE [cuda path status]
        return host.untyped_storage(), 0

    def to_device(
        self, storage: torch.UntypedStorage, base: int, nbytes: int, device: torch.device
    ) -> tuple[torch.UntypedStorage, int]:
        out = torch.empty((nbytes,), dtype=torch.uint8, device=device)
        out.copy_(_bytes(storage, base, nbytes))
        return out.untyped_storage(), 0


class RoutingDevice(DeviceLayer):
    """Dispatches each span to the layer for its device type."""

    def __init__(self, layers: list[DeviceLayer]) -> None:
        self._by_type = {layer.device_type: layer for layer in layers}

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device.type in self._by_type

    def to_host(
        self, storage: torch.UntypedStorage, base: int, nbytes: int
    ) -> tuple[torch.UntypedStorage, int]:
        return self._by_type[storage.device.type].to_host(storage, base, nbytes)

    def to_device(
        self, storage: torch.UntypedStorage, base: int, nbytes: int, device: torch.device
    ) -> tuple[torch.UntypedStorage, int]:
        return self._by_type[device.type].to_device(storage, base, nbytes, device)


def default_device_layer(target: str) -> DeviceLayer:
    """The layer an engine uses for ``target``: "cpu" moves only CUDA tensors (CPU
    tensors are host memory already); "disk" takes CPU and CUDA tensors."""
    layers: list[DeviceLayer] = [SpanCopyDevice("cuda")]
    if target == "disk":
        layers.append(HostDevice())
    return RoutingDevice(layers)
