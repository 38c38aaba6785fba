"""Config validation at the API boundary, and the seed's validator contract."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
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
