"""The GPU suite's first stage, under 40 s: what the machine is, and whether the rest is worth it.

Each check is written to ``--json`` as soon as it ends (a run killed by its time
limit still leaves what it measured) and printed as one line:

- ``env``: Python, torch and its CUDA, the driver, the kernel (``uname`` and
  ``/proc/version``: gVisor shows there), the GPU, the RAM or cgroup limit and
  the pinned arena's default limit (NOTE [pinned arena]).
- ``pin``: seconds to pin ``--pin-gib`` GiB with PyTorch's pinned allocator (one
  GiB at a time, stopping after ``--pin-deadline`` seconds), and one 64 MiB arena
  step through the library's ``pin_block``.
- ``link``: pinned device-to-host and host-to-device GB/s (1 GiB, best of three).
- ``pageable``: with about 100 ms of GPU work queued, how long a ``non_blocking``
  device-to-host copy takes to return into pageable memory, and into pinned
  memory: a copy that returns only after the queued work is synchronous (what a
  pageable fallback costs every pack).
- ``direct_io``: an O_DIRECT write and read-back (NOTE [direct IO from pinned
  memory]) of ``--direct-mib`` MiB in the scratch folder, from pinned memory and
  from an ordinary mapping, in GB/s, or the error the kernel gave. ``disk_ok``:
  both pinned rates (without CUDA: the mapping's) reach ``--disk-min-gbps``; the
  suite runs its disk stage only then.
- ``capture``: CUDA calls the engine's threads might make while a thread
  captures a CUDA graph (NOTE [capture mode] in prefetch_offload/streams.py), one
  case of ``CAPTURE_CASES`` at a time: the call, in the capturing thread, in
  another thread, or in another thread that ``isolate_from_captures`` put in
  thread-local capture mode (the engine's IO threads), under a capture in the
  global or thread_local mode. For each, whether the call raised, whether the
  capture survived, and whether that is what CUDA documents (``as_expected``).
  Each case is written as soon as it ends, and a failed capture leaves its
  thread on the default stream again before the next case. It runs last: a
  broken capture may leave the context unusable.

Without CUDA only ``env`` and ``direct_io`` (from an ordinary mapping) run: the
suite's twin mode and a smoke check use that.

Example (repository root, on the GPU machine):
    python3 bench/gpu_preflight.py --json out/preflight.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import filesystem_type, scratch_folder

from prefetch_offload.arena import host_memory_limit, pin_block
from prefetch_offload.buffers import mapped_block
from prefetch_offload.device import direct_io_roundtrip
from prefetch_offload.slab import direct_io_supported
from prefetch_offload.streams import _cudart, isolate_from_captures

GiB, MiB = 1 << 30, 1 << 20
# Seconds a case's call in another thread may take before the case says it hung.
_THREAD_JOIN_S = 5.0

# What a graph capture allows, as CUDA documents it (cudaStreamBeginCapture,
# cudaThreadExchangeStreamCaptureMode): an event query or synchronize, or a pinned
# allocation, invalidates a capture in the global mode when the capturing thread
# makes it, or another thread still in the global mode; not when the capture runs
# in the thread_local mode, nor when the calling thread is in thread-local mode.
# The capture section measures every case; tests/test_capture.py's twin of a
# capture follows this table. Names: call, thread, capture mode.
CAPTURE_CASES: dict[str, bool] = {  # name: whether the capture survives the call
    "query_same_thread_global": False,
    "query_other_thread_global": False,
    "synchronize_other_thread_global": False,
    "pin_other_thread_global": False,
    "query_other_thread_thread_local": True,
    "query_isolated_thread_global": True,
    "synchronize_isolated_thread_global": True,
    "pin_isolated_thread_global": True,
}


class Report:
    """The preflight's JSON, rewritten whole after every check."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def run(self, name: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            result = check()
        except Exception as exc:  # recorded: the next check still runs
            result = {"error": f"{type(exc).__name__}: {exc}"}
        # What the check published as it went (``part``) stays, under its result.
        result = {**self.data.get(name, {}), **result}
        result["seconds"] = round(time.perf_counter() - start, 3)
        self.data[name] = result
        self.write()
        print(f"preflight {name}: {json.dumps(result)}", flush=True)
        return result

    def part(self, name: str) -> Callable[[str, Any], None]:
        """A callback that writes one entry of check ``name`` at once: a run killed by
        its time limit keeps the entries written before."""

        def publish(key: str, value: Any) -> None:
            self.data.setdefault(name, {})[key] = value
            self.write()

        return publish

    def write(self) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)  # a kill mid-write leaves the previous version


def _first_line(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().strip()
    except OSError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return _first_line("/proc/driver/nvidia/version")
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def check_env() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    ram = host_memory_limit()
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "kernel": platform.release(),
        "proc_version": _first_line("/proc/version"),
        "cpus": os.cpu_count(),
        "host_memory_limit_bytes": ram,
        "pinned_default_limit_bytes": None if ram is None else ram // 2,
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(
            driver=_driver(),
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
        )
    return env


def _sync_seconds(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


class Pinned:
    """The big pinned block the later checks share (pinned once: pinning is slow)."""

    tensor: torch.Tensor | None = None


def check_pin(gib: int, deadline: float, pinned: Pinned) -> dict[str, Any]:
    """Pin ``gib`` GiB, one GiB per allocation, stopping once ``deadline`` seconds have
    passed (a slow sandbox must not eat the preflight); the first GiB is kept."""
    times = []
    blocks = []
    for _ in range(gib):
        start = time.perf_counter()
        blocks.append(torch.empty(GiB, dtype=torch.uint8, pin_memory=True))
        times.append(time.perf_counter() - start)
        if sum(times) > deadline:
            break
    pinned.tensor = blocks[0]
    del blocks
    start = time.perf_counter()
    block = pin_block(64 * MiB)
    step = time.perf_counter() - start
    del block
    total = sum(times)
    return {
        "gib_pinned": len(times),
        "gib_wanted": gib,
        "pin_seconds": round(total, 3),
        "pin_gbps": round(len(times) * GiB / total / 1e9, 2),
        "per_gib_seconds": [round(t, 3) for t in times],
        "arena_step_64mib_ms": round(step * 1e3, 2),
    }


def pinned_link_gbps(nbytes: int, host: torch.Tensor | None = None) -> dict[str, float]:
    """Pinned copies' GB/s each way (``d2h``, ``h2d``) on the current CUDA device over
    ``nbytes`` (``host``: a pinned uint8 block of that size to use), the best of three."""
    if host is None:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = min(
            _sync_seconds(lambda d=dst, s=src: d.copy_(s, non_blocking=True)) for _ in range(3)
        )
        out[name] = round(nbytes / best / 1e9, 2)
    return out


def check_link(pinned: Pinned) -> dict[str, Any]:
    host = pinned.tensor[: 1 * GiB] if pinned.tensor is not None else None
    link = pinned_link_gbps(GiB, host)
    torch.cuda.empty_cache()
    return {f"{name}_gbps": gbps for name, gbps in link.items()}


def _gpu_sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the GPU busy about ``ms`` milliseconds."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # first, to lift an idle GPU's clock before the timed one
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / max(start.elapsed_time(end), 1e-3))


def check_pageable(pinned: Pinned) -> dict[str, Any]:
    nbytes = 256 * MiB
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(0)  # fault the pages in: only the copy is timed
    pin = pinned.tensor[:nbytes] if pinned.tensor is not None else pageable.pin_memory()
    cycles = _gpu_sleep_cycles(100.0)
    out: dict[str, Any] = {}
    for name, dst in (("pageable", pageable), ("pinned", pin)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(cycles)
        dst.copy_(dev, non_blocking=True)
        returned = time.perf_counter() - start
        torch.cuda.synchronize()
        out[f"{name}_return_ms"] = round(returned * 1e3, 2)
        out[f"{name}_done_ms"] = round((time.perf_counter() - start) * 1e3, 2)
    # GPU work was queued before each copy (about 100 ms by a calibration that an idle
    # clock may have made long): a copy that returned only after half of the time the
    # work and the copy took in all had the host wait for the GPU.
    out["queued_gpu_ms"] = 100.0
    for name in ("pageable", "pinned"):
        done = out[f"{name}_done_ms"]
        out[f"{name}_copy_blocks"] = out[f"{name}_return_ms"] > 0.5 * done
    return out


def check_direct_io(
    save_dir: str | None, direct_mib: int, min_gbps: float, pinned: Pinned
) -> dict[str, Any]:
    nbytes = direct_mib * MiB
    with scratch_folder(save_dir, prefix="preflight-") as folder:
        out: dict[str, Any] = {
            "folder": os.path.abspath(folder),
            "filesystem": filesystem_type(folder),
            "o_direct": direct_io_supported(folder),
        }
        if not out["o_direct"]:
            out["disk_ok"] = False
            return out
        sources: list[tuple[str, Callable[[], tuple[memoryview, Any]]]] = [
            ("mapped", lambda: _mapped(nbytes))
        ]
        if pinned.tensor is not None:
            sources.insert(0, ("pinned", lambda: _pinned(pinned.tensor, nbytes)))
        for name, make in sources:
            buf, keep = make()
            try:
                wrote, read = direct_io_roundtrip(folder, buf)
                out[f"{name}_write_gbps"] = round(nbytes / wrote / 1e9, 2)
                out[f"{name}_read_gbps"] = round(nbytes / read / 1e9, 2)
            except Exception as exc:
                out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            finally:
                buf.release()
                del keep
    # The rates of the memory the disk target writes from: pinned on a GPU machine.
    src = "pinned" if pinned.tensor is not None else "mapped"
    rates = (out.get(f"{src}_write_gbps", 0.0), out.get(f"{src}_read_gbps", 0.0))
    out["disk_ok"] = min(rates) >= min_gbps
    return out


def _pinned(t: torch.Tensor, nbytes: int) -> tuple[memoryview, Any]:
    array = t.numpy()
    lead = (-t.data_ptr()) % 4096
    return memoryview(array[lead : lead + nbytes]), array


def _mapped(nbytes: int) -> tuple[memoryview, Any]:
    block = mapped_block(nbytes)
    return memoryview(block.buffer), block


def _attempt(fn: Callable[[], object]) -> str:
    try:
        value = fn()
    except Exception as exc:
        return f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return f"ok ({value!r})"


def _in_thread(fn: Callable[[], object]) -> str:
    result: list[str] = []
    th = threading.Thread(target=lambda: result.append(_attempt(fn)), daemon=True)
    th.start()
    th.join(_THREAD_JOIN_S)
    return result[0] if result else f"still running after {_THREAD_JOIN_S:g} s"


def _capture_call(name: str, event: Any) -> Callable[[], str]:
    """The call of case ``name`` of CAPTURE_CASES, made where the name says."""
    what, where = name.split("_")[:2]
    call: Callable[[], object] = {
        "query": lambda: event.query(),
        "synchronize": lambda: event.synchronize(),
        "pin": lambda: torch.empty(3 * MiB + 4096, dtype=torch.uint8, pin_memory=True).numel(),
    }[what]
    if where == "same":
        return lambda: _attempt(call)
    if where == "isolated":  # as the engine's IO threads run (NOTE [capture mode])
        return lambda: _in_thread(lambda: (isolate_from_captures(), call())[1])
    return lambda: _in_thread(call)


def _capture_case(x: torch.Tensor, mode: str, call: Callable[[], str]) -> dict[str, str]:
    """Capture ``x * 2 + 1`` in ``mode`` with ``call`` made in the middle."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    outcome: dict[str, str] = {}
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
            y = x * 2
            outcome["call"] = call()
            y = y + 1
        outcome["capture"] = "ok"
    except Exception as exc:
        outcome["capture"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        # torch.cuda.graph leaves the capture stream current when capture_end raises:
        # the next case must start where the first one did.
        torch.cuda.set_stream(torch.cuda.default_stream())
    outcome["after"] = _attempt(lambda: float((x[:4] * 2).sum()))
    del graph
    return outcome


def check_capture(
    publish: Callable[[str, Any], None],
    *,
    run_case: Callable[[torch.Tensor, str, Callable[[], str]], dict[str, str]] = _capture_case,
) -> dict[str, Any]:
    """Every case of CAPTURE_CASES, each published (written) as soon as it ends."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: tests, with run_case
    x = torch.ones(1 << 20, device=device)
    event = None
    if device == "cuda":
        event = torch.cuda.Event()
        event.record()
        torch.cuda.synchronize()
    out: dict[str, Any] = {"cudart_found": _cudart() is not None}
    publish("cudart_found", out["cudart_found"])
    for name, survives in CAPTURE_CASES.items():
        mode = "thread_local" if name.endswith("_thread_local") else "global"
        outcome: dict[str, Any] = dict(run_case(x, mode, _capture_call(name, event)))
        outcome["expected"] = "capture ok" if survives else "capture fails"
        outcome["as_expected"] = (outcome.get("capture") == "ok") == survives
        out[name] = outcome
        publish(name, outcome)
    out["all_as_expected"] = all(out[name]["as_expected"] for name in CAPTURE_CASES if name in out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the results here (after each check)")
    p.add_argument("--pin-gib", type=int, default=4, help="GiB to pin, one GiB at a time")
    p.add_argument("--pin-deadline", type=float, default=12.0, help="stop pinning after this")
    p.add_argument("--direct-mib", type=int, default=256, help="MiB of the O_DIRECT round trip")
    p.add_argument("--disk-min-gbps", type=float, default=1.0, help="disk_ok threshold")
    p.add_argument("--save-dir", default=None, help="parent of the scratch folder (./.scratch)")
    args = p.parse_args(argv)
    report = Report(args.json)
    env = report.run("env", check_env)
    pinned = Pinned()
    cuda = bool(env.get("cuda_available"))
    if cuda:
        report.run("pin", lambda: check_pin(args.pin_gib, args.pin_deadline, pinned))
        report.run("link", lambda: check_link(pinned))
        report.run("pageable", lambda: check_pageable(pinned))
    report.run(
        "direct_io",
        lambda: check_direct_io(args.save_dir, args.direct_mib, args.disk_min_gbps, pinned),
    )
    if cuda:
        pinned.tensor = None
        report.run("capture", lambda: check_capture(report.part("capture")))
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    report.write()
    failed = [k for k, v in report.data.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
