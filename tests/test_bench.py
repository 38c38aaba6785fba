"""Smoke tests for bench/: each script's ``main`` runs at a tiny size and writes sane JSON.

bench/ is not a package, so its modules are loaded by file path. Every run gets
``--save-dir`` under ``tmp_path`` and runs from an empty working directory that
must still be empty afterwards, so nothing lands in the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import itertools
import json
import math
import mmap
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
TINY_SHAPE = ["--width", "32", "--depth", "2", "--heads", "2", "--batch", "2", "--seq", "16"]
TINY = [*TINY_SHAPE, "--min-offload-bytes", "0", "--steps", "2", "--warmup", "0"]
# Write batches small enough for the tiny model's tensors to reach the disk.
SMALL_BATCHES = ["--chunk-bytes", "16384"]
MiB = 1 << 20


def _load(name: str) -> ModuleType:
    """bench/<name>.py as module ``_bench_<name>``, leaving ``sys.path`` as it was."""
    key = f"_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    sys.modules[key] = module
    sys.path.insert(0, str(BENCH))  # for its own imports of bench/'s modules
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    finally:
        sys.path[:] = saved
    return module


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty working directory; the benches must not write to it (their default scratch)."""
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    yield d
    assert not list(d.iterdir()), f"bench left files in the working directory: {list(d.iterdir())}"


def _empty(folder: Path) -> bool:
    return not folder.exists() or not list(folder.iterdir())


# -- bench/step.py -----------------------------------------------------------------------


def test_step_main_every_mode_is_exact(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = _load("step")
    scratch, out = tmp_path / "scratch", tmp_path / "step.json"
    argv = [*TINY, *SMALL_BATCHES, "--no-mem-probe", "--save-dir", str(scratch), "--json", str(out)]
    assert step.main(argv) == 0
    assert _empty(scratch), list(scratch.iterdir())
    text = capsys.readouterr().out
    for column in ("step s", "offl MiB/step", "vs saved-budget", "hit rate", "steal s/step"):
        assert column in text
    assert "peak MiB" not in text  # no probe, no memory table
    assert "io bound:" in text and "target (budget)" in text
    assert "target (budget): step time " in text and "x of iobudget's (a bare thread" in text
    assert "iobudget: iospread moving saved - budget = " in text  # the legend
    assert "bit-identical" in text

    doc = json.loads(out.read_text())
    assert doc["check"] == {"ok": True, "problems": []}
    saved = doc["saved_activation_bytes"]
    rows = {r["mode"]: r for r in doc["rows"]}
    assert list(rows) == list(_load("_harness").MODES)
    for mode, row in rows.items():
        assert row["steps"] == 2 and len(row["step_seconds"]) == 2, mode
        assert all(s > 0 for s in row["step_seconds"]), mode
        assert row["ratio"] > 0, mode
        assert row["saved_bytes"] == saved, mode
        assert row["peak"] is None and row["act_mem"] is None, mode  # no probe
    assert rows["none"]["ratio"] == 1.0
    disk, budget = rows["disk"], rows["budget"]
    # The engine served the unpacks. Bytes written may be 0 at this size, where a step
    # can fit in the write tail and be kept in memory (NOTE [write tail]).
    assert disk["prefetch_hits"] + disk["prefetch_misses"] > 0
    assert disk["offloaded_per_step"] == disk["bytes_offloaded"] / 2
    assert 0.0 <= disk["hit_rate"] <= 1.0
    assert isinstance(disk["stall_seconds"], float)
    assert disk["device_budget"] == 0 and disk["move_target"] == saved
    # --budget-fraction 0.5 (the default): half the saved bytes stay, about half move.
    assert budget["device_budget"] == round(saved * step.BUDGET_FRACTION)
    assert doc["mode_knobs"]["budget"]["device_budget"] == budget["device_budget"]
    assert budget["move_target"] == saved - budget["device_budget"]
    # (the write tail may keep it all at this size)
    assert budget["offloaded_per_step"] == budget["bytes_offloaded"] / 2
    assert budget["moved_ratio"] == budget["offloaded_per_step"] / budget["move_target"]
    assert rows["seed"]["bytes_offloaded"] is None  # engine counters are disk's only
    assert rows["seed"]["device_budget"] is None
    assert doc["memory_probes"] == {} and doc["timelines"] == {}
    target = doc["target"]
    assert "disk" not in target  # its cut needs the probes
    assert target["budget"]["moved_ratio"] == budget["moved_ratio"]
    assert target["budget"]["time_vs_disk"] == pytest.approx(
        budget["median_step_s"] / disk["median_step_s"]
    )
    # Budget's step time is judged against iobudget (a bare thread moving saved - budget
    # bytes, paced), never against iospread (every saved byte).
    iobudget = rows["iobudget"]
    assert target["budget"]["time_vs_iobudget"] == pytest.approx(
        budget["median_step_s"] / iobudget["median_step_s"]
    )
    assert target["budget"]["iobudget_met"] == (
        target["budget"]["time_vs_iobudget"] <= step.IOBUDGET_LIMIT == 1.05
    )
    assert target["budget"]["iobudget_bytes_per_step"] == iobudget["offloaded_per_step"]
    assert "time_vs_iospread" not in target["budget"]
    bound = doc["io_bound"]
    assert bound["controls"] == {m: rows[m]["ratio"] for m in ("ioreplay", "iospread")}
    assert bound["reference"] == "iospread"
    assert bound["disk_over_reference"] == pytest.approx(
        disk["median_step_s"] / rows["iospread"]["median_step_s"]
    )
    # The replays report the bytes their thread really moved in the timed steps: the
    # distinct saved storages, whole pages, each step.
    page = 4096
    want = -(-saved // page) * page * 2
    assert rows["ioreplay"]["bytes_offloaded"] == want > 0
    assert rows["iospread"]["bytes_offloaded"] == want
    # iobudget's thread moves what the budget leaves over: saved - device_budget.
    move = saved - budget["device_budget"]
    assert doc["replay_bytes"] == {"ioreplay": saved, "iospread": saved, "iobudget": move}
    assert rows["iobudget"]["bytes_offloaded"] == -(-move // page) * page * 2
    assert 0 < rows["iobudget"]["offloaded_per_step"] < rows["iospread"]["offloaded_per_step"]
    assert rows["iobudget"]["device_budget"] is None  # no engine
    assert bound["reference_bytes_per_step"] == rows["iospread"]["offloaded_per_step"]
    assert bound["disk_bytes_per_step"] == disk["offloaded_per_step"]
    if _load("_common").steal_seconds() is not None:  # Linux: one steal sample per step
        assert all(len(r["steal_seconds"]) == 2 for r in rows.values())
        assert all(isinstance(r["steal_per_step"], float) for r in rows.values())


def test_ioreplay_moves_its_bytes_each_step_and_leaves_nothing(tmp_path: Path) -> None:
    common = _load("_common")
    folder = tmp_path / "replay"
    nbytes = 3 * 65536 + 100  # not a whole number of requests: the last one is short
    with common.IOReplay(str(folder), nbytes, chunk=65536, read_chunk=16384) as replay:
        for step in range(1, 3):
            replay.forward_started()
            replay.backward_started()
            replay.wait()
            rounded = 4 * 65536 - 65536 + 4096  # nbytes rounded up to whole pages
            assert replay.bytes_written == replay.bytes_read == step * rounded
    assert not list(folder.iterdir())  # the file had no name, or lost it at once


@pytest.mark.parametrize("spread", [True, False])
def test_iospread_paces_its_requests_over_the_last_step(tmp_path: Path, spread: bool) -> None:
    common = _load("_common")
    with common.IOReplay(
        str(tmp_path / "replay"), 4 * 65536, chunk=65536, read_chunk=65536, spread=spread
    ) as replay:
        for phase_s in (0.0, 0.2):  # the second step's forward and backward take 0.2 s each
            replay.forward_started()
            time.sleep(phase_s)
            replay.backward_started()
            time.sleep(phase_s)
            replay.wait()
        t0 = time.perf_counter()
        replay.forward_started()  # paced over the 0.2 s phases just measured, if spread
        replay.backward_started()
        replay.wait()
        took = time.perf_counter() - t0
    assert replay.bytes_written == replay.bytes_read == 3 * 4 * 65536
    # 4 requests each way: paced, the last starts 3/4 of the way through each phase.
    if spread:
        assert took >= 2 * 0.2 * 3 / 4 - 0.01
    else:
        assert took < 0.2


def test_ioreplay_raises_its_thread_error_at_wait(tmp_path: Path) -> None:
    common = _load("_common")
    replay = common.IOReplay(str(tmp_path / "replay"), 65536, chunk=65536)
    with replay:
        real, replay._fd = replay._fd, os.open(os.devnull, os.O_RDONLY)
        try:
            replay.forward_started()  # a write to a read-only descriptor: EBADF
            replay.backward_started()
            with pytest.raises(OSError):
                replay.wait()
        finally:
            os.close(replay._fd)
            replay._fd = real
        replay.forward_started()  # both failures were collected: the next step is clean
        replay.backward_started()
        replay.wait()


def test_ioreplay_rejects_bad_sizes(tmp_path: Path) -> None:
    common = _load("_common")
    with pytest.raises(ValueError, match="at least one page"):
        common.IOReplay(str(tmp_path), 4096, chunk=100)
    with pytest.raises(ValueError, match="nbytes"):
        common.IOReplay(str(tmp_path), -1, chunk=65536)


def test_step_main_memory_probes(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whole-step probes per mode under both allocators: peaks against the RSS before
    the first step, activation memory against none's, and an RSS timeline per mode."""
    step, probing = _load("step"), _load("_probe")
    scratch, out = tmp_path / "scratch", tmp_path / "step.json"
    argv = [*TINY, *SMALL_BATCHES, "--modes", "none,disk,budget", "--pending-sweep", "1,64"]
    argv += ["--trim-sweep", "1,off,64"]
    argv += ["--probe-jobs", "3", "--save-dir", str(scratch), "--json", str(out)]
    assert step.main(argv) == 0
    assert _empty(scratch), list(scratch.iterdir())
    text = capsys.readouterr().out
    for column in ("peak MiB", "fwd MiB", "bwd MiB", "act MiB", "act cut", "tuned peak"):
        assert column in text
    assert "target (disk, device_budget 0 MiB)" in text
    doc = json.loads(out.read_text())
    assert doc["check"]["ok"]
    saved = doc["saved_activation_bytes"]
    probes = doc["memory_probes"]
    assert set(probes) == set(probing.ALLOCATORS)
    n_steps, tuned = probing.PROBE_STEPS, str(probing.MMAP_THRESHOLD)
    rows = {r["mode"]: r for r in doc["rows"]}
    for mode, row in rows.items():
        assert len(row["peak_bytes"]) == len(row["tuned_peak_bytes"]) == 1, mode  # 1 repeat
        assert all(abs(b) < 1 << 30 for b in row["peak_bytes"]), mode
        assert row["peak"] == max(row["forward_peak"], row["backward_peak"]), mode
        assert row["act_mem"] == pytest.approx(row["peak"] - (rows["none"]["peak"] - saved))
        for allocator, threshold in (("default", None), ("tuned", tuned)):
            (probe,) = probes[allocator][mode]
            assert probe["mode"] == mode and probe["allocator"] == allocator
            assert probe["malloc_mmap_threshold"] == threshold
            assert probe["knobs"]["min_offload_bytes"] == 0
            assert probe["probed_steps"] == n_steps
            assert len(probe["step_peak_bytes"]) == n_steps, mode
            assert len(probe["cache_bytes"]) in (0, n_steps), mode  # 0: no meminfo
            assert len(probe["heap_bytes"]) in (0, n_steps), mode  # 0: no mallinfo2
            assert probe["act_mem_bytes"] == probe["step_peak_bytes"]  # bench/sweep.py's name
            if probe["peak_exact"]:  # the kernel's high-water mark never misses a sample
                for exact, sampled in zip(
                    probe["step_peak_bytes"], probe["sampled_peak_bytes"], strict=True
                ):
                    assert exact >= sampled, mode
            line = probe["timeline"]
            assert len(line["t_s"]) == len(line["rss_bytes"]), mode
            assert line["t_s"] == sorted(line["t_s"]), mode
            assert all(0 <= t <= line["end_s"] for t in line["t_s"]), mode
            assert 0 < line["backward_s"] < line["end_s"], mode
        assert doc["timelines"][mode] == probes["default"][mode][0]["timeline"]
    # none's activation memory is its saved bytes, by definition.
    assert rows["none"]["act_mem"] == pytest.approx(saved)
    assert rows["none"]["act_cut"] == pytest.approx(0.0)
    assert probes["default"]["budget"][0]["knobs"]["device_budget"] == round(saved / 2)
    counters = probes["default"]["disk"][0]["counters"]
    # Taken by the engine: written, or kept by the write tail (a tiny step may fit in it).
    assert counters["bytes_offloaded"] + counters["writes_skipped"] > 0
    assert doc["target"]["disk"]["act_cut"] == rows["disk"]["act_cut"]
    assert doc["target"]["budget"]["peak"] == rows["budget"]["peak"]
    # No iobudget ran: budget's step time is not judged (not against anything else).
    assert not {"time_vs_iobudget", "time_vs_iospread"} & set(doc["target"]["budget"])
    assert "step time against iobudget's (a bare thread moving saved - budget) not " in text
    pending = [p["max_pending_write_bytes"] for p in doc["pending_sweep"]]
    assert pending == [1 * MiB, 64 * MiB]
    assert doc["pending_sweep"][0]["probe"]["knobs"]["max_pending_write_bytes"] == MiB
    assert doc["pending_sweep"][1]["probe"] == probes["default"]["disk"][0]  # reused
    trims = [
        (p["heap_trim_bytes"], p["probe"]["knobs"]["heap_trim_bytes"]) for p in doc["trim_sweep"]
    ]
    assert trims == [(MiB, MiB), (0, 0), (64 * MiB, 64 * MiB)]  # 0: off
    assert doc["trim_sweep"][2]["probe"] == probes["default"]["disk"][0]  # the default, reused
    assert "disk memory by heap_trim_bytes" in text


def test_trim_sweep_values_are_mib_or_off() -> None:
    step = _load("step")
    assert step._trim_list("64, off,0.5") == [64 * MiB, 0, MiB // 2]
    for bad in ("0.0000001", "sideways", "-4"):
        with pytest.raises(argparse.ArgumentTypeError):
            step._trim_list(bad)


def test_counter_delta_subtracts_totals_and_keeps_gauges() -> None:
    """The window the probe's and the timed phase's counters are reported over."""
    harness = _load("_harness")
    start = {"bytes_offloaded": 100, "pack_wait_seconds": 0.5, "peak_pending_write_bytes": 7}
    end = {"bytes_offloaded": 350, "pack_wait_seconds": 0.75, "peak_pending_write_bytes": 9}
    end["prefetch_hits"] = 4  # absent at start: counted from zero
    assert harness.counter_delta(start, end) == {
        "bytes_offloaded": 250,
        "pack_wait_seconds": 0.25,
        "peak_pending_write_bytes": 9,
        "prefetch_hits": 4,
    }
    assert harness.counter_delta({}, end) == end


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_round_order_is_a_balanced_latin_square(n: int) -> None:
    """Over one cycle each mode runs once per slot and follows every other equally often."""
    common = _load("_common")
    items = [f"m{i}" for i in range(n)]
    cycle = n if n % 2 == 0 or n <= 2 else 2 * n
    rounds = [common.round_order(items, r) for r in range(cycle)]
    assert all(sorted(row) == items for row in rounds)
    for slot in range(n):
        counts = {m: sum(row[slot] == m for row in rounds) for m in items}
        assert len(set(counts.values())) == 1, (slot, counts)
    if n > 2:
        pairs: dict[tuple[str, str], int] = {}
        for row in rounds:
            for a, b in itertools.pairwise(row):
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1, pairs
    assert common.round_order(items, cycle) == rounds[0]  # it repeats


def test_peak_rss_catches_a_peak_between_samples() -> None:
    """reset_peak_rss + peak_rss_bytes see memory touched and freed with no sample taken."""
    common = _load("_common")
    if not common.reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here")
    base = common.read_rss_bytes()
    # 64 MiB of a mapping of its own (malloc could serve a tensor from free heap pages
    # that are resident already), touched page by page and unmapped.
    block = mmap.mmap(-1, 64 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, 64 * MiB, 4096):
        block[i] = 1
    block.close()
    peak = common.peak_rss_bytes()
    assert peak is not None and peak - base >= 60 * MiB
    assert common.read_rss_bytes() - base < 32 * MiB  # it really was freed
    assert common.reset_peak_rss()
    assert common.peak_rss_bytes() - common.read_rss_bytes() < 32 * MiB  # reset


def test_compare_params_names_a_differing_parameter() -> None:
    """The bit-identity check fails on a one-ulp change (a check that cannot fail is none)."""
    harness = _load("_harness")
    a = torch.nn.Linear(4, 4)
    b = copy.deepcopy(a)
    assert harness.compare_params(a, b, "none", "disk") is None
    with torch.no_grad():
        b.bias[2] = torch.nextafter(b.bias[2], torch.tensor(1e9))
    msg = harness.compare_params(a, b, "none", "disk")
    assert msg is not None and "'disk'" in msg and "bias" in msg and "1 of 2" in msg


def test_run_rounds_reports_the_failing_mode() -> None:
    harness = _load("_harness")
    model, batches = harness.build(harness.Shape(depth=1, width=16, heads=2, batch=1, seq=4), 2)

    def pack(t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    def hooks(_: object) -> contextlib.AbstractContextManager[object]:
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    workers = {
        "none": harness.ModeWorker(
            "none", model, batches, harness.ModeSetup(contextlib.nullcontext())
        ),
        "disk": harness.ModeWorker(
            "disk", model, batches, harness.ModeSetup(contextlib.nullcontext(), hooks)
        ),
    }
    with pytest.raises(harness.ModeFailed) as info:
        harness.run_rounds(workers, ["timed", "timed"])
    assert info.value.where == "mode 'disk' in round 1 (timed)"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_modes_share_one_thread_and_see_only_their_own_steps() -> None:
    """Every mode trains on the calling thread; a mode's hooks are installed for its
    own steps only, and none is left installed after the run."""
    harness = _load("_harness")
    shape = harness.Shape(depth=1, width=16, heads=2, batch=1, seq=4)
    model, batches = harness.build(shape, 3)
    packs: dict[str, list[int]] = {"a": [], "b": []}

    def counting(name: str) -> object:
        def hooks(_: object) -> contextlib.AbstractContextManager[object]:
            def pack(t: torch.Tensor) -> torch.Tensor:
                packs[name].append(threading.get_ident())
                return t

            return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

        return hooks

    workers = {
        n: harness.ModeWorker(
            n, model, batches, harness.ModeSetup(contextlib.nullcontext(), counting(n))
        )
        for n in ("a", "b")
    }
    harness.run_rounds(workers, ["timed"] * 3)
    assert packs["a"] and len(packs["a"]) == len(packs["b"])  # same model, same steps
    assert set(packs["a"]) == set(packs["b"]) == {threading.get_ident()}
    before = len(packs["a"]) + len(packs["b"])
    model(*batches[0]).backward()  # no hooks left behind
    assert len(packs["a"]) + len(packs["b"]) == before


# -- bench/io.py -------------------------------------------------------------------------


def test_io_main(tmp_path: Path, cwd: Path) -> None:
    io_bench = _load("io")
    out = tmp_path / "io.json"
    argv = ["--total-mib", "8", "--tensor-mib", "1", "--requests", "1", "--workers", "1"]
    argv += ["--repeats", "1", "--save-dir", str(tmp_path / "io"), "--json", str(out)]
    assert io_bench.main(argv) == 0
    assert _empty(tmp_path / "io")
    rows = json.loads(out.read_text())
    assert [(r["kind"], r["request_mib"], r["workers"]) for r in rows] == [
        ("raw", 1, 1),
        ("engine", 1, 1),
    ]
    for r in rows:
        assert r["write_gbps"] > 0 and r["read_gbps"] > 0
        assert r["write_ratio"] > 0 and r["read_ratio"] > 0


# -- bench/sweep.py ----------------------------------------------------------------------


def test_sweep_plan_reuses_grid_cells() -> None:
    sweep = _load("sweep")
    args = sweep._parse_args(
        ["--prefetch-depths", "1,4", "--io-workers", "2", "--pending-mib", "16,64"]
    )
    plan = sweep._plan(args)
    keys = [(g, k.prefetch_depth, k.io_workers, k.max_pending_write_bytes // MiB) for g, k in plan]
    assert keys == [("grid", 1, 2, 64), ("grid", 4, 2, 64), ("pending", 4, 2, 16)]


def test_sweep_main(tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = _load("sweep")
    scratch, out = tmp_path / "scratch", tmp_path / "sweep.json"
    argv = [*TINY, *SMALL_BATCHES, "--prefetch-depths", "0,2", "--io-workers", "1"]
    argv += ["--pending-mib", "1"]
    argv += ["--probe-jobs", "2", "--save-dir", str(scratch), "--json", str(out)]
    assert sweep.main(argv) == 0
    assert _empty(scratch), list(scratch.iterdir())
    assert "disk/none" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["check"] == {"ok": True, "problems": []}
    cells = doc["cells"]
    keys = [
        (c["group"], c["prefetch_depth"], c["io_workers"], c["max_pending_write_bytes"])
        for c in cells
    ]
    assert keys == [("grid", 0, 1, 64 * MiB), ("grid", 2, 1, 64 * MiB), ("pending", 4, 2, MiB)]
    for c in cells:
        assert len(c["none_seconds"]) == 2 and len(c["disk_seconds"]) == 2
        assert c["ratio"] > 0 and isinstance(c["stall_per_step"], float)
        assert isinstance(c["pack_wait_per_step"], float)
        # The engine served the step's unpacks. Bytes written may be 0: at this size a
        # step can fit in the write tail, which keeps it in memory (NOTE [write tail]).
        assert isinstance(c["bytes_offloaded"], int)
        assert c["prefetch_hits"] + c["prefetch_misses"] > 0
        assert c["mismatch"] is None
    assert cells[0]["act_mem_bytes"] is None  # grid cells are not probed
    assert cells[2]["act_mem_bytes"] is not None and cells[2]["baseline_act_bytes"] is not None
    assert doc["memory_probes"]["none"]["malloc_mmap_threshold"] == "65536"


def test_sweep_plot(tmp_path: Path, cwd: Path) -> None:
    pytest.importorskip("matplotlib")
    sweep = _load("sweep")
    png = tmp_path / "plots" / "sweep.png"
    argv = [*TINY, *SMALL_BATCHES, "--prefetch-depths", "0,1", "--io-workers", "1"]
    argv += ["--pending-mib", "1"]
    argv += ["--no-mem-probe", "--save-dir", str(tmp_path / "s"), "--plot", str(png)]
    assert sweep.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bench/gpu.py ------------------------------------------------------------------------


def _gpu_suite(
    out: Path, python: str = sys.executable, **env: str
) -> subprocess.CompletedProcess[str]:
    """bench/gpu_suite.sh run with ``python`` into ``out``: the finished process."""
    return subprocess.run(
        ["bash", str(BENCH / "gpu_suite.sh"), str(out)],
        cwd=BENCH.parent,
        env=dict(os.environ, PYTHON=python, **env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the whole suite")
def test_gpu_suite_fails_without_cuda(tmp_path: Path) -> None:
    """The prepared GPU run refuses a torch without CUDA (every gpu_only test would
    skip and pass) and says so in its exit status and rc.txt."""
    proc = _gpu_suite(tmp_path / "out")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout
    rc = (tmp_path / "out" / "rc.txt").read_text().split()
    assert rc == ["requirements", "0", "cuda_available", "3"]


def test_gpu_suite_refuses_an_unknown_stage(tmp_path: Path) -> None:
    proc = _gpu_suite(tmp_path / "out", SUITE_STAGES="preflight,test")
    assert proc.returncode == 2 and "unknown stage 'test'" in proc.stdout, proc.stdout


def test_gpu_suite_stops_where_the_engine_cannot_run(tmp_path: Path) -> None:
    """A python whose torch is older than the engine needs (or lacks numpy or pytest)
    stops the suite before any stage spends the lease."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in *check_torch_version*) echo "OffloadError: torch 2.0 is too old"; '
        "exit 1;; esac\n"
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    proc = _gpu_suite(tmp_path / "out", str(fake))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "too old" in proc.stdout and "nothing to run" in proc.stdout
    assert (tmp_path / "out" / "rc.txt").read_text().split() == ["requirements", "1"]


def _saved_storages(argv: list[str]) -> list[int]:
    """Bytes of each distinct storage one forward of bench/gpu.py's model (as ``argv``
    sizes it) saves for backward, parameters excluded (bench/step.py's measure)."""
    from prefetch_offload.testing import TinyTransformer, make_batch

    def a(flag: str) -> str:  # the value of the flag's last occurrence
        return argv[len(argv) - argv[::-1].index(flag)]

    torch.manual_seed(0)
    model = TinyTransformer(
        vocab=int(a("--vocab")),
        width=int(a("--width")),
        depth=int(a("--depth")),
        heads=int(a("--heads")),
        attention=a("--attention"),
    ).to({"fp32": torch.float32, "bf16": torch.bfloat16}[a("--dtype")])
    batch = make_batch(int(a("--batch")), int(a("--seq")), vocab=int(a("--vocab")))
    return _load("step").saved_storage_bytes(model, batch)


def _target(res: dict[str, Any], start: str) -> dict[str, str]:
    """The one target of a bench/gpu.py JSON whose name starts with ``start``."""
    found = [t for t in res["targets"] if t["target"].startswith(start)]
    assert len(found) == 1, (start, res["targets"])
    return found[0]


def _check_budget_modes(res: dict[str, Any], storages: list[int]) -> float:
    """What the budget and copybudget rows and targets of a twin run must show, given
    the saved storages of a fresh model of the same shape; the budget's bytes per step."""
    rows = {r["mode"]: r for r in res["rows"]}
    saved, held = res["saved_activation_bytes"], res["device_budget"]
    assert saved == sum(storages)
    assert held == round(saved * res["args"]["budget_fraction"])
    move = saved - held
    budget, bare = rows["budget"], rows["copybudget"]
    assert budget["exact"] == bare["exact"] == "yes"
    moved = budget["bytes_offloaded_per_step"]
    # Target "cpu": what the engine offloads is what it demoted from the device tier.
    assert moved == budget["bytes_demoted_to_host_per_step"]
    # NOTE [tiers]: the oldest records are demoted until the newest ones fit the budget,
    # so the device tier never keeps more than the budget, and the bytes moved exceed
    # saved - budget by less than one record (every storage here is offloaded whole).
    assert budget["peak_device_tier_bytes"] <= held
    assert move <= moved < move + max(storages)
    # copybudget moves saved - budget each step, by construction.
    assert bare["bytes_offloaded_per_step"] == move
    # The targets, judged on the rows' own numbers; the peak is not measured on the twin.
    peak = _target(res, "budget: step peak")
    assert peak["verdict"] == "n/a" and peak["value"] == "not measured (CPU twin)"
    judged = _target(res, "budget: bytes moved per step")
    if move:
        assert judged["verdict"] == ("PASS" if abs(moved - move) <= 0.10 * move else "FAIL")
        assert f": {moved / move:.3f}x" in judged["value"]
    for other, ok in (("cpu", lambda v: v < 1.0), ("copybudget", lambda v: v <= 1.05)):
        judged = _target(res, f"budget: step time {'below' if other == 'cpu' else 'at most'}")
        vs = budget["median_step_s"] / rows[other]["median_step_s"]
        assert judged["verdict"] == ("PASS" if ok(vs) else "FAIL"), judged
        assert judged["value"].endswith(f"ms: {vs:.3f}x")
        assert f"{budget['median_step_s'] * 1e3:.1f} vs " in judged["value"]
    return float(moved)


def _check_gpu_report(md: str, doc: dict[str, Any]) -> None:
    """bench/report.py's markdown of a twin run of bench/gpu.py shows the budget modes
    against saved - budget (KiB: the twin saves less than a MiB) and every target."""
    rows = {r["mode"]: r for r in doc["rows"]}
    saved, held = doc["saved_activation_bytes"], doc["device_budget"]
    move = saved - held
    assert saved < MiB
    assert (
        "| mode | device_budget KiB | saved - budget KiB | moved KiB/step | vs saved - budget |"
        in md
    )
    for mode in ("budget", "copybudget"):
        moved = rows[mode]["bytes_offloaded_per_step"]
        assert (
            f"| {mode} | {held / 1024:.1f} | {move / 1024:.1f} | {moved / 1024:.1f} | "
            f"{moved / move:.3f}x |" in md
        ), mode
    for t in doc["targets"]:
        assert f"| {t['target']} | {t['verdict']} | {t['value']} |" in md, t


def test_gpu_main_on_the_cpu_twin(
    tmp_path: Path, cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/gpu.py end to end on the CPU twin: every mode runs and is exact; the budget
    modes move what they should and their targets are judged on the rows' numbers."""
    gpu = _load("gpu")
    engines: list[Any] = []

    class Recorded(gpu.OffloadEngine):  # type: ignore[name-defined,misc]
        """The engines bench/gpu.py makes, kept to read their counters afterwards."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(gpu, "OffloadEngine", Recorded)
    out = tmp_path / "gpu.json"
    argv = [*TINY, *SMALL_BATCHES, "--twin", "--attention", "explicit", "--dtype", "fp32"]
    argv += ["--vocab", "64"]
    argv += ["--disk-probe-mb", "8", "--save-dir", str(tmp_path / "s"), "--json", str(out)]
    argv += ["--plot", str(tmp_path / "memory.png")]
    assert gpu.main(argv) == 0
    res = json.loads(out.read_text())
    rows = {r["mode"]: r for r in res["rows"]}
    assert list(rows) == list(gpu.MODES)
    assert list(rows) == ["none", "cpu", "budget", "copybudget", "disk", "save_on_cpu", "ondemand"]
    # The exactness step, the timed steps (no warm-up here) and the --plot step.
    steps_run = 1 + 2 + 1
    moved = _check_budget_modes(res, _saved_storages(argv))
    # The row's figure is the budget engine's own count, the same every step.
    (engine,) = [e for e in engines if e.config.device_budget]
    assert engine.config.device_budget == res["device_budget"]
    assert engine.stats().bytes_offloaded == moved * steps_run
    # At this size the newest records fill the budget to within 10% of the rest.
    assert _target(res, "budget: bytes moved per step")["verdict"] == "PASS"
    _check_gpu_report(_load("report").render(res), res)
    # --plot: one traced step per mode, RSS on the twin (memory_allocated on a GPU).
    for line in res["timelines"].values():
        assert line["counter"] == "RSS" and len(line["t_s"]) == len(line["rss_bytes"]) > 0
        assert 0 < line["backward_s"] < line["end_s"]
    assert list(res["timelines"]) == list(rows)
    has_plot = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "memory.png").exists() == has_plot
    if has_plot:  # drawn again from the JSON, as for a GPU machine without matplotlib
        assert gpu.main(["--replot", str(out), "--plot", str(tmp_path / "again.png")]) == 0
        assert (tmp_path / "again.png").stat().st_size > 0
    res["timelines"] = {}  # a run without --plot: nothing to draw, said so
    out.write_text(json.dumps(res))
    assert gpu.main(["--replot", str(out), "--plot", str(tmp_path / "none.png")]) == 1
    assert not (tmp_path / "none.png").exists()
    assert all(r["exact"] in ("ref", "yes") for r in rows.values())
    assert rows["cpu"]["bytes_offloaded_per_step"] > 0
    # Disk's bytes may all be kept by the write tail at this size (NOTE [write tail]).
    assert isinstance(rows["disk"]["bytes_offloaded_per_step"], float)
    # One reserved-memory sample per timed step (0 on the twin: no caching allocator).
    assert all(r["reserved_growth_bytes"] == [0, 0] for r in rows.values())
    assert _empty(tmp_path / "s")


def test_gpu_budget_modes_with_the_whole_budget(tmp_path: Path, cwd: Path) -> None:
    """--budget-fraction 1: the budget keeps every saved byte on the device, so neither
    budget nor copybudget moves anything, and 'nothing to move' passes."""
    gpu = _load("gpu")
    out = tmp_path / "gpu.json"
    argv = [*TINY, "--twin", "--attention", "explicit", "--dtype", "fp32", "--vocab", "64"]
    argv += ["--modes", "none,budget,copybudget", "--budget-fraction", "1", "--json", str(out)]
    argv += ["--save-dir", str(tmp_path / "s")]
    assert gpu.main(argv) == 0
    res = json.loads(out.read_text())
    rows = {r["mode"]: r for r in res["rows"]}
    assert res["device_budget"] == res["saved_activation_bytes"] == sum(_saved_storages(argv))
    assert rows["budget"]["bytes_offloaded_per_step"] == 0
    assert rows["copybudget"]["bytes_offloaded_per_step"] == 0
    judged = _target(res, "budget: bytes moved per step")
    assert judged["verdict"] == "PASS" and "nothing to move" in judged["value"]
    # cpu did not run: that target is n/a, and says why.
    judged = _target(res, "budget: step time below cpu's")
    assert (judged["verdict"], judged["value"]) == ("n/a", "cpu did not run")
    assert all(r["exact"] in ("ref", "yes") for r in rows.values())


@pytest.mark.parametrize("value", ["0", "-0.5", "1.01", "nan", "half"])
def test_gpu_budget_fraction_outside_0_1_is_refused(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _load("gpu").main(["--twin", "--budget-fraction", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--budget-fraction" in err and repr(value) in err, err
    if value != "half":
        assert "in (0, 1]" in err, err


def test_gpu_budget_targets_judge_each_boundary() -> None:
    """targets() on hand-made rows: each of issue 13's budget targets passes at its
    boundary and fails just past it, on non-zero memory figures."""
    gpu = _load("gpu")
    saved, held = 10**9, 4 * 10**8  # saved - budget = 600 MB
    keys = {
        "budget: step peak": "peak",
        "budget: bytes moved": "moved",
        "budget: step time below": "vs cpu",
        "budget: step time at most": "vs copybudget",
    }

    def judge(
        *,
        peak: int = 10**9,
        none_peak: int = 15 * 10**8,
        moved: float = 6e8,
        budget_s: float = 0.9,
        cpu_s: float | None = 1.0,
        bare_s: float | None = 1.0,
        held: int = held,
    ) -> dict[str, str]:
        """The budget targets' verdicts, by ``keys``' names."""

        def row(mode: str, step_s: float, step_peak: int, moved: float | None = None) -> object:
            return gpu.GpuRow(
                mode, (step_s,), (1,), (step_peak,), "yes", bytes_offloaded_per_step=moved
            )

        rows = [row("none", 0.5, none_peak)]
        if cpu_s is not None:
            rows.append(row("cpu", cpu_s, none_peak // 4, 1e9))
        rows.append(row("budget", budget_s, peak, moved))
        if bare_s is not None:
            rows.append(row("copybudget", bare_s, none_peak, 6e8))
        out = {}
        for t in gpu.targets(rows, saved_bytes=saved, device_budget=held):
            key = [k for name, k in keys.items() if t["target"].startswith(name)]
            if key:
                out[key[0]] = t["verdict"]
        return out

    assert judge() == dict.fromkeys(keys.values(), "PASS")
    # (a) step peak <= budget + (none's step peak - saved) + 10% of saved = 1 GB.
    assert judge(peak=10**9 + 1)["peak"] == "FAIL"
    assert judge(none_peak=15 * 10**8 - 1)["peak"] == "FAIL"  # none's peak counts
    assert judge(peak=10**9 + 1, held=held + 1)["peak"] == "PASS"  # so does the budget
    # (b) bytes moved within 10% of saved - budget: 540 to 660 MB.
    for moved, verdict in (
        (6.6e8, "PASS"),
        (6.6e8 + 1, "FAIL"),
        (5.4e8, "PASS"),
        (5.4e8 - 1, "FAIL"),
    ):
        assert judge(moved=moved)["moved"] == verdict, moved
    # (c) below cpu's step time: equal fails.
    assert judge(budget_s=1.0, cpu_s=1.0)["vs cpu"] == "FAIL"
    assert judge(budget_s=0.999, cpu_s=1.0)["vs cpu"] == "PASS"
    # (d) at most 1.05x copybudget's step time.
    assert judge(budget_s=1.05, cpu_s=2.0, bare_s=1.0)["vs copybudget"] == "PASS"
    assert judge(budget_s=math.nextafter(1.05, 2), cpu_s=2.0)["vs copybudget"] == "FAIL"
    # A reference that did not run: n/a.
    alone = judge(cpu_s=None, bare_s=None)
    assert (alone["vs cpu"], alone["vs copybudget"]) == ("n/a", "n/a")
    # Memory that reads 0 (the CPU twin): the peak is n/a, not PASS or FAIL.
    assert judge(peak=0, none_peak=0)["peak"] == "n/a"
    # Without the sizes, or without a budget row: no budget targets at all.
    rows = [gpu.GpuRow("none", (0.5,), (1,), (1,), "ref")]
    assert not any(
        t["target"].startswith("budget:") for t in gpu.targets(rows, saved_bytes=1, device_budget=0)
    )
    rows.append(gpu.GpuRow("budget", (0.6,), (1,), (1,), "yes", bytes_offloaded_per_step=1.0))
    assert not any(t["target"].startswith("budget:") for t in gpu.targets(rows))


# -- bench/ab.py -------------------------------------------------------------------------


def test_ab_main_tiny(tmp_path: Path, cwd: Path) -> None:
    ab = _load("ab")
    out = tmp_path / "ab.json"
    argv = [*TINY_SHAPE, "--rounds", "2", "--warmup", "1", "--save-dir", str(tmp_path / "s")]
    argv += ["--config", 'small:{"chunk_bytes": 16384, "min_offload_bytes": 0}']
    argv += ["--config", 'big:{"min_offload_bytes": 0}', "--json", str(out)]
    assert ab.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "ab.py" and doc["check"]["ok"]
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == ["none", "small", "big"] and rows["none"]["ratio"] == 1.0
    assert all(isinstance(r["faults_per_step"], float) for r in rows.values())
    # Small batches reach the disk, or stay in the write tail when backward comes first.
    assert rows["small"]["mb_per_step"] + rows["small"]["skipped_per_step"] > 0
    assert rows["big"]["mb_per_step"] == 0 and rows["big"]["skipped_per_step"] > 0
    assert all(isinstance(r["steal_s"], float) for r in rows.values())
    assert _empty(tmp_path / "s")


def test_ab_isolate_runs_each_configuration_in_its_own_process(tmp_path: Path, cwd: Path) -> None:
    """--isolate: the lanes train in child processes (the parent never packs a tensor)
    and come back bit-identical, with their own counters."""
    ab = _load("ab")
    out = tmp_path / "ab.json"
    argv = [*TINY_SHAPE, "--rounds", "2", "--warmup", "1", "--save-dir", str(tmp_path / "s")]
    argv += ["--isolate", "--config", 'small:{"chunk_bytes": 16384, "min_offload_bytes": 0}']
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ab.Lane, "step", lambda self: pytest.fail("a lane stepped in the parent"))
        assert ab.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["isolate"] and doc["check"]["ok"]
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == ["none", "small"]
    # The engine in the child took tensors: written, or kept by the write tail (under
    # load a tiny step's writes can all still be queued when backward starts).
    assert rows["small"]["mb_per_step"] + rows["small"]["skipped_per_step"] > 0
    assert _empty(tmp_path / "s")


def test_ab_isolate_names_the_lane_that_failed_in_its_process(tmp_path: Path, cwd: Path) -> None:
    """A knob the engine refuses fails in the child: the parent raises LaneFailed with the
    lane's name and the child's error, and no process or scratch file is left behind."""
    ab = _load("ab")
    argv = [*TINY_SHAPE, "--rounds", "1", "--warmup", "0", "--save-dir", str(tmp_path / "s")]
    argv += ["--isolate", "--config", 'bad:{"prefetch_depth": -1}']
    with pytest.raises(ab.LaneFailed, match=r"(?s)lane 'bad' failed.*prefetch_depth"):
        ab.main(argv)
    assert multiprocessing.active_children() == []
    assert _empty(tmp_path / "s")


def test_ab_checkpoint_reentrant_keeps_the_recompute_in_memory(tmp_path: Path, cwd: Path) -> None:
    """--checkpoint reentrant: every lane recomputes its blocks in backward; the engine
    keeps what the recompute saves (NOTE [packs inside backward]), exactly."""
    ab, report = _load("ab"), _load("report")
    out = tmp_path / "ab.json"
    argv = [*TINY_SHAPE, "--rounds", "2", "--warmup", "1", "--save-dir", str(tmp_path / "s")]
    argv += ["--checkpoint", "reentrant", "--config", 'c:{"min_offload_bytes": 0}']
    assert ab.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["shape"]["checkpoint"] == "reentrant" and doc["check"]["ok"]
    row = doc["rows"][1]
    assert row["kept_in_backward_per_step"] > 0
    assert "every block checkpointed (reentrant); one process" in "\n".join(report._render_ab(doc))
    with pytest.raises(SystemExit):
        ab.main(["--checkpoint", "sometimes"])


def test_ab_rejects_a_bad_config() -> None:
    ab = _load("ab")
    with pytest.raises(SystemExit):
        ab.main(["--config", "x:{not json"])
    with pytest.raises(SystemExit):
        ab.main(["--config", 'x:{"noop_io": "sideways"}'])


def test_ab_noop_io_skips_the_store_and_is_left_unchecked(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """noop_io="both": no write reaches the slab file, and the run passes without the
    bit-identity check for that configuration, saying so."""
    ab = _load("ab")
    calls: list[str] = []
    from prefetch_offload.slab import SlabStore

    real_write = SlabStore.write

    def spy(self: SlabStore, *a: object) -> None:
        calls.append("write")
        real_write(self, *a)  # type: ignore[arg-type]

    argv = [*TINY_SHAPE, "--rounds", "2", "--warmup", "0", "--save-dir", str(tmp_path / "s")]
    argv += ["--config", 'skip:{"chunk_bytes": 16384, "min_offload_bytes": 0, "noop_io": "both"}']
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SlabStore, "write", spy)
        assert ab.main(argv) == 0
    assert calls == []  # the instance's no-op shadowed every real write
    assert "not checked, IO skipped: skip" in capsys.readouterr().out


# -- bench/hostcost.py -------------------------------------------------------------------


def test_hostcost_main_tiny(tmp_path: Path, cwd: Path) -> None:
    hostcost = _load("hostcost")
    out = tmp_path / "hostcost.json"
    argv = ["--total-mib", "4", "--request-mib", "2", "--save-dir", str(tmp_path / "s")]
    assert hostcost.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "hostcost.py" and doc["command"].startswith("python bench/hostcost")
    rows = doc["rows"]
    seen = {(r["load"], r["buffer"], r["op"]) for r in rows}
    assert seen == {
        (a, b, c) for a in ("idle", "loaded") for b in ("4k", "huge") for c in ("write", "read")
    }
    assert all(r["gbps"] > 0 and r["cpu_ms_per_gb"] >= 0 for r in rows)
    assert _empty(tmp_path / "s")


def test_hostcost_buffered_kind_reaches_the_device(
    tmp_path: Path, cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--buffered`` adds the page-cache kind, flushed and dropped every --sync-mib."""
    hostcost = _load("hostcost")
    calls: list[str] = []
    real_sync, real_advise = os.fdatasync, os.posix_fadvise
    monkeypatch.setattr(hostcost.os, "fdatasync", lambda fd: (calls.append("sync"), real_sync(fd)))
    monkeypatch.setattr(
        hostcost.os,
        "posix_fadvise",
        lambda fd, off, n, adv: (calls.append(f"drop {off} {n}"), real_advise(fd, off, n, adv)),
    )
    out = tmp_path / "hostcost.json"
    argv = ["--total-mib", "4", "--request-mib", "1", "--sync-mib", "2", "--no-load"]
    assert (
        hostcost.main([*argv, "--buffered", "--save-dir", str(tmp_path / "s"), "--json", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(r["buffer"], r["op"]) for r in rows} >= {("cache", "write"), ("cache", "read")}
    mib = 1 << 20
    # After the setup drop: two flushed-and-dropped halves on write, two drops on read.
    assert calls[-6:] == [
        "sync",
        f"drop 0 {2 * mib}",
        "sync",
        f"drop {2 * mib} {2 * mib}",
        f"drop 0 {2 * mib}",
        f"drop {2 * mib} {2 * mib}",
    ]
    assert _empty(tmp_path / "s")


# -- bench/compiled.py -------------------------------------------------------------------


@pytest.mark.slow  # compiles: ~10 s with a warm inductor cache, ~40 s cold
def test_compiled_main_tiny(tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/compiled.py end to end at --tiny: eager and regional (each block compiled)
    train under disk offload, bit-identical to the same mode without it, with per-step
    hit rates and the logged unpack order. A torch.compile that fails here fails the test."""
    compiled = _load("compiled")
    out = tmp_path / "compiled.json"
    argv = ["--tiny", "--modes", "eager,regional", "--warmup", "1", "--steps", "2"]
    assert compiled.main([*argv, "--save-dir", str(tmp_path / "s"), "--json", str(out)]) == 0
    assert _empty(tmp_path / "s")
    assert "bit-identical" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["check"] == {"ok": True, "problems": []}
    rows = {r["mode"]: r for r in doc["rows"]}
    assert list(rows) == ["eager", "regional"]
    for mode, row in rows.items():
        taken = row["bytes_offloaded_per_step"] + row["writes_skipped_per_step"]
        assert row["exact"] and taken > 0, mode
        assert len(row["steps"]) == len(row["ref_steps"]) == 3, mode
        assert len(row["hit_rate_per_step"]) == 2, mode
        assert all(0.0 <= h <= 1.0 for h in row["hit_rate_per_step"]), mode
        last = row["steps"][-1]
        timed = [st for st in row["steps"] if not st["warmup"]]
        # The engine served the unpacks. Bytes read may be 0: at this size a step is
        # smaller than one write batch, and the write tail may keep it all in memory.
        served = sum(
            st["counters"]["prefetch_hits"] + st["counters"]["prefetch_misses"] for st in timed
        )
        assert not last["warmup"] and served > 0, mode
        order = last["unpack_order"]
        assert order["unpacks"] > 0 and 0.0 <= order["reverse_fraction"] <= 1.0, mode
        assert min(order["relative_seqs"]) == 0 and order["runs"], mode
    assert rows["eager"]["graphs"] == 0
    assert rows["regional"]["graphs"] > 0 and rows["regional"]["ref_graphs"] > 0
    # order_runs: maximal runs of consecutive numbers in either direction.
    assert compiled.order_runs([5, 4, 3, 3, 7, 8, 10]) == [(5, 3), (7, 8), (10, 10)]


def test_compiled_seq_lengths_change_every_step_and_keep_the_order(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--seq-lengths: each step its own length (eager here, which compiles nothing); the
    order learned at one length serves the next (predicted from the second step)."""
    compiled, report = _load("compiled"), _load("report")
    out = tmp_path / "compiled.json"
    argv = ["--tiny", "--modes", "eager", "--warmup", "1", "--steps", "3"]
    argv += ["--seq-lengths", "16,12,20", "--save-dir", str(tmp_path / "s"), "--json", str(out)]
    assert compiled.main(argv) == 0
    assert "sequence length per step: 16, 12, 20, 16" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["seq_lengths"] == [16, 12, 20, 16] and doc["check"]["ok"]
    (row,) = doc["rows"]
    predicted = [st["counters"]["predicted_steps"] for st in row["steps"]]
    assert predicted == [0, 1, 1, 1]
    assert "2 sequences of 16, 12, 20, 16 tokens in turn" in "\n".join(report._render_compiled(doc))
    with pytest.raises(SystemExit):
        compiled._parse_args(["--seq-lengths", "16,0"])


# -- bench/report.py ---------------------------------------------------------------------


@pytest.mark.slow  # compiles (bench/compiled.py's regional mode), as test_compiled_main_tiny
def test_report_tables_from_every_benchmark_json(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench/report.py on the JSON that step.py (with probes and --plot), compiled.py,
    gpu.py (CPU twin), ab.py and hostcost.py write at tiny sizes: a table per part, with
    the figures of the JSON, the command and the machine line; step.py's output leads
    with what offload saved, what it cost and that training stayed exact."""
    step, compiled, gpu, report = _load("step"), _load("compiled"), _load("gpu"), _load("report")
    step_json, png = tmp_path / "step.json", tmp_path / "memory.png"
    argv = [*TINY, *SMALL_BATCHES, "--modes", "none,disk,budget,iospread,iobudget"]
    argv += ["--pending-sweep", "1", "--trim-sweep", "off", "--save-dir", str(tmp_path / "s1")]
    argv += ["--json", str(step_json), "--plot", str(png)]
    assert step.main(argv) == 0
    text = capsys.readouterr().out
    lead = text.splitlines()[:3]
    # (At this size the probe's noise is larger than the activations: no cut to expect.)
    assert lead[0].startswith("Offload to disk ") and "activation memory" in lead[0], lead
    assert lead[1].startswith("It cost ") and "x in step time" in lead[1], lead
    assert lead[2].startswith("Training stayed exact"), lead
    # The full tables come next, what the columns mean after them.
    assert (
        text.index("vs none  offl MiB/step")
        < text.index("bench/step.py on ")
        < text.index("step s: ")
    )
    doc = json.loads(step_json.read_text())
    # The replay modes train as none: not probed.
    assert set(doc["memory_probes"]["default"]) == {"none", "disk", "budget"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and doc["plot"] == str(png)
    else:
        assert not png.exists() and doc["plot"] is None
    compiled_json = tmp_path / "compiled.json"
    argv = ["--tiny", "--modes", "eager,regional", "--warmup", "1", "--steps", "2"]
    argv += ["--save-dir", str(tmp_path / "s2"), "--json", str(compiled_json)]
    assert compiled.main(argv) == 0
    gpu_json = tmp_path / "gpu.json"
    argv = [*TINY, *SMALL_BATCHES, "--twin", "--attention", "explicit", "--dtype", "fp32"]
    argv += ["--vocab", "64", "--disk-probe-mb", "8", "--save-dir", str(tmp_path / "s3")]
    assert gpu.main([*argv, "--json", str(gpu_json)]) == 0
    ab_json = tmp_path / "ab.json"
    argv = [*TINY_SHAPE, "--rounds", "2", "--warmup", "0", "--save-dir", str(tmp_path / "s4")]
    argv += ["--config", 'small:{"chunk_bytes": 16384, "min_offload_bytes": 0}']
    assert _load("ab").main([*argv, "--json", str(ab_json)]) == 0
    host_json = tmp_path / "hostcost.json"
    argv = ["--total-mib", "4", "--request-mib", "2", "--save-dir", str(tmp_path / "s5")]
    assert _load("hostcost").main([*argv, "--json", str(host_json)]) == 0
    capsys.readouterr()

    files = [str(f) for f in (step_json, compiled_json, gpu_json, ab_json, host_json)]
    assert report.main(files) == 0
    md = capsys.readouterr().out
    assert f"Command: `{doc['command']}`" in md and doc["command"].startswith("python bench/step")
    host = doc["machine_line"].split(" on ", 1)[1]  # "bench/step.py on HOST: ..."
    assert f"Machine: {host}" in md and "cores" in host
    rows = {r["mode"]: r for r in doc["rows"]}
    for header in (
        "| mode | what | step s | vs none | written MiB/step | hit rate |",
        "| mode | peak MiB | forward peak MiB | backward peak MiB | activation MiB |",
        "| mode | device_budget MiB | peak MiB | peak limit MiB | saved - budget MiB |",
        "| mode | what | vs none | vs iospread | written MiB/step | steal s/step |",
        "| max_pending_write_bytes MiB | peak MiB | activation MiB |",
        "| heap_trim_bytes MiB | peak MiB | activation MiB | activation cut | heap trims/step |",
        "| off | ",
        "| target | needs | measured | verdict |",
        "| mode | what | no offload s | disk s | vs no offload | hit rate | hit rate per step |",
        "| mode | step ms | vs none | forward peak GB |",
    ):
        assert header in md, header
    disk = rows["disk"]
    assert (
        f"| disk | {disk['label']} | {disk['median_step_s']:.3f} | {disk['ratio']:.2f}x | "
        f"{disk['offloaded_per_step'] / MiB:.1f} |" in md
    )
    assert f"| disk | {disk['peak'] / MiB:.1f} | " in md
    budget = rows["budget"]
    assert f"| budget | {budget['device_budget'] / MiB:.1f} | {budget['peak'] / MiB:.1f} | " in md
    cut = doc["target"]["disk"]
    verdict = "met" if cut["met"] else "**not met**"
    assert f"| >= 80% | {cut['act_cut'] * 100:.0f}% | {verdict} |" in md
    # Budget's step time against iobudget: a bare thread moving saved - budget, paced.
    iobudget = rows["iobudget"]
    move = doc["saved_activation_bytes"] - budget["device_budget"]
    assert iobudget["bytes_offloaded"] == -(-move // 4096) * 4096 * iobudget["steps"]
    judged = doc["target"]["budget"]
    assert judged["time_vs_iobudget"] == pytest.approx(
        budget["median_step_s"] / iobudget["median_step_s"]
    )
    assert "time_vs_iospread" not in judged
    verdict = "met" if judged["iobudget_met"] else "**not met**"
    assert (
        f"| budget: step time / iobudget's | <= 1.05x | {judged['time_vs_iobudget']:.2f}x | "
        f"{verdict} |" in md
    )
    assert "step time / iospread's" not in md
    # The IO table shows iobudget beside iospread (the reference for disk's IO).
    assert (
        f"| iobudget | {iobudget['label']} | {iobudget['ratio']:.2f}x | "
        f"{iobudget['median_step_s'] / rows['iospread']['median_step_s']:.2f}x | "
        f"{iobudget['offloaded_per_step'] / MiB:.1f} |" in md
    )
    for row in json.loads(compiled_json.read_text())["rows"]:
        assert f"| {row['mode']} | {row['label']} | {row['ref_median_step_s']:.3f} |" in md
    assert "| gradients bit-identical to none | PASS |" in md
    _check_gpu_report(md, json.loads(gpu_json.read_text()))
    small = json.loads(ab_json.read_text())["rows"][1]
    assert f"| small | {json.dumps(small['knobs'])} | {small['step_s']:.3f} |" in md
    loaded = json.loads(host_json.read_text())["rows"][-1]
    assert f"| loaded | {loaded['buffer']} | {loaded['op']} | {loaded['gbps']:.2f} |" in md
    # Only a benchmark's JSON is accepted, with a message saying so.
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    assert report.main([str(other)]) == 1
    assert "not the JSON of any of: bench/step.py" in capsys.readouterr().err


def test_report_targets_judge_budget_against_iobudget() -> None:
    """Budget's step time is shown against iobudget, and only where iobudget ran."""
    report = _load("report")
    new = {"time_vs_disk": 0.9, "time_met": True, "time_vs_iobudget": 1.02}
    new |= {"iobudget_met": True, "iobudget_limit": 1.05}
    md = report._step_targets({"target": {"budget": new}})
    assert "| budget: step time / iobudget's | <= 1.05x | 1.02x | met |" in md
    assert "iospread" not in md
    # Budget ran without iobudget: no step-time row at all.
    assert report._step_targets({"target": {"budget": {"device_budget": 1}}}) is None
    # The targets are set on the benchmark without checkpointing.
    checkpointed = {"shape": {"checkpoint": "reentrant"}, "target": {"budget": new}}
    assert report._step_targets(checkpointed) is None


def test_report_renders_the_step_json_in_docs(capsys: pytest.CaptureFixture[str]) -> None:
    """The step.py JSON files docs/benchmarks.md cites render, targets included."""
    files = sorted(str(f) for f in (BENCH.parent / "docs" / "results").glob("step*.json"))
    if not files:
        pytest.skip("no step.py JSON in docs/results/")
    assert _load("report").main(files) == 0
    assert "| target | needs | measured | verdict |" in capsys.readouterr().out
