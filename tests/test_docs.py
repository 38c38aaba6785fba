"""The docstring examples of the public API run (those that need a model are marked SKIP),
and the docs cite tests that exist."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

import prefetch_offload


@pytest.mark.parametrize("module", ["config", "stats", "context", "probe"])
def test_docstring_examples(module: str) -> None:
    mod = importlib.import_module(f"prefetch_offload.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module} has no example that runs"
    assert result.failed == 0


def test_every_module_with_runnable_examples_is_checked() -> None:
    """A module whose docstrings gain a runnable example joins the list above."""
    package = Path(prefetch_offload.__file__).parent
    runnable = set()
    for path in package.glob("*.py"):
        mod = importlib.import_module(f"prefetch_offload.{path.stem}")
        tests = doctest.DocTestFinder().find(mod)
        if any(not ex.options.get(doctest.SKIP) for t in tests for ex in t.examples):
            runnable.add(path.stem)
    assert runnable == {"config", "stats", "context", "probe"}


def test_public_functions_document_themselves() -> None:
    for name in prefetch_offload.__all__:
        obj = getattr(prefetch_offload, name)
        assert obj.__doc__ and len(obj.__doc__.strip()) > 20, name


def test_every_test_the_guarantees_cite_exists() -> None:
    """docs/guarantees.md names the test behind each promise; a renamed or deleted test
    must not leave a promise pointing at nothing."""
    root = Path(__file__).resolve().parent.parent
    cited = set(re.findall(r"`(test_\w+)`", (root / "docs" / "guarantees.md").read_text()))
    defined = set()
    for path in (root / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
    assert cited, "no test names found: the citation format changed"
    assert cited <= defined, sorted(cited - defined)
