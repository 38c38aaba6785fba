"""bench/gpu_suite.sh and its stages' scripts, run on the CPU twin as the GPU machine would.

The device machine hands back at most 8 files from ``$OUT``, runs its own
``python3`` (pytest, pytest-timeout, hypothesis, matplotlib; no pytest-asyncio),
and gives the whole task 15 minutes of device time: these tests hold the suite to
that on the CPU (``SUITE_TWIN=1``), where CI can check it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# What the device machine returns from $OUT (its documented limit).
MAX_FILES_BACK = 8
TINY = ["--width", "32", "--depth", "2", "--heads", "2", "--batch", "2", "--seq", "16"]
TINY += ["--vocab", "64", "--steps", "1", "--warmup", "0", "--min-offload-bytes", "0"]


def _load(name: str) -> ModuleType:
    """bench/<name>.py as module ``_suite_<name>``, leaving ``sys.path`` as it was."""
    key = f"_suite_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    sys.modules[key] = module
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    finally:
        sys.path[:] = saved
    return module


def _suite(
    out: Path, *, python: str = sys.executable, timeout: float = 240, **env: str
) -> subprocess.CompletedProcess[str]:
    """bench/gpu_suite.sh on the twin with ``$OUT`` set, as the device machine runs it."""
    return subprocess.run(
        ["bash", str(BENCH / "gpu_suite.sh")],
        cwd=ROOT,
        env=dict(os.environ, PYTHON=python, SUITE_TWIN="1", OUT=str(out), **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _statuses(out: Path) -> dict[str, str]:
    lines = (out / "rc.txt").read_text().splitlines()
    return dict(line.split(" ", 1) for line in lines)


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def _without_pytest(tmp_path: Path) -> str:
    """A python whose ``import pytest`` fails, like a machine without it."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pytest.py").write_text("raise ImportError('no pytest on this machine')\n")
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/usr/bin/env bash\nPYTHONPATH="{shadow}:$PYTHONPATH" exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the whole suite")
def test_twin_suite_returns_every_stage_in_at_most_8_files(tmp_path: Path) -> None:
    """Every stage, in order, each with its own status; what is left under $OUT is at
    most 8 files (the archive of every stage's files, the summary, the statuses), and
    the run ends well inside its budget."""
    out = tmp_path / "out"
    proc = _suite(out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = _files(out)
    assert len(files) <= MAX_FILES_BACK, sorted(str(p.relative_to(out)) for p in files)
    assert {p.name for p in files} == {"rc.txt", "summary.txt", "results.tar.gz", "live.log"}
    assert all(p.stat().st_size < 16 << 20 for p in files)
    live = (out / "live.log").read_text()  # each stage's output, as it was printed
    assert live.startswith("preflight") and "targets:" in live  # first stage to last
    statuses = _statuses(out)
    assert list(statuses) == [
        "requirements",
        "preflight",
        "tests_cuda",
        "gpu_fp32",
        "gpu_bf16",
        "recompute",  # before disk: the stage the suite exists for goes first
        "gpu_disk",
    ]
    assert set(statuses.values()) == {"0"}, statuses
    with tarfile.open(out / "results.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        preflight = json.load(tar.extractfile("./preflight.json"))  # type: ignore[arg-type]
    for stage in ("preflight", "tests_cuda", "gpu_fp32", "gpu_bf16", "recompute", "gpu_disk"):
        assert f"{stage}.txt" in names, names
    assert {
        "env.txt",
        "preflight.json",
        "gpu_fp32.json",
        "gpu_bf16.json",
        "recompute.json",
    } <= names
    assert "finished" in preflight and "direct_io" in preflight
    summary = (out / "summary.txt").read_text()
    assert "stage: gpu_disk 0" in summary and "gpu_fp32 target PASS: final parameters" in summary
    seconds = int(summary.split(": ", 1)[1].split(" s of")[0])
    assert seconds < 300  # toy sizes; a GPU run's stage limits sum past the budget's cap


def test_suite_goes_on_without_pytest(tmp_path: Path) -> None:
    """A machine without pytest records the tests as skipped and runs the rest."""
    out = tmp_path / "out"
    proc = _suite(out, python=_without_pytest(tmp_path), SUITE_STAGES="preflight,tests")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "tests skipped: no pytest" in proc.stdout
    statuses = _statuses(out)
    assert statuses["requirements"] == "0" and statuses["preflight"] == "0"
    assert statuses["tests_cuda"] == "skipped (no pytest)"
    assert "stage: tests_cuda skipped (no pytest)" in (out / "summary.txt").read_text()


def test_suite_stage_without_time_left_is_not_started_and_fails(tmp_path: Path) -> None:
    """Stage limits are capped by what SUITE_BUDGET_S has left: a stage with under 10 s
    is not started, and says so in its status and the exit status."""
    out = tmp_path / "out"
    proc = _suite(out, SUITE_BUDGET_S="5", SUITE_STAGES="preflight")
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert _statuses(out)["preflight"] == "no_time"
    names = {p.name for p in _files(out)}
    assert names == {"rc.txt", "summary.txt", "results.tar.gz", "live.log"}


def test_cuda_tests_run_without_pytest_asyncio() -> None:
    """The GPU machine has no pytest-asyncio: the pytest configuration (asyncio_mode,
    --strict-markers) must not fail without it, and tests/test_cuda.py must collect."""
    argv = ["-q", "-p", "no:cacheprovider", "-p", "no:asyncio", "-m", "gpu_only"]
    argv += ["tests/test_cuda.py", "-W", "ignore::pytest.PytestConfigWarning"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    ran = "passed" if torch.cuda.is_available() else "skipped"
    assert ran in last and "error" not in last, last


# -- bench/gpu_preflight.py: the capture section ---------------------------------------


def test_preflight_capture_cases_are_written_as_each_ends(tmp_path: Path) -> None:
    """A capture case that hangs until the stage's limit kills the preflight must not
    take the cases before it along: each is in the JSON as soon as it ends."""
    preflight = _load("gpu_preflight")
    path = tmp_path / "preflight.json"
    report = preflight.Report(str(path))
    names = list(preflight.CAPTURE_CASES)
    seen: list[str] = []

    def run_case(x: torch.Tensor, mode: str, call: Callable[[], str]) -> dict[str, str]:
        seen.append(mode)
        if len(seen) == 3:
            on_disk = json.loads(path.read_text())["capture"]
            assert set(names[:2]) <= set(on_disk), on_disk
            raise KeyboardInterrupt  # the stage's SIGABRT, as far as this run goes
        return {"call": "ok (True)", "capture": "ok", "after": "ok (8.0)"}

    with pytest.raises(KeyboardInterrupt):
        report.run(
            "capture", lambda: preflight.check_capture(report.part("capture"), run_case=run_case)
        )
    on_disk = json.loads(path.read_text())["capture"]
    assert on_disk[names[0]]["as_expected"] == preflight.CAPTURE_CASES[names[0]]
    assert names[2] not in on_disk


def test_preflight_failed_capture_returns_to_the_default_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.cuda.graph leaves its capture stream current when capture_end raises; the
    next case must start from the default stream, not from the failed capture's."""
    preflight = _load("gpu_preflight")
    default, current = object(), []

    class Stream:
        def wait_stream(self, other: object) -> None:
            assert other is current[-1]

    class Graph:
        def __init__(self, graph: object, stream: Stream, capture_error_mode: str) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "graph", Graph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda: default)
    monkeypatch.setattr(torch.cuda, "set_stream", current.append)
    current.append(default)
    x = torch.ones(8)
    first = preflight._capture_case(x, "global", lambda: "raised")
    assert first["capture"].startswith("failed: RuntimeError")
    assert current[-1] is default
    second = preflight._capture_case(x, "global", lambda: "ok")  # waits on the default
    assert current[-1] is default and second["after"] == "ok (8.0)"
