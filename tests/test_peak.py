"""The memory peak sampler (NOTE [plans within the noise] in recompute_planner.py)."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

import pytest

from prefetch_offload.peak import PeakSampler


class _Gauge:
    """A reading the test sets; counts the reads."""

    def __init__(self, value: int = 0) -> None:
        self.value, self.reads = value, 0
        self.read_at_least = threading.Event()

    def __call__(self) -> int:
        self.reads += 1
        if self.reads >= 3:
            self.read_at_least.set()
        return self.value


def test_take_returns_the_most_since_the_last_take_and_starts_from_now() -> None:
    gauge = _Gauge(10)
    sampler = PeakSampler(gauge)
    sampler.sample()
    gauge.value = 50
    sampler.sample()
    gauge.value = 20
    assert sampler.take() == 50  # the samples' most, this moment included
    gauge.value = 5
    assert sampler.take() == 20  # the span began at the last take's reading (20)
    assert sampler.take() == 5


def test_the_thread_samples_while_started_and_not_after_stop() -> None:
    gauge = _Gauge(7)
    sampler = PeakSampler(gauge, interval=0.001)
    sampler.start()
    sampler.start()  # (once)
    assert sampler.running
    gauge.value = 99
    assert gauge.read_at_least.wait(5)
    time.sleep(0.02)
    gauge.value = 1
    assert sampler.take() == 99  # a peak between two takes, seen by the thread alone
    sampler.stop()
    assert not sampler.running
    time.sleep(0.02)
    reads = gauge.reads
    time.sleep(0.02)
    assert gauge.reads == reads  # stopped: no more background reads
    sampler.start()  # again after a stop
    assert sampler.running
    sampler.stop()


def test_a_dropped_sampler_ends_its_thread() -> None:
    sampler = PeakSampler(_Gauge(), interval=0.001)
    sampler.start()
    threads = [t for t in threading.enumerate() if t.name == "prefetch_offload-peak"]
    assert threads
    del sampler
    gc.collect()
    for t in threads:
        t.join(timeout=5)
        assert not t.is_alive()


def test_a_failed_read_stops_the_sampling_and_peaks_read_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def unreadable() -> int:
        raise OSError("no /proc")

    sampler = PeakSampler(unreadable, interval=0.001)
    with caplog.at_level(logging.INFO, logger="prefetch_offload"):
        sampler.start()
        for _ in range(500):
            if not sampler.running:
                break
            time.sleep(0.001)
        assert not sampler.running
        assert sampler.take() == 0 and sampler.take() == 0
        sampler.start()  # nothing to sample: stays off
        assert not sampler.running
        sampler.stop()  # joins the thread that failed
    assert len([r for r in caplog.records if "not sampled" in r.getMessage()]) == 1


def test_an_error_of_any_kind_stops_the_sampling_not_the_caller() -> None:
    def broken() -> int:
        raise RuntimeError("CUDA error: device-side assert triggered")

    sampler = PeakSampler(broken)
    assert sampler.take() == 0 and sampler.sample() == 0


def test_a_thread_that_cannot_start_leaves_the_peaks_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    sampler = PeakSampler(_Gauge(5))
    monkeypatch.setattr(threading.Thread, "start", refuse)
    sampler.start()
    monkeypatch.undo()
    assert not sampler.running and sampler.take() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_in_the_child_of_a_fork_the_peaks_are_unknown() -> None:
    """The child has no sampling thread, and its lock may have been copied held."""
    sampler = PeakSampler(_Gauge(5), interval=0.001)
    sampler.start()
    pid = os.fork()
    if pid == 0:  # the child: report by exit code only
        ok = not sampler.running and sampler.take() == 0
        sampler.start()
        os._exit(0 if ok and not sampler.running else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sampler.running and sampler.take() == 5  # the parent samples on
    sampler.stop()
