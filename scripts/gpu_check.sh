#!/usr/bin/env bash
# The GPU checks (make gpu-check), for a CUDA machine with PyTorch, timm and matplotlib and no network:
# wheels in .whl/ (make gpu-wheels, run where pip reaches PyPI) are installed first.
#
#   scripts/gpu_check.sh [--out DIR] [--bundle FILE.tar.gz] [--commit REV] [--deadline S] [--dry-run] [PART ...]
#
# PART: tests equivalence inference graphs fused fused_tests fallback normaliser forms compile compile_natural input
# input_gpu
# (all by default, in this order), then the table of the targets met and the settings the timings pick
# (scripts/gpu_targets.py). Each part fits a 10-minute call on a cold H100 (its estimate is printed
# before it runs, and by --dry-run); the calls documented in docs/benchmarks.md are
#   fused | fused_tests | tests inference | equivalence fallback | normaliser forms | graphs compile
#   | compile_natural | input | input_gpu
# Each part's CSVs, PNGs and logs go to DIR (default docs/benchmarks/gpu); Triton's and Inductor's
# caches go to DIR/cache, so that a warm machine reuses them (never packed, nor are checkpoints). --bundle packs
# DIR into one archive after every measurement, so that a run cut short still returns what it finished. --commit
# names the code measured where the copy has no git history. --deadline S: no measurement runs past S
# seconds from the start (the one running then is interrupted, as by Ctrl-C, so that pytest still prints its
# failures and durations, and killed 20 s later if it has not ended; its log kept; those after it are skipped,
# and said so), then the targets table and the bundle, so that a call limited to S + 60 s ends with what it
# measured. --dry-run prints the estimates (# lines) and the commands instead of running them
# (tests/test_gpu_check.py checks them on a CPU).
set -euo pipefail
usage() { echo "gpu_check.sh: $1; see the usage at the top of scripts/gpu_check.sh" >&2; exit 2; }
all_parts="tests equivalence inference graphs fused fused_tests fallback normaliser forms compile"
all_parts+=" compile_natural input input_gpu"
# minutes on a cold H100 (Triton compiles and FLA autotunes each kernel once per shape key; Inductor compiles each
# model once): tests, inference and fallback as measured on a cold H100, equivalence on a cold H200
# (docs/benchmarks.md; 3 min, and as much again for its bfloat16 run), compile from four models compiled and timed
# in 169 s on the H100, the others estimates until the durations printed after each part replace them (input: 12,000
# JPEGs made on 16 cores, then four train.py runs of two epochs and four model-only measurements, two of them
# compiled; fused: the kernel op by op, then seven short eager runs, one of which took 33 s on a cold H200;
# fused_tests: 47 tests, FLA's route's since deleted among them, ran past 517 s on a cold H200; input_gpu: the
# device decoding's tests, then input's runs with data.decode=gpu)
declare -A minutes=([tests]=2 [equivalence]=6 [inference]=4 [graphs]=4 [fused]=7 [fused_tests]=9 [fallback]=2
                    [normaliser]=3 [forms]=6 [compile]=4 [compile_natural]=4 [input]=9 [input_gpu]=9)
out="" bundle="" commit="" deadline="" dry="" parts=()
while (($#)); do
    case $1 in
        --out|--bundle|--commit|--deadline) (($# > 1)) || usage "$1 needs a value"
            declare "${1#--}=$2"; shift 2 ;;
        --dry-run) dry=1; shift ;;
        -*) usage "unknown option $1" ;;
        *) [[ " $all_parts " == *" $1 "* ]] || usage "unknown part '$1' (parts: $all_parts)"
            parts+=("$1"); shift ;;
    esac
done
((${#parts[@]})) || read -ra parts <<<"$all_parts"
[[ -z $deadline || $deadline =~ ^[1-9][0-9]*$ ]] || usage "--deadline takes whole seconds, not '$deadline'"
absolute() { [[ -z $1 || $1 == /* ]] && echo "$1" || echo "$PWD/$1"; }  # paths given are the caller's
out=$(absolute "$out") bundle=$(absolute "$bundle")
cd "$(dirname "$0")/.."
out=${out:-docs/benchmarks/gpu}

pack() {  # (without the caches, nor the checkpoints of the input parts' train.py runs: hundreds of MB)
    [[ -z $bundle ]] || tar czf "$bundle" --exclude="$(basename "$out")/cache" --exclude="*.pt" \
        -C "$(dirname "$out")" "$(basename "$out")"; }

failed=() stopped=() skipped=()
run() {  # one measurement: its command, its output to the screen and to $out/<log>.log, its duration, then
    # the bundle; a failure is reported at the end and does not stop the measurements after it
    local log=$1; shift
    if [[ -n $dry ]]; then printf '%q ' "$@"; echo; return; fi
    local start=$SECONDS rc=0 limit=()
    if [[ -n $deadline ]]; then
        ((deadline > SECONDS)) || { skipped+=("$log"); echo "-- $log: skipped (--deadline $deadline s)"; return; }
        limit=(timeout --signal=INT --kill-after=20 $((deadline - SECONDS)))
    fi
    echo "== $*"
    "${limit[@]}" "$@" 2>&1 | tee "$out/$log.log" || rc=${PIPESTATUS[0]}
    if ((rc == 124 || rc == 137)) && ((${#limit[@]})); then stopped+=("$log"); elif ((rc)); then failed+=("$log"); fi
    echo "-- $log: $((SECONDS - start)) s"
    pack
}

if [[ -z $dry ]]; then
    python3 -c "import sys, torch; torch.cuda.is_available() or sys.exit('gpu_check.sh: no CUDA device here \
(torch.cuda.is_available() is False); run it on a GPU machine')" || exit 2
    export PYTHONUNBUFFERED=1 WANDB_MODE=disabled PIP_ROOT_USER_ACTION=ignore
    cache=$(absolute "$out")/cache  # kernels compiled and autotuned, graphs compiled: reused by a later call
    export TRITON_CACHE_DIR=$cache/triton TORCHINDUCTOR_CACHE_DIR=$cache/inductor FLA_CACHE_RESULTS=1
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lion-vit-site .whl/*.whl
        export PYTHONPATH=/tmp/lion-vit-site:${PYTHONPATH:-}
    fi
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    commit=${commit:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
    environment=$(COMMIT=$commit python3 - <<'PY'
import os, torch, timm, triton as compiler
from lion_vit.ops import triton
print(f"commit {os.environ['COMMIT']}")
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {compiler.__version__}, "
      f"timm {timm.__version__}, flash-linear-attention "
      f"{'installed' if triton.available() else triton.unavailable_reason().upper()}")
print(f"float32 dots: PyTorch matmul precision {torch.get_float32_matmul_precision()!r} (TF32 "
      f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}), Triton kernels "
      f"{os.environ.get('TRITON_F32_DEFAULT', 'tf32')!r}; the tests part runs both in IEEE float32, "
      "the benchmarks in bfloat16")
fails = triton.available() and triton.chunk_backward_fails(torch.device("cuda"))
print(f"flash-linear-attention's chunk backward: {'FAILS here' if fails else 'runs'} (where it fails, training in "
      "the chunk form runs Tuning.chunk_backward_fallback)")
from lion_vit.data.gpu import jpeg_decoder
from lion_vit.errors import UserError
try:
    print(f"data.decode=gpu decodes with {jpeg_decoder().name}'s JPEG decoder")
except UserError as error:
    print(f"data.decode=gpu: {error}")
PY
) || exit 2
    mkdir -p "$out"
    echo "$environment" | tee "$out/environment.txt"
fi

deit=deit_small_patch16_224
lion="lion_lit_small lion_d_small lion_s_small lion_d_natural_small lion_s_natural_small"
train=(python3 scripts/benchmark_train.py --device cuda --dtype bfloat16)
for part in "${parts[@]}"; do
    start=$SECONDS
    echo "# part $part: about ${minutes[$part]} min on a cold H100"
    case $part in
        tests)  # the triton backend against the float64 reference on CUDA tensors, IEEE float32 dots; eight
            # workers compile and autotune side by side
            run tests env TRITON_F32_DEFAULT=ieee python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_triton.py \
                tests/test_dispatch.py ;;
        equivalence)  # float32 (IEEE dots), then every form under bfloat16 autocast, as training runs them,
            # against the attention form's own rounding (x_attention)
            run equivalence python3 scripts/check_equivalence.py --device cuda --json "$out/equivalence.json"
            run equivalence_bf16 python3 scripts/check_equivalence.py --device cuda --dtype bfloat16 \
                --json "$out/equivalence_bf16.json" ;;
        inference)  # time and peak memory against DeiT-S (flash attention) up to 1792 px
            for batch in 1 16; do
                run "resolution_b$batch" python3 scripts/benchmark_resolution.py --device cuda --dtype bfloat16 \
                    --batch-size "$batch" --rounds 3 --resolutions 224 448 896 1248 1792 --runs $deit \
                    lion_d_small:attention lion_d_small:chunk:64 lion_d_small:rnn lion_d_natural_small:attention \
                    lion_d_natural_small:chunk:64 lion_d_natural_small:rnn --out "$out/resolution_b$batch"
            done ;;
        graphs)  # batch 1 at 1248 px, eager against its CUDA graph and against torch.compile(mode="reduce-overhead")
            run graphs python3 scripts/benchmark_cuda_graph.py --compile --out "$out/graphs" ;;
        fused)  # the fused attention form (the bidirectional kernel): the kernel op by op at 224 px (its launch
            # settings, LION-lit's Q (K^T V) against it), then a training step, eager, --attn-form auto (the fused
            # attention form below auto_chunk_min_tokens) at 224 px batch 256 (with each model's costliest GPU kernels,
            # --profile) and 448 px batch 64, the same op by op at 448 px, the portable attention form
            # (--attn-backend torch) at 224 px, 896 px batch 32 (there beside both forms by name); inference at
            # 224 px, batch 16 and 256, and at batch 16 eager against CUDA graphs (how much of it is the host's)
            run fused_kernels python3 scripts/benchmark_fused.py --img-size 224 --batch-size 256 \
                --out "$out/fused_kernels"
            run train "${train[@]}" --batch-size 256 --steps 10 --profile --models $deit $lion --out "$out/train"
            run train_448 "${train[@]}" --batch-size 64 --img-size 448 --steps 5 --models $deit $lion \
                --out "$out/train_448"
            run fused_kernels_448 python3 scripts/benchmark_fused.py --img-size 448 --batch-size 64 \
                --out "$out/fused_kernels_448"
            run train_torch "${train[@]}" --batch-size 256 --steps 10 --attn-backend torch \
                --models $deit lion_d_small lion_s_natural_small --out "$out/train_torch"
            run train_896 "${train[@]}" --batch-size 32 --img-size 896 --steps 5 --models $deit lion_d_small \
                lion_d_natural_small lion_d_small:attention lion_d_small:chunk --out "$out/train_896"
            for batch in 16 256; do
                run "inference_224_b$batch" python3 scripts/benchmark_resolution.py --device cuda --dtype bfloat16 \
                    --batch-size "$batch" --rounds 5 --resolutions 224 --runs $deit lion_d_small:attention \
                    lion_d_natural_small:attention --out "$out/inference_224_b$batch"
            done
            run graphs_224_b16 python3 scripts/benchmark_cuda_graph.py --img-size 224 --batch-size 16 --runs $deit \
                lion_d_small:attention lion_d_natural_small:attention --out "$out/graphs_224_b16" ;;
        fused_tests)  # the fused attention form's tests natively, IEEE float32 dots; each test's outcome as it ends
            # (-v: a deadline leaves the names), the slowest at the end
            run fused_tests env TRITON_F32_DEFAULT=ieee python3 -m pytest -v -n 8 -p no:cacheprovider --durations=20 \
                tests/test_triton.py -k "(attention or fused or bidirectional or linear) and not (chunk or vector)" ;;
        fallback)  # where FLA's chunk backward fails: Tuning.chunk_backward_fallback, 896 px batch 32
            run fallback_torch "${train[@]}" --batch-size 32 --img-size 896 --steps 5 --attn-backend torch \
                --models $deit lion_d_small:chunk:64 lion_d_natural_small:chunk:64 --out "$out/fallback_torch"
            run fallback_rnn "${train[@]}" --batch-size 32 --img-size 896 --steps 5 --attn-backend triton \
                --models $deit lion_d_small:rnn lion_d_natural_small:rnn --out "$out/fallback_rnn"
            run fallback_forward "${train[@]}" --batch-size 32 --img-size 896 --steps 5 --attn-backend triton \
                --chunk-backward-fallback forward --models $deit lion_d_small:chunk lion_d_natural_small:chunk \
                --out "$out/fallback_forward" ;;
        normaliser)  # the normaliser scan's launch settings (ops/triton/normaliser.py), 1248 px, batch 1 and 16;
            # then inference at batch 16 in the code's groups of images and in one call (Tuning.group_share; the rnn
            # form's Tuning.recurrent_group_programs)
            run normaliser python3 scripts/benchmark_normaliser.py
            groups=(python3 scripts/benchmark_resolution.py --device cuda --dtype bfloat16 --batch-size 16 --rounds 2
                    --resolutions 896 1248 1792 --runs $deit lion_d_small:chunk:64 lion_d_natural_small:chunk:64
                    lion_d_small:rnn)
            run groups_code "${groups[@]}" --out "$out/groups_code"
            run groups_one "${groups[@]}" --group-share 1000 --out "$out/groups_one" ;;
        forms)  # attention form or chunk kernels for training, by sequence length: Tuning.auto_chunk_min_tokens
            for size in 384 512 640 896; do
                run "forms_$size" "${train[@]}" --batch-size 32 --img-size "$size" --steps 5 --models $deit \
                    lion_d_small:attention lion_d_small:chunk lion_d_natural_small:attention \
                    lion_d_natural_small:chunk --out "$out/forms_$size"
            done ;;
        compile)  # both sides compiled: the training targets at 224 px batch 256 (one scan); first, seconds:
            # the attention form's L x L products as they are, padded, and with [V, 1] (the normaliser's column)
            run products python3 scripts/benchmark_products.py --device cuda --dtype bfloat16
            run train_compile "${train[@]}" --batch-size 256 --steps 10 --compile --models $deit lion_lit_small \
                lion_d_small lion_s_small --out "$out/train_compile" ;;
        compile_natural)  # the same for the two-scan models (DeiT-S again: its compiled graph is in the cache)
            run train_compile_natural "${train[@]}" --batch-size 256 --steps 10 --compile --models $deit \
                lion_d_natural_small lion_s_natural_small --out "$out/train_compile_natural" ;;
        input)  # end to end: train.py on synthetic JPEGs of ImageNet's sizes (made on this machine's disk) with
            # the DeiT-S recipe and num_workers=auto, against the model-only step, eager and compiled
            run input python3 scripts/benchmark_input.py --device cuda --images 12000 --batch-size 256 \
                --train $deit lion_d_small --compile both --data /tmp/lion-vit-input --out "$out/input" ;;
        input_gpu)  # the same with data.decode=gpu (nvJPEG and the augmentation on the GPU), after its tests there
            run tests_gpu_decode python3 -m pytest -q -p no:cacheprovider tests/test_gpu_decode.py
            run input_gpu python3 scripts/benchmark_input.py --device cuda --images 12000 --batch-size 256 \
                --train $deit lion_d_small --compile both --decode gpu --data /tmp/lion-vit-input \
                --out "$out/input_gpu" ;;
    esac
    [[ -n $dry ]] || echo "-- part $part: $((SECONDS - start)) s"
done
deadline=""  # the targets (docs/benchmarks.md) against what was measured: seconds, whatever the deadline
run targets python3 scripts/gpu_targets.py "$out"
[[ -n $dry ]] || echo "written: $out${bundle:+ (packed into $bundle)}"
((${#stopped[@]})) && echo "STOPPED at the deadline: ${stopped[*]} (their logs are in $out)"
((${#skipped[@]})) && echo "SKIPPED, past the deadline: ${skipped[*]}"
((${#failed[@]})) && echo "FAILED: ${failed[*]} (their logs are in $out)"
if ((${#failed[@]} + ${#stopped[@]} + ${#skipped[@]})); then exit 1; fi
