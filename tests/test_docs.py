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


def _note_definitions(root: Path) -> dict[str, set[str]]:
    """NOTE name -> the files (by name) that hold its ``# NOTE [name]`` block."""
    defined: dict[str, set[str]] = {}
    for path in [*root.glob("prefetch_offload/*.py"), *root.glob("bench/*.py")]:
        for name in re.findall(r"^# NOTE \[([^\]]+)\]\s*$", path.read_text(), re.M):
            defined.setdefault(name, set()).add(path.name)
    return defined


def test_every_note_reference_names_a_note_where_it_says() -> None:
    """Each NOTE is defined once, and every ``NOTE [name]`` in the code, tests and docs
    names a NOTE that exists, in the file the reference names (when it names one)."""
    root = Path(__file__).resolve().parent.parent
    defined = _note_definitions(root)
    assert len(defined) > 20, "no NOTE blocks found: the definition format changed"
    assert not {n: f for n, f in defined.items() if len(f) > 1}, "a NOTE defined twice"
    files = [
        *root.glob("prefetch_offload/*.py"),
        *root.glob("bench/*.py"),
        *root.glob("tests/*.py"),
        *root.glob("docs/*.md"),
        root / "README.md",
    ]
    wrong = []
    for path in files:
        # References wrap across comment lines: join them first.
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())
        for m in re.finditer(r"NOTE\s+\[([^\]]+)\](?:\s+in\s+`?([\w/]+\.py))?", text):
            name, where = m.group(1), m.group(2)
            if name in ("name", "{name}"):  # the format, in design.md and here
                continue
            if name not in defined or (where and Path(where).name not in defined[name]):
                wrong.append(f"{path.name}: NOTE [{name}]" + (f" in {where}" if where else ""))
    assert not wrong, wrong
