"""The user-facing API under misuse: odd save_dir paths, config mappings, threads,
cancelled ``async with``, the seed's validator contract, and the CLI's exit codes."""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import json
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from prefetch_offload import (
    OffloadConfig,
    OffloadError,
    OffloadStats,
    cli,
    offload_context,
    offload_context_from_config,
    validate_offload_config,
)
from prefetch_offload import probe as probe_mod
from prefetch_offload import slab as slab_mod

SEED = Path("/work/shared/seed/activation_offload.py")


def _fail_writes(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_write(*args: Any) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(engine._store, "write", failing_write)


def _one_offload(engine: Any, x: torch.Tensor) -> None:
    y = (x * 2).sin()
    engine.flush()
    y.sum().backward()


# -- the context ------------------------------------------------------------------------


def test_exception_in_block_propagates_and_a_stored_write_error_warns(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(4096, requires_grad=True)
    with pytest.warns(UserWarning, match="injected.*another exception was propagating"):
        with pytest.raises(KeyError, match="mine"):
            with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
                _fail_writes(engine, monkeypatch)
                (x * 2).sin()
                raise KeyError("mine")
    assert engine.closed
    assert list(save_dir.iterdir()) == []


def test_disabled_context_yields_an_engine_with_flush() -> None:
    """Config-driven code calls engine.flush(); with offloading off it must still run."""
    with offload_context(None) as engine:
        engine.flush()
        assert not engine.closed and engine.io_method == "none"
    assert engine.closed
    assert engine.stats() == OffloadStats()


async def test_disabled_async_context_yields_an_engine_with_aflush() -> None:
    async with offload_context(None) as engine:
        await engine.aflush()
    assert engine.closed


def test_reentering_an_active_context_is_a_library_error(save_dir: Path) -> None:
    ctx = offload_context("disk", save_dir)
    with ctx as engine:
        with pytest.raises(OffloadError, match=r"offload_context\(\.\.\.\) again"), ctx:
            pytest.fail("the body must not run")
        assert not engine.closed  # the outer context is untouched
    assert engine.closed


def test_exit_in_another_thread_is_a_clear_error_and_leaves_the_context_usable(
    save_dir: Path,
) -> None:
    ctx = offload_context("disk", save_dir, min_offload_bytes=0)
    engine = ctx.__enter__()
    errors: list[BaseException] = []

    def exit_elsewhere() -> None:
        try:
            ctx.__exit__(None, None, None)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=exit_elsewhere)
    t.start()
    t.join()
    try:
        (err,) = errors
        assert isinstance(err, OffloadError), repr(err)
        assert "thread that entered it" in str(err)
        assert not engine.closed
    finally:
        ctx.__exit__(None, None, None)  # the right thread: hooks off, threads stopped
    assert engine.closed
    before = engine.stats()
    (torch.randn(1 << 15, requires_grad=True) * 2).sin()
    assert engine.stats() == before  # no hooks left in this thread


async def test_async_exit_cancelled_while_waiting_for_writes_still_cleans_up(
    save_dir: Path,
) -> None:
    """The wait in the executor outlasts the close's own: the cancelled exit returns
    once both have ended (the executor's may still be handing its batch to the pool)."""
    ctx = offload_context("disk", save_dir, min_offload_bytes=0)
    started = asyncio.Event()
    waits = [0, 0]  # the slow waits begun and ended
    lock = threading.Lock()

    async def body() -> None:
        async with ctx as engine:
            real = engine._wait_writes

            def slow() -> None:
                with lock:
                    first = waits[0] == 0
                    waits[0] += 1
                try:
                    time.sleep(0.6 if first else 0.0)  # (the executor's, then the close's)
                    real()
                finally:
                    with lock:
                        waits[1] += 1

            engine._wait_writes = slow
            (torch.randn(1 << 15, requires_grad=True) * 2).sin()
            started.set()

    task = asyncio.ensure_future(body())
    await started.wait()
    await asyncio.sleep(0.05)  # now in __aexit__, awaiting the writes
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    engine = ctx._engine
    assert engine is not None and engine.closed
    # Every wait begun has ended: the executor's (unless the cancel came before it
    # started, and then it never runs) and the close's.
    assert waits[0] == waits[1] >= 1
    before = engine.stats()
    (torch.randn(1 << 15, requires_grad=True) * 2).sin()
    assert engine.stats() == before  # the hooks came off
    assert list(save_dir.iterdir()) == []


# -- save_dir ---------------------------------------------------------------------------


def test_config_takes_a_path_and_expands_the_home_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert OffloadConfig(target="disk", save_dir=tmp_path).save_dir == str(tmp_path)  # type: ignore[arg-type]
    cfg = OffloadConfig(target="disk", save_dir="~/acts")
    assert cfg.save_dir == str(tmp_path / "home" / "acts")
    x = torch.randn(1 << 15, requires_grad=True)
    with offload_context("disk", "~/acts", min_offload_bytes=0) as engine:
        _one_offload(engine, x)
    assert engine.stats().tensors_offloaded == 1
    assert not (tmp_path / "~").exists()  # not a folder literally named "~"
    assert list((tmp_path / "home" / "acts").iterdir()) == []


def test_symlinked_unicode_and_relative_save_dirs_work_and_stay_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    real = tmp_path / "réal dir ü"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    x = torch.randn(1 << 15, requires_grad=True)
    for where in (real, link, "rel/sub", Path("rel2")):
        with offload_context("disk", where, min_offload_bytes=0) as engine:
            _one_offload(engine, x)
        assert engine.stats().tensors_offloaded == 1, where
    assert list(real.iterdir()) == []
    assert list((tmp_path / "rel" / "sub").iterdir()) == []
    assert list((tmp_path / "rel2").iterdir()) == []


def test_save_dir_below_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"cannot create save_dir.*write to"):
        with offload_context("disk", tmp_path / "f" / "sub"):
            pytest.fail("the body must not run")


def test_bad_stage_writes_is_refused_by_offload_context(save_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"stage_writes must be one of.*'auto'"):
        offload_context("disk", save_dir, stage_writes="yes")


# -- config mappings --------------------------------------------------------------------


def test_config_mapping_with_both_target_keys_is_an_error(save_dir: Path) -> None:
    cfg = {"activation_offloading": None, "target": "disk", "save_dir": str(save_dir)}
    with pytest.raises(ValueError, match=r"both 'activation_offloading'.*and 'target'"):
        offload_context_from_config(cfg)


def test_config_mapping_checks_the_knobs_even_when_disabled() -> None:
    """offload_context(None, prefetch_depth=-1) raises; the mapping form must too."""
    with pytest.raises(ValueError, match="prefetch_depth must be >= 0"):
        offload_context_from_config({"activation_offloading": None, "prefetch_depth": -1})
    ctx = offload_context_from_config({"target": None, "prefetch_depth": 2})
    assert ctx.config.target is None and ctx.config.prefetch_depth == 2


def test_config_mapping_unknown_keys_of_any_type_are_reported() -> None:
    with pytest.raises(ValueError, match=r"unknown offload setting.*1.*'prefetch_dept'") as info:
        offload_context_from_config({"activation_offloading": "cpu", 1: 2, "prefetch_dept": 3})
    assert "'target'" in str(info.value)  # an accepted key is listed as valid


def test_config_mapping_wrong_type_is_a_type_error(save_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"prefetch_depth must be an int.*'4'"):
        offload_context_from_config(
            {"activation_offloading": "disk", "save_dir": str(save_dir), "prefetch_depth": "4"},
            device="cpu",
        )
    with pytest.raises(TypeError, match="expected a mapping"):
        offload_context_from_config([("activation_offloading", "cpu")])  # type: ignore[arg-type]


def _seed() -> Any:
    spec = importlib.util.spec_from_file_location("seed_activation_offload", SEED)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not SEED.exists(), reason="the seed implementation is not here")
def test_validator_matches_the_seed_except_its_documented_extensions() -> None:
    """The seed's every branch, its own messages. The two extensions: CPU training is
    allowed (the device message says so), and an unknown target is reported first."""
    seed = _seed()
    for target in (None, "cpu", "disk", "gpu", ""):
        for backend in ("transformers", "unsloth", "mlx", "other"):
            for device in ("cuda", "cpu", "mps"):
                for save_dir in (None, "", "/tmp", Path("/tmp")):
                    args = (target, backend, device, save_dir)
                    want = seed.validate_offload_config(*args)
                    got = validate_offload_config(*args)
                    if target not in (None, "cpu", "disk"):
                        assert got == [
                            f"Unknown activation_offloading target: {target!r}. "
                            "Expected None, 'cpu', or 'disk'."
                        ], args
                    elif device == "cpu":
                        assert got == [m for m in want if "requires CUDA" not in m], args
                    elif device == "mps" and want and "CUDA" in want[0]:
                        assert got[0] == want[0].replace("CUDA training", "CUDA or CPU training")
                        assert got[1:] == want[1:], args
                    else:
                        assert got == want, args


# -- stats ------------------------------------------------------------------------------


def test_stats_hit_rate_and_bytes_staged_defaults() -> None:
    assert OffloadStats().hit_rate == 0.0
    assert OffloadStats().bytes_staged == 0
    assert OffloadStats(prefetch_hits=1, prefetch_misses=3).hit_rate == 0.25


# -- the CLI ----------------------------------------------------------------------------


def test_cli_without_a_command_or_with_an_unknown_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage:" in err and "Traceback" not in err
    assert cli.main(["frob"]) == 2
    assert "invalid choice: 'frob'" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert "probe" in out and "bench" in out and err == ""


def test_probe_with_an_empty_save_dir_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Path("") is ".": the probe must not measure the current folder instead."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["probe", "--save-dir", "", "--total-mib", "1", "--requests", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "save_dir is empty" in err


def test_probe_without_space_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(probe_mod.os, "posix_fallocate", no_space)
    argv = ["probe", "--save-dir", str(tmp_path), "--total-mib", "1", "--requests", "1"]
    assert cli.main([*argv, "--workers", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no room for" in err and "lower --total-mib" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_probe_io_error_exits_1_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(fd: int, buf: Any, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(probe_mod.os, "pwrite", broken)
    argv = ["probe", "--save-dir", str(tmp_path), "--total-mib", "1", "--requests", "1"]
    assert cli.main([*argv, "--workers", "1"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "IO error in" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_probe_json_on_a_folder_without_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(probe_mod, "direct_io_supported", lambda d: False)
    monkeypatch.setattr(slab_mod, "direct_io_supported", lambda d: False)  # the CLI's
    argv = ["probe", "--save-dir", str(tmp_path), "--total-mib", "1", "--requests", "1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli.main([*argv, "--workers", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["io_method"] == "buffered"
    assert set(doc) == {
        "save_dir",
        "io_method",
        "total_bytes",
        "repeats",
        "results",
        "recommendation",
    }
    (cell,) = doc["results"]
    assert set(cell) == {"request_bytes", "workers", "write_gbps", "read_gbps", "combined_gbps"}


@pytest.mark.parametrize("bad", [123, b"/tmp/acts", 1.5])
def test_non_path_save_dir_is_a_type_error_everywhere(
    bad: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """offload_context and the config mapping refuse a save_dir that is not a path, as
    OffloadConfig does (they once turned it into a folder named "123" or "b'/tmp/acts'")."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="save_dir must be a str path"):
        offload_context("disk", save_dir=bad)
    with pytest.raises(TypeError, match="save_dir must be a str path"):
        offload_context_from_config(
            {"activation_offloading": "disk", "save_dir": bad}, device="cpu"
        )
    assert list(tmp_path.iterdir()) == []
