"""Config validation at the API boundary, and the seed's validator contract."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetch_offload import OffloadConfig, validate_offload_config

DISK_MSG = (
    "activation_offloading='disk' requires a save_dir "
    "(scratch directory for offloaded activation tensors)."
)


def test_seed_messages_are_kept() -> None:
    assert validate_offload_config(None, "unsloth", "mps") == []
    assert validate_offload_config("cpu", "unsloth", "cuda") == [
        "Activation offloading is not compatible with the unsloth backend. "
        "Unsloth manages its own memory. Use backend: transformers."
    ]
    assert validate_offload_config("disk", "mlx", "cuda") == [
        "Activation offloading is not supported on the mlx backend. Use backend: transformers."
    ]
    assert validate_offload_config("disk", "transformers", "cuda") == [DISK_MSG]
    assert validate_offload_config("disk", "transformers", "cuda", "/tmp") == []


def test_cpu_training_with_disk_is_valid() -> None:
    assert validate_offload_config("disk", "transformers", "cpu", "/scratch") == []
    assert validate_offload_config("cpu", "transformers", "cpu") == []


def test_a_save_dir_the_context_would_refuse_is_reported() -> None:
    """The validator says what offload_context_from_config would raise for save_dir."""
    (msg,) = validate_offload_config("disk", "transformers", "cpu", "~nosuchuser_x/acts")
    assert "home folder that does not exist" in msg
    (msg,) = validate_offload_config("disk", "transformers", "cpu", 3)  # type: ignore[arg-type]
    assert "save_dir must be a str path" in msg
    (msg,) = validate_offload_config("cpu", "transformers", "cpu", 3)  # type: ignore[arg-type]
    assert "save_dir must be a str path" in msg  # as OffloadConfig, whatever the target


def test_a_disk_limit_of_one_page_or_more_is_accepted() -> None:
    assert OffloadConfig(target="disk", save_dir="/tmp/x", disk_bytes_limit=4096)
    assert OffloadConfig(target="cpu", disk_bytes_limit=0).disk_bytes_limit == 0


def test_unknown_target_and_device_are_reported() -> None:
    (msg,) = validate_offload_config("gpu", "transformers", "cuda")
    assert "Unknown activation_offloading target: 'gpu'" in msg and "'disk'" in msg
    (msg,) = validate_offload_config("cpu", "transformers", "mps")
    assert "Current device: mps" in msg


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"target": "tape"}, ValueError, "Expected None, 'cpu', or 'disk'"),
        ({"target": "disk"}, ValueError, "requires save_dir"),
        ({"prefetch_depth": -1}, ValueError, "prefetch_depth must be >= 0"),
        ({"prefetch_depth": 1.5}, TypeError, "prefetch_depth must be an int"),
        ({"prefetch_depth": True}, TypeError, "prefetch_depth must be an int"),
        ({"io_workers": 0}, ValueError, "io_workers must be >= 1"),
        ({"io_workers": 1 << 70}, ValueError, "io_workers must be at most 1024"),
        ({"slab_bytes": 1 << 63}, ValueError, "slab_bytes must be at most .* file offset"),
        ({"chunk_bytes": 1 << 64}, ValueError, "chunk_bytes must be at most"),
        ({"min_offload_bytes": -5}, ValueError, "min_offload_bytes"),
        ({"max_pending_write_bytes": 0}, ValueError, "max_pending_write_bytes"),
        ({"max_inflight_copy_bytes": 0}, ValueError, "max_inflight_copy_bytes"),
        ({"max_inflight_copy_bytes": 1.5}, TypeError, "max_inflight_copy_bytes"),
        ({"chunk_bytes": 5000}, ValueError, "multiple of 4096"),
        ({"slab_bytes": 100}, ValueError, "slab_bytes must be >= 4096"),
        ({"io_method": "aio"}, ValueError, "io_method must be one of"),
        ({"stage_writes": "sometimes"}, ValueError, "stage_writes must be one of"),
        ({"stage_writes": True}, ValueError, "stage_writes must be one of"),
        ({"disk_bytes_limit": -1}, ValueError, "disk_bytes_limit"),
        ({"disk_bytes_limit": 0}, ValueError, "disk_bytes_limit=0 leaves no room"),
        ({"disk_bytes_limit": 4095}, ValueError, "pass None for no cap"),
        ({"save_dir": 3}, TypeError, "save_dir must be a str"),
    ],
)
def test_bad_config_says_what_to_fix(kwargs: dict[str, Any], exc: type, match: str) -> None:
    base: dict[str, Any] = {"target": "disk", "save_dir": "/tmp/x"}
    if kwargs.get("target") == "disk":
        base.pop("save_dir")
    with pytest.raises(exc, match=match):
        OffloadConfig(**{**base, **kwargs})


def test_config_is_frozen_and_keyword_only_in_spirit() -> None:
    cfg = OffloadConfig(target="disk", save_dir="/tmp/x")
    with pytest.raises(AttributeError):
        cfg.prefetch_depth = 3  # type: ignore[misc]


_any_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 40), 1 << 40),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.sampled_from(["disk", "cpu", "auto", "mmap", "direct", "always", "never", "/tmp/x"]),
)


_MiB = 1 << 20
# Values each field takes in real use (the fuzz above is mostly rejections).
_usual_value: dict[str, Any] = {
    "target": st.sampled_from(["disk", "cpu", None]),
    "save_dir": st.sampled_from(["/tmp/x", "~/acts"]),
    "prefetch_depth": st.integers(0, 64),
    "io_workers": st.integers(1, 16),
    "min_offload_bytes": st.integers(0, 1 << 30),
    "max_pending_write_bytes": st.sampled_from([_MiB, 64 * _MiB, 1 << 30]),
    "max_inflight_copy_bytes": st.sampled_from([64 * _MiB, 1 << 30]),
    "chunk_bytes": st.sampled_from([4096, _MiB, 8 * _MiB]),
    "slab_bytes": st.sampled_from([_MiB, 256 * _MiB]),
    "io_method": st.sampled_from(["auto", "direct", "buffered", "mmap"]),
    "stage_writes": st.sampled_from(["auto", "always", "never"]),
    "disk_bytes_limit": st.one_of(st.none(), st.integers(_MiB, 1 << 40)),
    "verify": st.booleans(),
    "device_budget": st.one_of(st.integers(0, 1 << 40), st.sampled_from(["6GiB", "512MB"])),
    "host_budget": st.one_of(st.none(), st.integers(0, 1 << 40), st.just("32GiB")),
    "prefetch_bytes": st.one_of(st.none(), st.integers(1, 1 << 34), st.just("256MiB")),
    "heap_trim_bytes": st.one_of(
        st.none(), st.integers(_MiB, 1 << 34), st.sampled_from(["64MiB", "auto"])
    ),
    "model": st.one_of(st.none(), st.just(torch.nn.Sequential(torch.nn.Linear(2, 2)))),
    "recompute": st.sampled_from([None, "full", "auto"]),
    "recompute_blocks": st.one_of(st.none(), st.just(("0",)), st.just((torch.nn.Linear,))),
    "recompute_ranks": st.sampled_from(["agree", "own"]),
}


def test_usual_values_cover_every_field() -> None:
    assert set(_usual_value) == {f.name for f in dataclasses.fields(OffloadConfig)}


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional=_usual_value))
def test_a_built_config_rebuilds_from_its_own_fields(kwargs: dict[str, Any]) -> None:
    """What a config normalises (byte strings, "~", the target's defaults) stays as it is
    when the config is built again from its fields: a saved config loads back equal."""
    try:
        cfg = OffloadConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        assert "prefetch_offload" in str(exc) or "activation_offloading" in str(exc)
        return
    again = OffloadConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    assert again == cfg
    for name in ("device_budget", "host_budget", "prefetch_bytes", "heap_trim_bytes"):
        value = getattr(cfg, name)
        auto = name == "heap_trim_bytes" and value == "auto"
        whole = isinstance(value, int) and not isinstance(value, bool)  # (a default may
        assert value is None or whole or auto, (name, value)  # be an int subclass)
    assert cfg.save_dir is None or not cfg.save_dir.startswith("~")


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={name: _any_value for name in (f.name for f in dataclasses.fields(OffloadConfig))},
    )
)
def test_fuzzed_config_is_valid_or_rejected_cleanly(kwargs: dict[str, Any]) -> None:
    """Every combination either builds or raises ValueError/TypeError naming the library."""
    try:
        cfg = OffloadConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        assert msg and ("prefetch_offload" in msg or "activation_offloading" in msg), msg
        return
    assert cfg.prefetch_depth >= 0 and cfg.io_workers >= 1
    assert cfg.target != "disk" or cfg.save_dir


def test_the_entry_points_work_without_torch() -> None:
    """The API's contract (NOTE [no torch]): a CI job or a
    CLI's --help can check a trainer's setting, and enter its context, where torch is
    not installed; with a target the context says once that it does nothing."""
    code = (
        "import sys, warnings; sys.modules['torch'] = None\n"
        "from prefetch_offload import OffloadConfig, OffloadError, validate_offload_config\n"
        "from prefetch_offload import OffloadFallbackWarning, offload_context\n"
        "from prefetch_offload import offload_context_from_config\n"
        "assert validate_offload_config(None, 'transformers', 'cuda', None) == []\n"
        "assert validate_offload_config('disk', 'transformers', 'cuda', None)\n"
        "OffloadConfig(target='disk', save_dir='acts')\n"
        "with offload_context(None) as engine:\n"
        "    engine.flush()\n"
        "assert engine.closed and engine.stats().bytes_offloaded == 0\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    with offload_context_from_config(\n"
        "        {'activation_offloading': 'disk', 'save_dir': 'acts'}\n"
        "    ) as engine:\n"
        "        pass\n"
        "(w,) = seen\n"
        "assert w.category is OffloadFallbackWarning and 'torch' in str(w.message)\n"
        "assert engine.recompute_plan() is None\n"
        "try:\n"
        "    offload_context('disk')\n"
        "except ValueError as exc:\n"
        "    assert 'save_dir' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('a disk target without save_dir was accepted')\n"
        "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_byte_sizes_take_ascii_digits_and_heap_trim_bytes_names_its_words() -> None:
    with pytest.raises(ValueError, match="not a byte size"):
        OffloadConfig(target="cpu", device_budget="\u0661\u0662\u0663")  # Arabic-Indic 123
    with pytest.raises(ValueError, match='"auto" \\(the default\\) or None'):
        OffloadConfig(target="cpu", heap_trim_bytes="AUTO")


def test_offload_context_class_takes_a_config_not_a_mapping() -> None:
    from prefetch_offload import OffloadContext

    with pytest.raises(TypeError, match="offload_context_from_config"):
        OffloadContext({"target": "cpu"})  # type: ignore[arg-type]


def test_save_dir_paths_are_joined_to_the_working_directory_not_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "real" / "sub"
    real.mkdir(parents=True)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "link").symlink_to(real)
    given = str(tmp_path / "base" / "link" / ".." / "scratch")
    assert OffloadConfig(target="disk", save_dir=given).save_dir == given  # absolute: as is
    monkeypatch.chdir(tmp_path)
    relative = OffloadConfig(target="disk", save_dir="base/link/../scratch").save_dir
    assert relative == os.path.join(str(tmp_path), "base/link/../scratch")
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()  # no working directory left: the path stays as given
    assert OffloadConfig(target=None, save_dir="scratch").save_dir == "scratch"


def test_the_lazy_names_are_listed() -> None:
    import prefetch_offload

    assert set(prefetch_offload.__all__) <= set(dir(prefetch_offload))


def test_a_home_folder_of_nobody_known_is_refused() -> None:
    """expanduser leaves "~name" as it is when there is no such user: a folder named
    "~name" in the working directory is not what was meant."""
    with pytest.raises(ValueError, match="home folder"):
        OffloadConfig(target="disk", save_dir="~no_such_user_here_0/acts")


def test_a_numbered_cuda_device_is_a_cuda_device() -> None:
    assert validate_offload_config("cpu", "transformers", "cuda:1") == []
    assert validate_offload_config("cpu", "transformers", "mps")  # still refused


_M = torch.nn.Sequential(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"recompute": "some"}, ValueError, "recompute='some' is not a mode"),
        ({"recompute": 3, "model": _M}, TypeError, "recompute must be None, 'full', 'auto'"),
        ({"recompute": "auto"}, ValueError, "needs the model whose blocks it checkpoints"),
        ({"model": _M}, ValueError, "or drop model="),
        (
            {"recompute": "auto", "model": _M, "recompute_ranks": "all"},
            ValueError,
            "'agree'.*'own'",
        ),
        ({"recompute": "auto", "model": _M, "recompute_ranks": None}, ValueError, "not a choice"),
    ],
)
def test_bad_recompute_settings_are_refused_with_a_fix(
    kw: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        OffloadConfig(target="disk", save_dir="/tmp/x", **kw)


def test_replacing_the_target_resolves_a_default_host_budget_for_the_new_target(
    tmp_path: Path,
) -> None:
    """A default host_budget follows the target through dataclasses.replace (0 for disk,
    no limit for cpu); one the user gave stays, and None carried to disk says what to
    pass."""
    disk = OffloadConfig(target="disk", save_dir=str(tmp_path))
    assert disk.host_budget == 0
    cpu = dataclasses.replace(disk, target="cpu", save_dir=None)
    assert cpu.host_budget is None
    assert dataclasses.replace(cpu, target="disk", save_dir=str(tmp_path), host_budget=0) == disk
    given = OffloadConfig(target="disk", save_dir=str(tmp_path), host_budget=0)
    assert dataclasses.replace(given, target="cpu", save_dir=None).host_budget == 0
    with pytest.raises(ValueError, match=r"pass host_budget= to dataclasses\.replace"):
        dataclasses.replace(cpu, target="disk", save_dir=str(tmp_path))


def test_every_byte_size_takes_a_unit_string_and_is_stored_as_an_int() -> None:
    """The knobs that are byte sizes take "8MiB" as the budgets do; checks see the int."""
    cfg = OffloadConfig(
        target="disk",
        save_dir="/tmp/x",
        min_offload_bytes="64KiB",
        max_pending_write_bytes="64MiB",
        max_inflight_copy_bytes="1GiB",
        chunk_bytes="8MiB",
        slab_bytes="256MiB",
        disk_bytes_limit="20GB",
    )
    assert (cfg.min_offload_bytes, cfg.chunk_bytes, cfg.slab_bytes) == (1 << 16, 8 << 20, 256 << 20)
    assert (cfg.max_pending_write_bytes, cfg.max_inflight_copy_bytes) == (64 << 20, 1 << 30)
    assert cfg.disk_bytes_limit == 20 * 10**9
    with pytest.raises(ValueError, match="chunk_bytes must be a multiple of 4096"):
        OffloadConfig(target="disk", save_dir="/tmp/x", chunk_bytes="5000B")
    with pytest.raises(ValueError, match="disk_bytes_limit='lots' is not a byte size"):
        OffloadConfig(target="disk", save_dir="/tmp/x", disk_bytes_limit="lots")
