# One command sets everything up and runs the tests:  make test
# make gpu-check takes GPU_OUT=<folder>, GPU_PARTS="<parts>", GPU_BUNDLE=<file.tar.gz> and GPU_DEADLINE=<seconds>
# (scripts/gpu_check.sh)
PYTHON ?= python3
export WANDB_MODE ?= disabled

.PHONY: install test quickstart bench gpu-wheels gpu-check

install:  ## install lion-vit (editable) with its test dependencies
	$(PYTHON) -m pip install -q -e ".[test]"

test: install  ## the whole CPU suite (what .ci/run runs), on every core (pytest-xdist: idle workers steal queued tests)
	$(PYTHON) -m pytest -q -n auto --dist worksteal

quickstart: install  ## train the default model on the embedded digits dataset
	$(PYTHON) train.py

bench: install  ## the three benchmarks with their default small CPU settings (about 18 min on 2 cores); results in bench_out/
	$(PYTHON) -m pip install -q -e ".[bench]"
	$(PYTHON) scripts/benchmark_train.py
	$(PYTHON) scripts/benchmark_resolution.py
	$(PYTHON) scripts/benchmark_chunk.py

gpu-wheels:  ## where pip reaches PyPI: the kernel wheels that gpu-check installs on a GPU machine without network, into .whl/
	$(PYTHON) -m pip download -q --no-deps -d .whl "fla-core>=0.6,<0.7"

GPU_OUT ?= docs/benchmarks/gpu
gpu-check:  ## on a CUDA machine: Triton tests, equivalence, benchmarks, in parts of <10 min each -> $(GPU_OUT)/
	bash scripts/gpu_check.sh --out $(GPU_OUT) $(if $(GPU_BUNDLE),--bundle $(GPU_BUNDLE)) \
	    $(if $(GPU_DEADLINE),--deadline $(GPU_DEADLINE)) $(GPU_PARTS)
