#!/usr/bin/env bash
# The GPU checks in one command (make gpu-check), for a CUDA machine with PyTorch, timm and matplotlib
# and no network: wheels in .whl/ (make gpu-wheels, run where pip reaches PyPI) are installed first.
# Writes CSVs, PNGs and logs to $1 (default docs/benchmarks/gpu); on an H100 it fits one 10-minute call.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/benchmarks/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lion-vit-site .whl/*.whl
    export PYTHONPATH=/tmp/lion-vit-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 - <<'PY' | tee "$out/environment.txt"
import subprocess, torch, timm
from lion_vit.ops import triton
print(f"commit {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}")
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, timm {timm.__version__}, "
      f"flash-linear-attention {'installed' if triton.available() else 'MISSING'}")
PY
bench() { echo "== $*"; "$@"; }
# the triton backend against the float64 reference on CUDA tensors (TF32 off), and the dispatcher
bench python3 -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_dispatch.py 2>&1 | tee "$out/tests.log"
bench python3 scripts/check_equivalence.py --device cuda --json "$out/equivalence.json" > "$out/equivalence.log"
tail -n 1 "$out/equivalence.log"
lion_train="lion_lit_small lion_d_small lion_s_small lion_d_natural_small lion_s_natural_small"
bench python3 scripts/benchmark_train.py --device cuda --dtype bfloat16 --batch-size 256 --steps 10 \
    --models deit_small_patch16_224 $lion_train --out "$out/train"
bench python3 scripts/benchmark_train.py --device cuda --dtype bfloat16 --batch-size 256 --steps 10 --compile \
    --models deit_small_patch16_224 $lion_train --out "$out/train_compile"
bench python3 scripts/benchmark_train.py --device cuda --dtype bfloat16 --batch-size 32 --img-size 896 --steps 5 \
    --models deit_small_patch16_224 lion_d_small lion_d_natural_small --out "$out/train_896"
for batch in 1 16; do
    bench python3 scripts/benchmark_resolution.py --device cuda --dtype bfloat16 --batch-size "$batch" --rounds 3 \
        --resolutions 224 448 896 1248 1792 --runs deit_small_patch16_224 lion_d_small:attention \
        lion_d_small:chunk:64 lion_d_small:rnn lion_d_natural_small:chunk:64 lion_d_natural_small:rnn \
        --out "$out/resolution_b$batch"
done
echo "written: $out"
