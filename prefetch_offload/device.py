"""The device layer: which tensors the engine may take, and how they reach host memory.

The engine only ever writes host (CPU) memory to the slabs. A device layer
turns a saved tensor into host bytes at pack time and turns host bytes back
into a tensor on the original device at unpack time.

:class:`HostDevice` is the CPU path (and the CPU twin that CI exercises): CPU
tensors are already host memory, so both directions are the identity. The
CUDA path (side streams, pinned staging, events) implements the same
interface; until it lands, tensors on other devices stay where they are.
"""

from __future__ import annotations

import torch

__all__ = ["DeviceLayer", "HostDevice"]


class DeviceLayer:
    """Interface between saved tensors and host memory."""

    def accepts(self, t: torch.Tensor) -> bool:
        """Whether tensors on ``t``'s device can be offloaded by this layer."""
        raise NotImplementedError

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Host memory holding ``t``'s storage span, readable once this returns."""
        raise NotImplementedError

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The restored tensor on ``device``, safe to use on the current stream."""
        raise NotImplementedError


class HostDevice(DeviceLayer):
    """CPU tensors: the host memory is the tensor itself."""

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host
