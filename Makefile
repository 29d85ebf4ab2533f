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

# TorchCodec's JPEG decoder (data.decode=gpu) is built for the lent GPU machines' Python 3.12 and torch 2.11 (0.16)
gpu-wheels:  ## where pip reaches PyPI: the wheels that gpu-check installs on a GPU machine without network, into .whl/
	$(PYTHON) -m pip download -q --no-deps -d .whl "fla-core>=0.6,<0.7"
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 -d .whl "torchcodec>=0.16,<0.17"

GPU_OUT ?= docs/benchmarks/gpu
gpu-check:  ## on a CUDA machine: Triton tests, equivalence, benchmarks, in parts of <10 min each -> $(GPU_OUT)/
	bash scripts/gpu_check.sh --out $(GPU_OUT) $(if $(GPU_BUNDLE),--bundle $(GPU_BUNDLE)) \
	    $(if $(GPU_DEADLINE),--deadline $(GPU_DEADLINE)) $(GPU_PARTS)
