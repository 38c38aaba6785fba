# One command each: `make demo` (set up, then run the CPU demo) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/python
	# torch first, pinned: on these machines 2.13.0 is a local CPU wheel (no multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench,hf]'

lint: setup
	$(BIN)/ruff check prefetch_offload tests bench examples
	$(BIN)/ruff format --check prefetch_offload tests bench examples

test: setup lint
	$(BIN)/python -m pytest -m "not gpu_only" -q

demo: setup
	$(BIN)/python bench/step.py --steps 3 --warmup 1 --modes none,disk --plot .scratch/memory.png

bench: setup
	$(BIN)/python bench/step.py
