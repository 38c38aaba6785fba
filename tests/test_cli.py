"""``python -m prefetch_offload``: the probe command, the recommendation rules, bench, run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefetch_offload import cli, heap, probe, slab
from prefetch_offload.probe import ProbeResult, combined_gbps, probe_bandwidth, recommend

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


def test_probe_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["probe", "--save-dir", str(tmp_path), "--total-mib", "8", "--requests", "1"]
    assert cli.main([*argv, "--workers", "1,2", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)  # stdout is exactly one JSON document, no progress bar in it
    assert doc["save_dir"] == str(tmp_path)
    assert doc["io_method"] in ("direct", "buffered")
    assert doc["total_bytes"] == 8 * MiB and doc["repeats"] == 1
    assert [(r["request_bytes"], r["workers"]) for r in doc["results"]] == [(MiB, 1), (MiB, 2)]
    for r in doc["results"]:
        assert r["write_gbps"] > 0 and r["read_gbps"] > 0
        assert r["combined_gbps"] == pytest.approx(combined_gbps(r["write_gbps"], r["read_gbps"]))
    rec = doc["recommendation"]
    assert set(rec) == {"chunk_bytes", "io_workers", "prefetch_depth"}
    assert rec["chunk_bytes"] == MiB and rec["io_workers"] in (1, 2)
    assert rec["prefetch_depth"] in (4, 8)
    assert "[" not in err  # stderr is not a terminal here: no bar unless --progress
    assert list(tmp_path.iterdir()) == []


def test_probe_table_and_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["probe", "--save-dir", str(tmp_path), "--total-mib", "4", "--requests", "1"]
    assert cli.main([*argv, "--workers", "1,2", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "write GB/s" in out and "read GB/s" in out
    assert f'offload_context("disk", save_dir={str(tmp_path)!r}, chunk_bytes=1 << 20' in out
    assert "[" not in out  # the bar is on stderr only
    lines = err.splitlines()
    assert lines[0] == "[....................] 0/2 probe 1 MiB x 1 worker"
    assert lines[1] == "[##########..........] 1/2 probe 1 MiB x 2 workers"
    assert lines[-1] == "[####################] 2/2 done"
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_redraws_one_line_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    bar = cli.ProgressBar(stream, width=4)
    bar(0, 2, "a long label")
    bar(1, 2, "b")
    bar(2, 2, "done")
    assert stream.getvalue() == (
        "\r[....] 0/2 a long label" + "\r[##..] 1/2 b" + " " * 11 + "\r[####] 2/2 done\n"
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "file", "is not a folder"),
        (lambda d: d / "missing", "does not exist"),
    ],
)
def test_probe_bad_save_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make, message: str
) -> None:
    (tmp_path / "file").write_text("x")
    bad = make(tmp_path)
    assert cli.main(["probe", "--save-dir", str(bad), "--total-mib", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert message in err and str(bad) in err
    assert "pass the folder you will give offload_context" in err
    assert not (tmp_path / "missing").exists()  # the probe does not create folders


@pytest.mark.parametrize("total_mib", [1 << 45, 1 << 30])
def test_probe_a_size_no_file_can_hold_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], total_mib: int
) -> None:
    """Past what a file offset holds (OverflowError) or what the filesystem allows in one
    file (EFBIG), or more than the disk has (ENOSPC): a usage error saying to lower it,
    not a traceback or an IO error."""
    argv = ["probe", "--save-dir", str(tmp_path), "--total-mib", str(total_mib)]
    assert cli.main([*argv, "--requests", "1", "--workers", "1", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "lower --total-mib" in err
    assert not list(tmp_path.iterdir())  # no scratch file left


@pytest.mark.parametrize(
    "extra",
    [["--requests", "0"], ["--workers", "1,x"], ["--total-mib", "-1"], ["--repeats", "0"]],
)
def test_probe_bad_numbers_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    assert cli.main(["probe", "--save-dir", str(tmp_path), *extra]) == 2
    assert "error: argument" in capsys.readouterr().err


def test_probe_an_unknown_home_folder_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["probe", "--save-dir", "~nosuchuser_po/x"]) == 2
    assert "home folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="home folder"):
        probe_bandwidth("~nosuchuser_po/x")


def test_probe_a_folder_the_os_cannot_look_up_is_a_value_error(tmp_path: Path) -> None:
    """stat() failing with more than "no such file" (here a name too long)."""
    with pytest.raises(ValueError, match="cannot be reached"):
        probe_bandwidth(tmp_path / ("x" * 300))


def test_probe_a_count_of_the_wrong_type_is_a_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="repeats must be an int"):
        probe_bandwidth(tmp_path, repeats=1.5)  # type: ignore[arg-type]


def test_probe_bandwidth_validates(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        probe_bandwidth(tmp_path, total_bytes=0)
    with pytest.raises(ValueError, match="multiples of 4096"):
        probe_bandwidth(tmp_path, request_sizes=[1000])
    with pytest.raises(ValueError, match="worker_counts is empty"):
        probe_bandwidth(tmp_path, worker_counts=[])
    with pytest.raises(ValueError, match="every worker has a request"):
        probe_bandwidth(tmp_path, total_bytes=MiB, request_sizes=[MiB], worker_counts=[2])
    assert list(tmp_path.iterdir()) == []


def _r(request_mib: int, workers: int, write: float, read: float) -> ProbeResult:
    return ProbeResult(request_mib * MiB, workers, write, read)


def test_recommend_rules() -> None:
    # chunk: the request size with the best combined rate (8 MiB: 2/(1/3+1/2) = 2.4).
    # workers: the smallest within 5% of that size's best: 2 (2.34 >= 0.95 * 2.4); not 1.
    results = [
        _r(1, 1, 2.0, 1.0),
        _r(1, 4, 2.2, 1.1),
        _r(8, 1, 2.0, 1.5),
        _r(8, 2, 2.9, 1.9),
        _r(8, 4, 3.0, 2.0),
    ]
    assert recommend(results) == {"chunk_bytes": 8 * MiB, "io_workers": 2, "prefetch_depth": 4}
    # Combined, not write alone: fast writes cannot make up for slow reads.
    assert recommend([_r(1, 1, 9.0, 0.6), _r(8, 1, 2.0, 2.0)])["chunk_bytes"] == 8 * MiB
    # Within 5%, the larger request and the fewer workers win.
    close = [_r(8, 2, 2.0, 2.0), _r(8, 1, 1.95, 1.95), _r(1, 1, 2.1, 2.1), _r(4, 1, 1.0, 1.0)]
    assert recommend(close) == {"chunk_bytes": 8 * MiB, "io_workers": 1, "prefetch_depth": 4}
    # More than 5% better: the smaller request wins.
    assert recommend([_r(8, 1, 2.0, 2.0), _r(1, 1, 2.2, 2.2)])["chunk_bytes"] == MiB
    # Slow reads (< 0.5 GB/s) double the lookahead.
    assert recommend([_r(8, 1, 1.0, 0.4)])["prefetch_depth"] == 8
    with pytest.raises(ValueError, match="at least one"):
        recommend([])


def test_bench_without_script_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "site-packages" / "bench" / "step.py"
    monkeypatch.setattr(cli, "bench_script", lambda: missing)
    assert cli.main(["bench", "--", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "source checkout" in err


def test_bench_script_is_found_in_the_checkout() -> None:
    assert cli.bench_script() == REPO / "bench" / "step.py"


def test_bench_runs_step_py(tmp_path: Path) -> None:
    step_args = ["--steps", "1", "--warmup", "0", "--width", "32", "--depth", "2"]
    step_args += ["--heads", "2", "--batch", "2", "--seq", "16", "--modes", "none,disk"]
    step_args += ["--knobs", '{"min_offload_bytes": 0}', "--shared"]
    proc = subprocess.run(
        [sys.executable, "-m", "prefetch_offload", "bench", "--", *step_args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bit-identical" in proc.stdout
    assert "disk" in proc.stdout


def test_probe_interrupted_exits_130_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(probe, "probe_bandwidth", interrupted)  # imported at the call
    assert cli.main(["probe", "--save-dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_probe_tilde_save_dir_is_expanded_for_every_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--save-dir ~/x`` probes, tests O_DIRECT on, and reports the home folder's x,
    as OffloadConfig reads it (the header once tested the literal "~/x")."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "acts").mkdir()
    seen: list[str] = []
    real = slab.direct_io_supported
    monkeypatch.setattr(slab, "direct_io_supported", lambda d: (seen.append(d), real(d))[1])
    argv = ["probe", "--save-dir", "~/acts", "--total-mib", "8", "--requests", "1"]
    assert cli.main([*argv, "--workers", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["save_dir"] == str(tmp_path / "acts")
    assert seen == [str(tmp_path / "acts")]
    assert doc["io_method"] == ("direct" if real(str(tmp_path / "acts")) else "buffered")


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefetch_offload", "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_run_starts_python_with_the_fast_reuse_caches_off() -> None:
    code = (
        "import os, sys; from prefetch_offload.heap import fast_reuse_hint, "
        "heap_trim_supported; print(os.environ['GLIBC_TUNABLES']); "
        "print(sys.argv[1:]); print(heap_trim_supported() and fast_reuse_hint())"
    )
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.arena_max=4:glibc.malloc.mxfast=64")
    proc = _run(["--", "-c", code, "a", "--b"], env)
    assert proc.returncode == 0, proc.stderr
    tunables, argv, hint = proc.stdout.splitlines()
    # The user's other tunables kept; the two the setting needs replaced, once each.
    assert tunables == f"glibc.malloc.arena_max=4:{heap.FAST_REUSE_OFF}"
    assert argv == "['a', '--b']"
    # The new process started with it, where glibc reads it: no hint left to give.
    assert hint in ("None", "False")


def test_run_passes_the_exit_status_through() -> None:
    proc = _run(["-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
    assert proc.returncode == 3 and "boom" in proc.stderr


def test_run_without_a_program_says_what_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run"]) == 2
    assert cli.main(["run", "--"]) == 2
    err = capsys.readouterr().err
    assert "run train.py" in err and "-m torch.distributed.run" in err


def test_run_environment_keeps_the_rest() -> None:
    env = cli.run_environment({"HOME": "/h"})
    assert env == {"HOME": "/h", "GLIBC_TUNABLES": heap.FAST_REUSE_OFF}
    env = cli.run_environment({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7:x=1:"})
    assert env["GLIBC_TUNABLES"] == f"x=1:{heap.FAST_REUSE_OFF}"


def test_help_and_run_start_without_torch() -> None:
    """The launcher and --help import neither torch nor the probe (run execs a Python
    that imports torch itself)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from prefetch_offload import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "sys.exit(cli.main(['run', '-c', 'print(\"child ran\")']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("child ran")


def test_an_interrupted_probe_stops_its_workers_before_it_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while the probe waits for its workers: they stop after the request in
    flight before the interrupt goes on (the caller then closes the file)."""
    import threading
    import time

    from prefetch_offload import probe as probe_module

    started = threading.Event()
    calls: list[int] = []

    def request(worker: int, offset: int) -> None:
        calls.append(offset)
        started.set()
        time.sleep(0.01)

    real_join = threading.Thread.join
    fired: list[int] = []

    def interrupted_join(self: threading.Thread, timeout: float | None = None) -> None:
        if not fired:
            fired.append(1)
            assert started.wait(5)
            raise KeyboardInterrupt
        real_join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", interrupted_join)
    with pytest.raises(KeyboardInterrupt):
        probe_module._striped(2, 1000 * 4096, 4096, request)
    done = len(calls)
    time.sleep(0.1)
    assert len(calls) == done < 1000  # nothing ran after it returned
