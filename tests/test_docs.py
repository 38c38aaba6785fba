"""The docstring examples of the public API run (those that need a model are marked SKIP)."""

from __future__ import annotations

import doctest
import importlib

import pytest

import prefetch_offload


@pytest.mark.parametrize(
    "module", ["config", "stats", "context", "engine", "probe", "cli", "errors", "packed"]
)
def test_docstring_examples(module: str) -> None:
    mod = importlib.import_module(f"prefetch_offload.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_public_functions_document_themselves() -> None:
    for name in prefetch_offload.__all__:
        obj = getattr(prefetch_offload, name)
        assert obj.__doc__ and len(obj.__doc__.strip()) > 20, name
