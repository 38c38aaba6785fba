"""First-fit free runs over one contiguous range: the allocator slabs and arenas share."""

from __future__ import annotations

import bisect

__all__ = ["FreeRuns"]


class FreeRuns:
    """Free runs ``[offset, length]`` of a range of ``size`` units, sorted and never
    adjacent (freed runs are merged with their neighbours). Not thread-safe."""

    __slots__ = ("free", "size", "used")

    def __init__(self, size: int) -> None:
        self.size = size
        # A short list of [offset, length] pairs is plenty for activations.
        self.free: list[list[int]] = [[0, size]] if size else []
        self.used = 0

    def take(self, length: int) -> int | None:
        """The offset of ``length`` units from the first run that fits, or None."""
        for i, (off, n) in enumerate(self.free):
            if n >= length:
                if n == length:
                    del self.free[i]
                else:
                    self.free[i] = [off + length, n - length]
                self.used += length
                return off
        return None

    def give(self, offset: int, length: int) -> None:
        """Return ``length`` units at ``offset``, merged with the runs beside them."""
        self.used -= length
        free = self.free
        i = bisect.bisect_left(free, [offset, 0])
        free.insert(i, [offset, length])
        if i + 1 < len(free) and offset + length == free[i + 1][0]:
            free[i][1] += free.pop(i + 1)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:
            free[i - 1][1] += free.pop(i)[1]
