"""Memory over one step, read from inside the process that trains: the sampler behind
``bench/step.py --plot``, and the optimizer step every benchmark lane takes.

The sampler reads the process's RSS (``/proc/self/statm``, one small read) and a
caller's live-bytes counter (malloc's bytes in use, or allocated GPU memory)
every ``interval`` seconds on a thread of its own. Each read holds the GIL
that the step's hooks need for a few microseconds, so an interval of 10 ms
leaves the step it watches at its usual speed; ``bench/step.py`` checks the
traced step's time against the median of the untraced ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import torch
from _common import read_rss_bytes

__all__ = ["LEARNING_RATE", "SAMPLE_INTERVAL_S", "Sampler", "_sgd_step"]

LEARNING_RATE = 1e-3
# The traced step's sampling period (see above).
SAMPLE_INTERVAL_S = 0.01


class Sampler:
    """Samples ``(perf_counter seconds, RSS bytes, read_live())`` every ``interval``
    seconds on a background thread, from entry to exit (one sample at each)."""

    def __init__(self, interval: float, read_live: Callable[[], int]) -> None:
        self.interval = interval
        self._read_live = read_live
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _sample(self) -> None:
        self.samples.append((time.perf_counter(), read_rss_bytes(), self._read_live()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> Sampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _sgd_step(params: Sequence[torch.nn.Parameter]) -> None:
    """Plain SGD, then drop the gradients: what ``torch.optim.SGD`` + ``zero_grad`` do.

    ``torch.optim`` is avoided only because constructing an optimizer imports
    ``torch._dynamo``, which costs a short-lived process ~1.5 s.
    """
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-LEARNING_RATE)
                p.grad = None
