# One command sets everything up and runs the tests:  make test
PYTHON ?= python3
export WANDB_MODE ?= disabled

.PHONY: install test quickstart bench

install:  ## install lion-vit (editable) with its test dependencies
	$(PYTHON) -m pip install -q -e ".[test]"

test: install  ## the whole CPU suite (what .ci/run runs)
	$(PYTHON) -m pytest -q

quickstart: install  ## train the default model on the embedded digits dataset
	$(PYTHON) train.py

bench: install  ## the three benchmarks with their default small CPU settings (10-15 min); results in bench_out/
	$(PYTHON) scripts/benchmark_train.py
	$(PYTHON) scripts/benchmark_resolution.py
	$(PYTHON) scripts/benchmark_chunk.py
