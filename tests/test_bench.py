"""Smoke tests for bench/: each script's ``main`` runs at a tiny size and writes sane JSON.

bench/ is not a package, so its modules are loaded by file path. Every run gets
``--save-dir`` under ``tmp_path`` and runs from an empty working directory that
must still be empty afterwards, so nothing lands in the repository.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
RESULTS = BENCH.parent / "docs" / "results"
TINY_SHAPE = ["--width", "32", "--depth", "2", "--heads", "2", "--batch", "2", "--seq", "16"]
# Write batches small enough for the tiny model's tensors to reach the disk.
KNOBS = ["--knobs", json.dumps({"min_offload_bytes": 0, "chunk_bytes": 16384})]
TINY = [*TINY_SHAPE, *KNOBS, "--steps", "2", "--warmup", "0"]
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
    return not folder.exists() or not any(folder.rglob("*"))


# -- bench/step.py -----------------------------------------------------------------------


def test_step_every_cpu_mode_in_one_process_is_exact(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default CPU lanes, shared: exact, the bare-IO lanes move what they should,
    the budget lane keeps its share, and no memory is claimed per lane."""
    step, out = _load("step"), tmp_path / "step.json"
    scratch = tmp_path / "scratch"
    argv = [*TINY, "--shared", "--save-dir", str(scratch), "--json", str(out)]
    assert step.main(argv) == 0
    assert _empty(scratch), list(scratch.iterdir())
    text = capsys.readouterr().out
    assert "bit-identical to none's in every lane" in text
    assert "Step time: " in text and "Peak memory" not in text  # shared: not per lane
    doc = json.loads(out.read_text())
    saved = doc["saved_bytes"]
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == ["none", "disk", "budget", "iospread", "iobudget"]
    assert doc["check"]["ok"] and rows["none"]["ratio"] == 1.0
    assert all(len(doc["steps"][n]) == 2 and r["peak"] is None for n, r in rows.items())
    budget = round(saved * step.BUDGET_FRACTION)
    assert rows["budget"]["budget"] == budget and rows["disk"]["budget"] is None
    assert rows["disk"]["hit_rate"] is not None and rows["disk"]["offloaded"] > 0
    page = 4096  # the bare thread moves whole pages: every saved byte, or saved - budget
    assert rows["iospread"]["offloaded"] == -(-saved // page) * page
    assert rows["iobudget"]["offloaded"] == -(-(saved - budget) // page) * page
    verdicts = {t["target"].split(":")[0]: t["verdict"] for t in doc["targets"]}
    assert verdicts["final parameters bit-identical to none"] == "PASS"


def test_step_isolated_lanes_measure_their_own_memory_and_plot_it(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each lane in a process of its own, a --config lane with its own knobs and
    environment: per-lane peak and live memory, the traced step's RSS and live bytes
    over time, and the traced step's time against the median."""
    step, out, png = _load("step"), tmp_path / "step.json", tmp_path / "memory.png"
    config = {"heap_trim_bytes": None, "env": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
    argv = [*TINY, "--modes", "none,disk", "--config", "notrim:" + json.dumps(config)]
    argv += ["--save-dir", str(tmp_path / "s"), "--json", str(out), "--plot", str(png)]
    assert step.main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("Peak memory of a training step: ")
    assert "traced step (--plot) against the lane's median: none " in text
    doc = json.loads(out.read_text())
    assert doc["isolated"] and doc["check"]["ok"]
    rows = {r["name"]: r for r in doc["rows"]}
    assert rows["notrim"]["label"] == "disk " + json.dumps(config)
    assert all(r["peak"] > 0 and r["act"] is not None for r in rows.values())
    lanes = {lane["name"]: lane for lane in doc["lanes"]}
    assert lanes["notrim"]["knobs"]["heap_trim_bytes"] is None
    assert lanes["notrim"]["env"] == config["env"]
    assert set(doc["timelines"]) == {"none", "disk"}
    for line in doc["timelines"].values():
        assert len(line["t_s"]) == len(line["rss_bytes"]) == len(line["live_bytes"]) >= 1
        assert 0 < line["backward_s"] < line["end_s"] and line["interval_s"] >= 0.01
    if png.exists():  # matplotlib installed
        assert png.stat().st_size > 0


def test_step_isolated_lane_failure_names_the_lane(tmp_path: Path, cwd: Path) -> None:
    """A lane whose engine cannot start in its process: exit status 2, no hang."""
    step = _load("step")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    bad = "bad:" + json.dumps({"save_dir": str(blocker / "sub")})
    harness = _load("_harness")
    spec = harness.LaneSpec("bad", "disk", {"save_dir": str(blocker / "sub")})
    lane = harness.ProcessLane(
        spec, harness.Shape(depth=1, width=8, heads=1), 1, "cpu", str(tmp_path)
    )
    with pytest.raises(harness.LaneFailed, match="lane 'bad'"):
        lane.wait_ready()
    lane.close()
    argv = [*TINY, "--modes", "none", "--config", bad, "--save-dir", str(tmp_path / "s")]
    assert step.main(argv) == 2


def test_step_on_the_twin_runs_every_gpu_mode(tmp_path: Path, cwd: Path) -> None:
    """--device twin: the CUDA path's engine layer on the CPU, every mode exact."""
    step, out = _load("step"), tmp_path / "twin.json"
    argv = [*TINY, "--device", "twin", "--shared", "--modes", "none,cpu,budget,disk,save_on_cpu"]
    argv += ["--save-dir", str(tmp_path / "s"), "--json", str(out)]
    assert step.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == "twin" and doc["check"]["ok"]
    assert [r["name"] for r in doc["rows"]] == ["none", "cpu", "budget", "disk", "save_on_cpu"]


def test_step_refuses_bad_configs_and_modes(capsys: pytest.CaptureFixture[str]) -> None:
    harness, step = _load("_harness"), _load("step")
    for text in ("no json", 'x:{"mode": "fast"}', 'x:{"io_workers": 0}', 'x:{"nope": 1}', "x:[1]"):
        with pytest.raises(argparse.ArgumentTypeError):
            harness.parse_config(text)
    assert harness.parse_config('t:{"mode": "budget", "budget_fraction": 0.25}')[0] == "t"
    for argv in (["--modes", "none,cpu"], ["--modes", "warp"], ["--budget-fraction", "2"]):
        with pytest.raises(SystemExit):
            step.main(argv)


@pytest.mark.slow
def test_step_compiles_each_block(tmp_path: Path, cwd: Path) -> None:
    """--compile regional: each block compiled, offload exact against the same compile."""
    step, out = _load("step"), tmp_path / "c.json"
    argv = [*TINY, "--shared", "--modes", "none,disk", "--compile", "regional"]
    argv += ["--save-dir", str(tmp_path / "s"), "--json", str(out)]
    assert step.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["shape"]["compile"] == "regional" and doc["check"]["ok"]
    assert doc["rows"][1]["hit_rate"] is not None


def test_step_checkpointed_blocks_are_exact(tmp_path: Path, cwd: Path) -> None:
    step = _load("step")
    argv = [*TINY, "--shared", "--modes", "none,disk", "--checkpoint", "reentrant"]
    assert step.main([*argv, "--save-dir", str(tmp_path / "s")]) == 0


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


def test_iospread_paces_its_requests_over_the_last_step(tmp_path: Path) -> None:
    common = _load("_common")
    with common.IOReplay(str(tmp_path / "replay"), 4 * 65536, chunk=65536, read_chunk=65536) as r:
        for phase_s in (0.0, 0.2):  # the second step's forward and backward take 0.2 s each
            r.forward_started()
            time.sleep(phase_s)
            r.backward_started()
            time.sleep(phase_s)
            r.wait()
        t0 = time.perf_counter()
        r.forward_started()  # paced over the 0.2 s phases just measured
        r.backward_started()
        r.wait()
        took = time.perf_counter() - t0
    assert r.bytes_written == r.bytes_read == 3 * 4 * 65536
    # 4 requests each way: the last starts 3/4 of the way through each phase.
    assert took >= 2 * 0.2 * 3 / 4 - 0.01


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


# -- bench/sweep.py, bench/io.py ---------------------------------------------------------


def test_sweep_main(tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep, out = _load("sweep"), tmp_path / "sweep.json"
    argv = [*TINY_SHAPE, *KNOBS, "--steps", "1", "--warmup", "0", "--shared"]
    argv += ["--prefetch-depths", "1,2", "--io-workers", "1", "--pending-mib", "1"]
    argv += [
        "--save-dir",
        str(tmp_path / "s"),
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "p.png"),
    ]
    assert sweep.main(argv) == 0
    cells = json.loads(out.read_text())["cells"]
    assert [(c["prefetch_depth"], c["io_workers"]) for c in cells] == [(1, 1), (2, 1), (4, 2)]
    assert cells[2]["max_pending_write_bytes"] == MiB
    assert all(c["exact"] and c["ratio"] > 0 for c in cells)
    assert "pending MiB" in capsys.readouterr().out


def test_io_main_and_cost(tmp_path: Path, cwd: Path) -> None:
    io_bench = _load("io")
    out, cost = tmp_path / "io.json", tmp_path / "cost.json"
    argv = ["--total-mib", "8", "--tensor-mib", "1", "--requests", "1", "--workers", "1"]
    argv += ["--repeats", "1", "--save-dir", str(tmp_path / "s"), "--json", str(out)]
    assert io_bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["raw", "engine"] and all(r["read_gbps"] > 0 for r in rows)
    argv = ["--cost", "--total-mib", "8", "--save-dir", str(tmp_path / "s"), "--json", str(cost)]
    assert io_bench.main(argv) == 0
    doc = json.loads(cost.read_text())
    assert doc["command"].startswith("python bench/io.py --cost")
    assert {(c["load"], c["buffer"], c["op"]) for c in doc["cost"]} == {
        (load, buf, op)
        for load in ("idle", "loaded")
        for buf in ("4k", "huge")
        for op in ("write", "read")
    }


# -- bench/report.py ---------------------------------------------------------------------


def test_report_renders_every_result_in_docs(capsys: pytest.CaptureFixture[str]) -> None:
    """Every JSON in docs/results is one bench/report.py renders, with its command."""
    files = sorted(RESULTS.glob("*.json"))
    assert files
    assert _load("report").main([str(f) for f in files]) == 0
    text = capsys.readouterr().out
    for f in files:
        doc = json.loads(f.read_text())
        assert f"- Command: `{doc['command']}`" in text


def test_report_rejects_other_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"rows": []}')
    assert _load("report").main([str(path)]) == 1
    assert "not the JSON of any of: bench/step.py" in capsys.readouterr().err


def test_report_update_fills_the_marked_blocks(tmp_path: Path, cwd: Path) -> None:
    """--update regenerates what lies between a block's markers, and nothing else."""
    doc = json.loads((RESULTS / "recompute-llama.json").read_text())
    md = tmp_path / "doc.md"
    marker = f"<!-- report.py {RESULTS / 'recompute-llama.json'} -->"
    md.write_text(f"intro\n\n{marker}\nstale table\n<!-- end report.py -->\n\noutro\n")
    assert _load("report").main(["--update", str(md)]) == 0
    text = md.read_text()
    assert "stale table" not in text and text.startswith("intro\n\n") and text.endswith("outro\n")
    assert f"- Command: `{doc['command']}`" in text and "| auto10 |" in text


def test_a_gpu_step_is_judged_against_the_link_floor_where_the_link_is_known() -> None:
    """Moving every saved byte out and back at the pinned link's GB/s bounds a step: a
    link-bound shape is held to that floor, a compute-bound one to no offload's step."""
    step = _load("step")
    doc = json.loads((RESULTS / "gpu-bf16.json").read_text())  # 4.6 GB saved, 41 ms

    def verdict() -> str:
        return next(t["verdict"] for t in step._targets(doc) if "step time" in t["target"])

    doc.pop("link_gbps", None)
    assert verdict() == "FAIL"  # 0.173 s: 4.3x no offload's step
    doc["link_gbps"] = {"d2h": 55.0, "h2d": 55.0}
    assert verdict() == "PASS"  # out and back at 55 GB/s: 0.169 s
    doc["link_gbps"] = {"d2h": 550.0, "h2d": 550.0}
    assert verdict() == "FAIL"  # a link ten times faster: no offload's step is the floor


@pytest.mark.gpu_only
def test_the_link_is_measured_on_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    link = _load("step")._link_gbps(16 * MiB)
    assert set(link) == {"d2h", "h2d"} and min(link.values()) > 0


def test_a_json_s_command_names_the_allocator_settings_it_ran_under(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = _load("_text")
    monkeypatch.setattr(text, "machine_line", lambda prog, machine: "")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    plain = text.json_header("step.py", ["--steps", "2"], {})
    assert plain["command"] == "python bench/step.py --steps 2"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    tuned = text.json_header("step.py", ["--steps", "2"], {})
    assert (
        tuned["command"]
        == "GLIBC_TUNABLES=glibc.malloc.tcache_count=0 python bench/step.py --steps 2"
    )
