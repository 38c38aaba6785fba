"""docs/recipes.md: the torch.compile example runs and is exact, and the doc cites what exists.

The distributed recipes' tests (DDP, FSDP2, the torchrun example) are in test_distributed.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _why_compile_cannot_run() -> str | None:
    """None where torch.compile can build CPU kernels here, else the reason."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile (dynamo) is not supported on this Python/platform"
    compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        return "torch.compile on CPU needs a C++ compiler (g++ or clang++, or $CXX); none found"
    return None


@pytest.mark.slow  # compiles: ~8 s with a warm inductor cache, ~27 s cold (2 cores)
def test_compile_per_block_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/compile_per_block.py at small size: every block compiled, gradients of every
    step bit-identical with and without disk offload, tensors really went to disk, the
    learned unpack order was used after the first step, and save_dir is left empty."""
    reason = _why_compile_cannot_run()
    if reason:
        pytest.skip(reason)
    from torch._dynamo.utils import counters

    example = _load_example("compile_per_block")
    save_dir = tmp_path / "acts"
    # About 25 MiB saved per step: more than one 8 MiB write batch (chunk_bytes), so
    # tensors reach the disk (a smaller step keeps them all in memory).
    argv = "--steps 3 --batch 4 --seq 128 --width 128 --depth 3 --heads 2 --vocab 64".split()
    torch._dynamo.reset()
    counters.clear()
    try:
        rc = example.main([*argv, "--save-dir", str(save_dir)])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    out = capsys.readouterr().out
    assert rc == 0, out
    assert graphs >= 1, "nothing was compiled"
    assert "gradients bit-identical at every step: True" in out, out
    m = re.search(r"offloaded (\d+) tensors .* learned order (\d+) of 3", out)
    assert m, out
    assert int(m.group(1)) > 0 and int(m.group(2)) >= 1, out
    assert list(save_dir.iterdir()) == []


def test_recipes_cite_files_and_tests_that_exist() -> None:
    """Every example, test and doc that docs/recipes.md names exists."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    paths = set(re.findall(r"`((?:examples|tests|docs)/[\w/.-]+\.(?:py|md))", text))
    assert paths, "no file citations found: the citation format changed"
    for p in sorted(paths):
        assert (ROOT / p).is_file(), p
    cited = set(re.findall(r"`(test_\w+)`", text))
    assert cited, "no test citations found: the citation format changed"
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
    assert cited <= defined, sorted(cited - defined)
